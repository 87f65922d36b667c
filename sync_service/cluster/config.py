"""Typed configuration of a cluster run (``weightsync run --config FILE``) and of its manifests.

One YAML file is the single source of truth: ``weightsync run`` reads the ``model`` / ``trainers`` /
``engines`` / ``sync`` / ``run`` / ``secret`` sections; ``deploy/render.py`` reads ``cluster`` (and
the resource amounts of ``trainers`` / ``engines``) to write the KubeRay and cluster-launcher
manifests. Parsed with PyYAML (``yaml.safe_load``: plain data only, no Python objects) into the
dataclasses below; every error names the offending field (``engines.count``) and the fix.
See docs/deploy.md for a field-by-field guide and deploy/example-config.yaml for an example.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from sync_service import defaults
from sync_service.transports.spec import TRANSPORTS

__all__ = ["ConfigError", "DeployConfig", "load_config", "parse_config"]

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
TRANSPORT_CHOICES = ("auto", *TRANSPORTS)


class ConfigError(ValueError):
    """A bad config value; ``field`` is its dotted path (``engines.count``)."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field = field_path


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The checkpoint the trainers shard and the engines load (paths as seen by every Ray node)."""

    base: Path
    """Base checkpoint directory (``config.json`` + ``*.safetensors``), on storage every node mounts."""
    adapter: Path | None = None
    """PEFT LoRA adapter directory; ``null`` syncs the base as is."""


@dataclass(kw_only=True, slots=True)
class TrainerGroupConfig:
    """TrainerShard actors: ``ep · tp`` shards, one placement-group bundle each."""

    ep: int = 1
    """Expert-parallel ranks."""
    tp: int = 1
    """Tensor-parallel ranks (shards = ep · tp)."""
    resource: str = "trainer"
    """Ray custom resource a shard needs (a trainer node advertises it: ``--resources '{"trainer": N}'``)."""
    resource_per_shard: float = 1.0
    """Amount of ``resource`` per shard (a node with ``N`` holds ``N / resource_per_shard`` shards)."""
    num_cpus: float = 0.0
    """CPUs reserved per shard (0: placement by the custom resource only)."""
    num_gpus: float = 0.0
    """GPUs reserved per shard."""
    placement: str = "PACK"
    """Placement-group strategy of the shard bundles: PACK | SPREAD | STRICT_PACK | STRICT_SPREAD."""

    @property
    def shards(self) -> int:
        return self.ep * self.tp


@dataclass(kw_only=True, slots=True)
class EngineGroupConfig:
    """RolloutEngine actors: ``count`` engines, one placement-group bundle each."""

    count: int = 1
    """Rollout engines."""
    engine: str = "hf"
    """Engine kind (``actors.rollout.ENGINES``): ``hf`` (transformers), ``memory``."""
    resource: str = "rollout"
    """Ray custom resource an engine needs (a rollout node advertises it)."""
    resource_per_engine: float = 1.0
    """Amount of ``resource`` per engine."""
    num_cpus: float = 0.0
    """CPUs reserved per engine."""
    num_gpus: float = 0.0
    """GPUs reserved per engine."""
    placement: str = "STRICT_SPREAD"
    """Placement-group strategy of the engine bundles (STRICT_SPREAD: one engine per node)."""


@dataclass(kw_only=True, slots=True)
class SyncSection:
    """``sync_service.api.SyncConfig`` plus the transport choice."""

    transport: str = "auto"
    """``auto`` (same host: shm; across hosts: Ray object store), or ``shm`` | ``ray`` | ``torch``."""
    bucket_bytes: int = defaults.BUCKET_BYTES
    """Bucket payload size, bytes (positive multiple of 64)."""
    timeout_s: float = defaults.TIMEOUT_S
    """Bound of every blocking step (placement, connect, send, receive, commit), seconds."""
    delta: bool = defaults.DELTA
    """After an engine's first full sync, send only the names the adapter changes."""


@dataclass(kw_only=True, slots=True)
class RunSection:
    """What ``weightsync run`` does once placed."""

    versions: int = 3
    """Weight versions pushed (a deterministic training step changes the factors between them)."""
    verify: bool = True
    """Compare every engine with the reference merge after each version (needs ``model`` on the driver)."""


@dataclass(kw_only=True, slots=True)
class SecretConfig:
    """The per-session HMAC secret (a Kubernetes Secret mounted as a file and exported as an env var)."""

    env: str = "WEIGHTSYNC_SESSION_SECRET"
    """Environment variable holding the secret (read first)."""
    file: Path | None = Path("/var/run/weightsync/session-secret")
    """File holding the secret (read when the env var is unset)."""
    required: bool = False
    """Fail when neither holds a secret of at least ``min_bytes``."""
    min_bytes: int = 32
    """Shortest accepted secret, bytes (HMAC-SHA256 key: 32 bytes of entropy)."""
    k8s_name: str = "weightsync-session"
    """Kubernetes Secret name (manifests)."""
    k8s_key: str = "session-secret"
    """Key inside the Secret (the mounted file name)."""


@dataclass(kw_only=True, slots=True)
class NodeGroupConfig:
    """One Kubernetes worker group / launcher node type."""

    replicas: int = 1
    """Pods (nodes) in the group."""
    cpu: int = 2
    """CPUs per pod (also the Ray ``num-cpus``)."""
    memory: str = "8Gi"
    """Memory per pod (Kubernetes quantity)."""
    gpu: int = 0
    """GPUs per pod (``nvidia.com/gpu``)."""
    resource_amount: float = 1.0
    """Amount of the group's custom resource each node advertises."""
    instance_type: str = "m6i.2xlarge"
    """Cluster launcher: cloud instance type of the node (``node_config.InstanceType``)."""


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    """The Ray cluster the manifests describe (read by ``deploy/render.py``)."""

    name: str = "weightsync"
    """RayCluster / cluster-launcher name."""
    namespace: str = "default"
    """Kubernetes namespace."""
    image: str = "weightsync:cpu"
    """Container image (deploy/Dockerfile)."""
    ray_version: str = "2.60.0"
    """Ray version of the image (KubeRay ``rayVersion``)."""
    head: NodeGroupConfig = field(default_factory=lambda: NodeGroupConfig(cpu=2, memory="4Gi", resource_amount=0.0))
    """Head pod (runs the driver; advertises no trainer/rollout resource)."""
    trainer_group: NodeGroupConfig = field(default_factory=NodeGroupConfig)
    """Trainer nodes; each advertises ``trainers.resource: resource_amount``."""
    rollout_group: NodeGroupConfig = field(default_factory=NodeGroupConfig)
    """Rollout nodes; each advertises ``engines.resource: resource_amount``."""
    model_volume_claim: str = "weightsync-models"
    """PersistentVolumeClaim mounted at ``model_mount_path`` on every pod."""
    model_mount_path: str = "/models"
    """Where the model volume is mounted."""
    config_map: str = "weightsync-config"
    """ConfigMap holding this file as ``config.yaml`` (mounted at /etc/weightsync on the head)."""
    region: str = "us-west-2"
    """Cluster launcher: cloud region (provider type ``aws``)."""


@dataclass(kw_only=True, slots=True)
class DeployConfig:
    """The whole file."""

    model: ModelConfig
    """Checkpoint paths."""
    trainers: TrainerGroupConfig = field(default_factory=TrainerGroupConfig)
    """Trainer shards and their placement."""
    engines: EngineGroupConfig = field(default_factory=EngineGroupConfig)
    """Rollout engines and their placement."""
    sync: SyncSection = field(default_factory=SyncSection)
    """Sync settings."""
    run: RunSection = field(default_factory=RunSection)
    """Run settings."""
    secret: SecretConfig = field(default_factory=SecretConfig)
    """Session secret source."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Manifest settings."""


def load_config(path: str | Path) -> DeployConfig:
    """Read and validate a YAML config. Raises ConfigError (bad field), FileNotFoundError."""
    import yaml

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)  # one line: PyYAML's own text spans several
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = getattr(exc, "problem", None) or " ".join(str(exc).split())
        raise ConfigError("<top>", f"not valid YAML ({where}{what}); fix the syntax") from None
    return parse_config(raw)


def parse_config(raw: object) -> DeployConfig:
    """Build a DeployConfig from plain data (``yaml.safe_load`` output) and check it."""
    cfg = _build(DeployConfig, raw, "")
    validate(cfg)
    return cfg


def _build(cls: type, raw: object, where: str):
    if not isinstance(raw, dict):
        raise ConfigError(where or "<top>", f"expected a mapping of {cls.__name__} fields, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(_join(where, unknown[0]), f"unknown field; known fields: {sorted(fields)}")
    missing = [n for n, f in fields.items() if n not in raw and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(_join(where, missing[0]), "required field is missing; add it")
    return cls(**{name: _convert(hints[name], value, _join(where, name)) for name, value in raw.items()})


def _convert(hint, value, where: str):
    """Coerce one YAML value to the field's type (int → float and str → Path allowed; bool never an int)."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if hint is Path and isinstance(value, str) and value:
        return Path(value)
    if hint is float and type(value) in (int, float):
        return float(value)
    if hint in (int, str, bool) and type(value) is hint:
        return value
    raise ConfigError(where, f"expected {getattr(hint, '__name__', hint)}, got {value!r} ({type(value).__name__})")


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def validate(cfg: DeployConfig) -> None:
    """Cross-field checks. Raises ConfigError naming the field and the fix."""
    t, e, s, c = cfg.trainers, cfg.engines, cfg.sync, cfg.cluster
    for path, value in (("trainers.ep", t.ep), ("trainers.tp", t.tp), ("engines.count", e.count),
                        ("run.versions", cfg.run.versions), ("secret.min_bytes", cfg.secret.min_bytes)):
        if value < 1:
            raise ConfigError(path, f"{value} must be >= 1")
    for path, value in (("trainers.placement", t.placement), ("engines.placement", e.placement)):
        if value not in PLACEMENT_STRATEGIES:
            raise ConfigError(path, f"{value!r}; use one of {PLACEMENT_STRATEGIES}")
    for path, value in (("trainers.resource_per_shard", t.resource_per_shard),
                        ("engines.resource_per_engine", e.resource_per_engine)):
        if value <= 0:
            raise ConfigError(path, f"{value} must be > 0 (placement is by this custom resource)")
    for path, value in (("trainers.num_cpus", t.num_cpus), ("trainers.num_gpus", t.num_gpus),
                        ("engines.num_cpus", e.num_cpus), ("engines.num_gpus", e.num_gpus)):
        if value < 0:
            raise ConfigError(path, f"{value} must be >= 0")
    if t.resource == e.resource:
        raise ConfigError("engines.resource", f"{e.resource!r} equals trainers.resource; give each group its own")
    if s.transport not in TRANSPORT_CHOICES:
        raise ConfigError("sync.transport", f"{s.transport!r}; use one of {TRANSPORT_CHOICES}")
    if s.bucket_bytes <= 0 or s.bucket_bytes % 64:
        raise ConfigError("sync.bucket_bytes", f"{s.bucket_bytes} must be a positive multiple of 64")
    if s.timeout_s <= 0:
        raise ConfigError("sync.timeout_s", f"{s.timeout_s} must be > 0")
    _check_capacity("cluster.trainer_group", c.trainer_group, t.shards, t.resource_per_shard, "trainers.ep · trainers.tp")
    _check_capacity("cluster.rollout_group", c.rollout_group, e.count, e.resource_per_engine, "engines.count")
    if e.placement == "STRICT_SPREAD" and c.rollout_group.replicas < e.count:
        raise ConfigError("cluster.rollout_group.replicas", f"{c.rollout_group.replicas} nodes cannot hold {e.count} "
                          "engines one per node (engines.placement STRICT_SPREAD); add replicas or use SPREAD")
    if t.placement == "STRICT_SPREAD" and c.trainer_group.replicas < t.shards:
        raise ConfigError("cluster.trainer_group.replicas", f"{c.trainer_group.replicas} nodes cannot hold {t.shards} "
                          "shards one per node (trainers.placement STRICT_SPREAD); add replicas or use PACK")


def _check_capacity(path: str, group: NodeGroupConfig, actors: int, per_actor: float, what: str) -> None:
    if group.replicas < 1 or group.cpu < 1 or group.gpu < 0:
        raise ConfigError(path, f"replicas={group.replicas}, cpu={group.cpu}, gpu={group.gpu}: need replicas >= 1, cpu >= 1")
    per_node = int(group.resource_amount / per_actor + 1e-9)
    if per_node < 1 or per_node * group.replicas < actors:
        raise ConfigError(f"{path}.resource_amount", f"{group.replicas} node(s) × {group.resource_amount} hold "
                          f"{per_node * group.replicas} actor(s) of {per_actor}, but {what} asks for {actors}; "
                          "raise resource_amount or replicas")
