"""Place trainer shards and rollout engines on a Ray cluster by custom resources (``weightsync run``).

Each group gets one placement group (Ray ``ray.util.placement_group``) with one bundle per actor —
``{resource: amount}`` plus CPU/GPU when asked — and actor ``i`` is created in bundle ``i``, so the
node of every actor is known from the placement-group table before any byte moves (that table also
decides the transport, see ``choose_transport``). When a node dies, Ray reschedules its bundles onto
live nodes that advertise the resource; ``Deployment.replace_engine(i)`` starts a fresh engine in
bundle ``i`` once that happened (a replacement node joined).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sync_service.cluster.config import DeployConfig
from sync_service.transports.spec import auto_transport

__all__ = ["Deployment", "PlacementError", "bundle_nodes", "choose_transport", "node_addresses", "place_group", "wait_bundle_alive"]


class PlacementError(RuntimeError):
    """The cluster cannot hold a group's bundles within the timeout."""


def place_group(name: str, bundle: dict[str, float], count: int, strategy: str, timeout_s: float) -> PlacementGroup:
    """A ready placement group of ``count`` copies of ``bundle``. Blocks up to ``timeout_s``.

    Raises:
        PlacementError: not placeable in time (the group is removed); the message lists what the
            cluster has, so the fix (nodes advertising the resource) is visible.
    """
    pg = placement_group([dict(bundle) for _ in range(count)], strategy=strategy, name=name)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise PlacementError(
            f"{name}: {count} bundle(s) of {bundle} ({strategy}) not placeable within {timeout_s:.0f} s; the cluster "
            f"has {ray.cluster_resources()}; add nodes advertising these resources (rayStartParams.resources) or "
            "lower the amounts in the config")
    return pg


def bundle_nodes(pg: PlacementGroup) -> list[str]:
    """Node id (hex) of every bundle of ``pg``, by bundle index ('' while one is unplaced)."""
    table = placement_group_table(pg)["bundles_to_node_id"]
    return [table.get(i, "") for i in range(pg.bundle_count)]


def wait_bundle_alive(pg: PlacementGroup, index: int, timeout_s: float, poll_s: float = 0.2) -> bool:
    """Whether bundle ``index`` of ``pg`` sits on a live node within ``timeout_s`` (polls the GCS)."""
    deadline = time.monotonic() + timeout_s
    while True:
        node = bundle_nodes(pg)[index]
        if node and placement_group_table(pg)["state"] == "CREATED" and node in node_addresses():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def node_addresses() -> dict[str, str]:
    """Node id (hex) -> IP address of every live node."""
    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}


def choose_transport(requested: str, trainer_ips: list[str], engine_ips: list[str], *,
                     device: str = "cpu") -> tuple[str, str]:
    """The ``SyncConfig.transport`` for ``requested`` (``auto`` or a kind) and why.

    ``auto``: the one table ``transports.spec.AUTO_TRANSPORT`` with (one host?, bucket ``device``): CPU buckets
    on one host → ``shm`` (shared memory, 10-12 GB/s here), across hosts → ``ray`` (object store; zero-copy
    reads on each node); CUDA buckets on one host → ``cuda_ipc``, across hosts → ``torch`` (NCCL: a single
    trainer shard and a rendezvous address every engine reaches).
    """
    if requested != "auto":
        return requested, "set in the config (sync.transport)"
    hosts = set(trainer_ips) | set(engine_ips)
    kind = auto_transport(len(hosts) == 1, device)
    if len(hosts) == 1:
        return kind, f"every actor on host {next(iter(hosts))}" + ("" if device == "cpu" else f", {device} buckets")
    return kind, f"actors on {len(hosts)} hosts {sorted(hosts)}" + ("" if device == "cpu" else f", {device} buckets")


@dataclass(slots=True)
class Deployment:
    """Placed trainer shards and rollout engines of one config (actor ``i`` sits in bundle ``i``)."""

    config: DeployConfig
    trainer_pg: PlacementGroup
    engine_pg: PlacementGroup
    trainers: list
    engines: list
    launcher: object
    """Starts the actors (``protocols.endpoints.Launcher``; ``actors.launch.RayLauncher``)."""

    @classmethod
    def start(cls, config: DeployConfig, launcher) -> "Deployment":
        """Reserve both groups, start the shards (gloo group joined, shards loaded) and the engines
        through ``launcher``. Blocks up to about ``3 · sync.timeout_s``. Raises PlacementError, ray
        errors from actor start."""
        t, e, timeout = config.trainers, config.engines, config.sync.timeout_s
        trainer_pg = place_group("weightsync-trainers", _bundle(t.resource, t.resource_per_shard, t.num_cpus, t.num_gpus),
                                 t.shards, t.placement, timeout)
        try:
            engine_pg = place_group("weightsync-engines", _bundle(e.resource, e.resource_per_engine, e.num_cpus,
                                                                  e.num_gpus), e.count, e.placement, timeout)
        except BaseException:
            remove_placement_group(trainer_pg)
            raise
        dep = cls(config=config, trainer_pg=trainer_pg, engine_pg=engine_pg, trainers=[], engines=[], launcher=launcher)
        try:
            dep.trainers = launcher.start_trainers(config.model.base, config.model.adapter, ep=t.ep, tp=t.tp, timeout_s=timeout,
                                          actor_options=[dep._trainer_options(r) for r in range(t.shards)])
            dep.engines = launcher.start_engines(config.model.base, e.count, engine=e.engine, timeout_s=timeout,
                                                 actor_options=[dep._engine_options(i) for i in range(e.count)])
        except BaseException:
            dep.close()
            raise
        return dep

    def trainer_nodes(self) -> list[str]:
        """Node id of every trainer shard, by rank."""
        return bundle_nodes(self.trainer_pg)

    def engine_nodes(self) -> list[str]:
        """Node id of every engine bundle, by index."""
        return bundle_nodes(self.engine_pg)

    def transport(self) -> tuple[str, str]:
        """``choose_transport`` for the placed actors: (transport, reason)."""
        ips = node_addresses()
        return choose_transport(self.config.sync.transport, [ips.get(n, n) for n in self.trainer_nodes()],
                                [ips.get(n, n) for n in self.engine_nodes()])

    def replace_engine(self, index: int, *, prefix: str = "replacement") -> object:
        """Start a fresh engine in bundle ``index`` (after its node died and Ray rescheduled the
        bundle onto a live node). Returns the new actor; the caller admits it (``WeightSync.add_engine``).
        Blocks up to ``2 · sync.timeout_s``. Raises PlacementError: the bundle found no node in time."""
        timeout = self.config.sync.timeout_s
        if not wait_bundle_alive(self.engine_pg, index, timeout):
            raise PlacementError(f"engine bundle {index}: not rescheduled within {timeout:.0f} s; add a node advertising "
                                 f"{{{self.config.engines.resource!r}: {self.config.engines.resource_per_engine}}}")
        (engine,) = self.launcher.start_engines(self.config.model.base, 1, engine=self.config.engines.engine,
                                                timeout_s=timeout, actor_options=[self._engine_options(index)],
                                                prefix=f"{prefix}{index}-")
        self.engines[index] = engine
        return engine

    def close(self) -> None:
        """Kill every actor and release both placement groups (best effort)."""
        for actor in self.trainers + self.engines:
            try:
                ray.kill(actor)
            except Exception:
                pass
        for pg in (self.trainer_pg, self.engine_pg):
            try:
                remove_placement_group(pg)
            except Exception:
                pass

    def _trainer_options(self, rank: int) -> dict:
        t = self.config.trainers
        return _options(self.trainer_pg, rank, t.resource, t.resource_per_shard, t.num_cpus, t.num_gpus)

    def _engine_options(self, index: int) -> dict:
        e = self.config.engines
        return _options(self.engine_pg, index, e.resource, e.resource_per_engine, e.num_cpus, e.num_gpus)


def _bundle(resource: str, amount: float, num_cpus: float, num_gpus: float) -> dict[str, float]:
    extra = {"CPU": num_cpus, "GPU": num_gpus}
    return {resource: amount, **{k: v for k, v in extra.items() if v > 0}}


def _options(pg: PlacementGroup, index: int, resource: str, amount: float, num_cpus: float, num_gpus: float) -> dict:
    return {"num_cpus": num_cpus, "num_gpus": num_gpus, "resources": {resource: amount},
            "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                    placement_group_bundle_index=index)}
