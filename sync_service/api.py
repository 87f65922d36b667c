"""The weightsync API for an RL loop: ``WeightSync(trainers=..., engines=..., config=SyncConfig(...))``.

    sync = WeightSync(trainers=shards, engines=engines, config=SyncConfig(transport="shm"))
    for step in range(steps):
        ray.get([t.train_step.remote(step) for t in shards])   # the trainer changes its LoRA factors
        metrics = sync.push(step)                               # blocking; every engine serves `step`
    handle = sync.push_async(step)   # returns once the snapshot is taken; training may continue
    handle.result(timeout=60)        # -> SyncMetrics

Live refresh (docs/live-refresh.md): ``push_async`` overlaps the transfer with the next training
step; at most ``SyncConfig.max_in_flight`` pushes are in flight (a further ``push_async`` blocks
until the oldest commits: back-pressure); ``wait_for_version`` / ``wait_for_fresh`` hold rollouts
to versions >= latest - ``SyncConfig.max_staleness``; ``add_engine`` brings a late joiner to the
fleet's version by a peer copy, so the others keep receiving deltas.

Conventions of the peers: this is verl's/slime's "update_weights" and NeMo-RL's
``WeightSynchronizer.sync_weights() -> metrics``, with the snapshot / transfer split of an async
trainer. Setup (in the constructor) builds the plan once and validates it against every engine's
parameter table before any byte moves (``PlanMismatchError``).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from sync_service import defaults
from sync_service.coordinator import Coordinator, PlanMismatchError
from sync_service.coordinator.planning import DtypeConflictError
from sync_service.coordinator.join import JoinMetrics
from sync_service.coordinator.metrics import EngineResult, SyncError, SyncMetrics
from sync_service.coordinator.versions import check_version
from sync_service.coordinator.config_check import check_listen, is_kind, short_repr
from sync_service.transports.spec import RELAYS, TRANSPORTS, resolve_backend
from sync_service.factor_stream.choose import FactorPolicy
from sync_service.factor_stream.coordination import FactorCoordination

__all__ = ["DtypeConflictError", "EngineResult", "JoinMetrics", "PlanMismatchError", "PushHandle", "SyncConfig", "SyncError", "SyncMetrics",
           "WeightSync"]


@dataclass(kw_only=True, slots=True)
class SyncConfig:
    """Settings of a WeightSync."""

    bucket_bytes: int = defaults.BUCKET_BYTES
    """Bucket payload size, bytes (multiple of 64); larger tensors are cut into boxes along dim 0."""
    transport: str = defaults.TRANSPORT
    """``"shm"`` (same host shared memory), ``"ray"`` (object store), ``"torch"`` (torch.distributed),
    ``"cuda_ipc"`` (same host, bucket slots on ``device`` shared once); ``transports.spec.AUTO_TRANSPORT`` says which fits."""
    backend: str = "auto"
    """torch.distributed backend of the ``"torch"`` transport: ``"gloo"``, ``"nccl"`` (CUDA buckets only), or
    ``"auto"``: NCCL when ``device`` is CUDA, gloo otherwise (``transports.spec.AUTO_BACKEND``)."""
    device: str = "cpu"
    """Where the transport's bucket buffers live: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (``"cuda_ipc"`` slots,
    the ``"torch"`` transport's buffers under NCCL)."""
    relay: str = "auto"
    """Fan-out (``TransportSpec.relay``): ``"chain"`` (``"ray"`` only): each bucket goes once, to the first
    engine, and each engine relays it to the next while it applies; ``"direct"``: every engine takes it
    from the trainers; ``"auto"``: chain when the engines sit on >= 2 Ray nodes that host no trainer."""
    timeout_s: float = defaults.TIMEOUT_S
    """Bound of every blocking step of a push (connect, send, receive, commit), seconds."""
    check_finite: bool = False
    """Refuse a version whose merged weights hold NaN/Inf: the trainers' ``MergeConfig.check_finite``
    (one extra pass over each merged box); the push fails naming the tensor, nothing is applied."""
    check_served: str = "log"
    """Each engine's check before it votes (``engines.served_check``: applied exactly once, the bytes sent, finite):
    ``"enforce"`` aborts the version on every engine, ``"log"`` warns, ``"off"``; why log: docs/reliability.md."""
    accumulate_dtype: str = "float32"
    """The trainers' ``MergeConfig.accumulate_dtype``: ``"float64"`` serves bitwise PEFT's float64 merge cast once."""
    secret: bytes | None = field(default=None, repr=False)
    """HMAC-SHA256 key authenticating every bucket (>= 16 bytes; see ``sync_service/security.py``);
    ``None``: a fresh random one per WeightSync. Never printed (excluded from repr)."""
    reset_versions: bool = False
    """Accept a first push at or below the version the engines already serve (a new run numbering from 0 again)."""
    delta: bool = defaults.DELTA
    """After an engine's first full sync, send only the names the adapter changes."""
    max_in_flight: int = 1
    """Pushes snapshotted but not yet committed, at most (back-pressure): ``push_async`` blocks (up to
    ``timeout_s``) while this many are in flight. 1: the next snapshot waits for the previous commit."""
    max_staleness: int = 1
    """k: rollouts may use weight versions >= latest pushed - k (``wait_for_fresh``, ``is_stale``);
    0 = on-policy. With k >= ``max_in_flight`` the bound holds without any rollout-side wait."""
    mode: str = "merged"
    """``"merged"``: trainers merge, engines receive merged tensors. ``"factors"``: after a full sync
    (which carries the pristine base), every eligible LoRA target moves as its factors and the engine
    merges them bitwise as the trainer would (``sync_service/factor_stream``). ``"auto"``: per tensor, from
    bytes moved and ``factor_memory_bytes``. See docs/scale.md."""
    factor_memory_bytes: int | None = None
    """Per engine budget for the resident pristine base copies of factor mode, bytes; ``None``: no limit."""
    experts_per_recipe: int = 8
    """Experts per factor block: the granularity of a factor delta."""
    metrics_port: int | None = None
    """Serve Prometheus metrics (``sync_service/telemetry.py``) on ``metrics_host:metrics_port/metrics``
    from construction to ``close()``; 0: a free port (``WeightSync.metrics_port`` tells which);
    ``None``: not served (``WeightSync.serve_metrics`` can start it later)."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint binds (``"0.0.0.0"``: every interface, for a scraper on another host)."""
    bind_host: str = "127.0.0.1"
    """Address every listener of the coordinator's host binds (never all interfaces): the ``"torch"``
    transport's rendezvous store, and the gloo connections of ranks on that host; a rank on another
    host listens on its own address on the route to this one. Give an address the trainers and engines
    reach (docs/operations.md, "Across hosts")."""
    port_range: tuple[int, int] | None = None
    """Ports listeners may bind, ``(first, last)`` inclusive: each channel takes the first free one
    (the ``"torch"`` transport's rendezvous store; gloo picks its own connection ports). ``None``: a
    free port the OS picks, per channel."""

    def __post_init__(self) -> None:
        for name, kinds in _FIELD_TYPES.items():
            value = getattr(self, name)
            if not is_kind(value, kinds):
                allowed = " or ".join("None" if k is None else k.__name__ for k in kinds)
                raise ValueError(f"SyncConfig.{name}={short_repr(value)} must be {allowed}, got {type(value).__name__}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"SyncConfig.transport={self.transport!r}; use one of {sorted(TRANSPORTS)}")
        if self.relay not in RELAYS or self.relay == "chain" and not TRANSPORTS[self.transport].relays:
            raise ValueError(f"SyncConfig.relay={self.relay!r}; use one of {RELAYS} ('chain' needs transport='ray')")
        resolve_backend(self.backend, self.device)  # raises ValueError naming the field and the fix
        if self.bucket_bytes <= 0 or self.bucket_bytes % 64:
            raise ValueError(f"SyncConfig.bucket_bytes={self.bucket_bytes} must be a positive multiple of 64")
        if self.bucket_bytes > MAX_BUCKET_BYTES:
            raise ValueError(f"SyncConfig.bucket_bytes={self.bucket_bytes} exceeds {MAX_BUCKET_BYTES} (8 GiB): every "
                             f"trainer holds two buckets and every engine one; use at most 8 GiB (default 64 MiB)")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"SyncConfig.metrics_port={self.metrics_port} must be a TCP port 0..65535 (0: a free one) "
                             f"or None")
        for name, allowed in (("check_served", ("off", "log", "enforce")), ("accumulate_dtype", ("float32", "float64"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"SyncConfig.{name}={getattr(self, name)!r}; use {', '.join(map(repr, allowed[:-1]))} or {allowed[-1]!r}")
        if not 0 < self.timeout_s <= defaults.MAX_TIMEOUT_S:  # also NaN
            raise ValueError(f"SyncConfig.timeout_s={self.timeout_s} must be a finite number of seconds > 0 and "
                             f"<= {defaults.MAX_TIMEOUT_S:.0f} (a week)")
        FactorPolicy(mode=self.mode, factor_memory_bytes=self.factor_memory_bytes,
                     experts_per_recipe=self.experts_per_recipe)  # raises ValueError naming the field
        if self.max_in_flight < 1 or self.max_staleness < 0:
            raise ValueError(f"SyncConfig.max_in_flight={self.max_in_flight} must be >= 1 and "
                             f"max_staleness={self.max_staleness} >= 0")
        check_listen(self.bind_host, self.port_range)
        if self.secret is not None:
            from sync_service.security import check_secret

            check_secret(self.secret, "SyncConfig.secret")


MAX_BUCKET_BYTES = 8 << 30
"""Largest ``SyncConfig.bucket_bytes``: 8 GiB, checkpoint-engine's largest bucket (buckets are double
buffered per trainer in RAM or /dev/shm; beyond this a bucket only costs memory)."""

# field → allowed kinds (``None`` allows None); bool is never accepted for int fields; ``secret``: ``check_secret``.
_FIELD_TYPES: dict[str, tuple] = {
    "bucket_bytes": (int,), "transport": (str,), "backend": (str,), "device": (str,), "relay": (str,), "timeout_s": (int, float),
    "check_finite": (bool,), "check_served": (str,), "accumulate_dtype": (str,), "reset_versions": (bool,), "delta": (bool,), "max_in_flight": (int,),
    "max_staleness": (int,), "mode": (str,), "factor_memory_bytes": (int, None), "experts_per_recipe": (int,),
    "metrics_port": (int, None), "metrics_host": (str,), "bind_host": (str,), "port_range": (tuple, None)}


def _mode_of(config: SyncConfig):
    """The coordinator's ``SyncMode`` factory for ``config.mode`` (``None``: merged)."""
    if config.mode == "merged":
        return None
    policy = FactorPolicy(mode=config.mode, factor_memory_bytes=config.factor_memory_bytes,
                          experts_per_recipe=config.experts_per_recipe)
    return lambda trainers, get: FactorCoordination(policy, trainers, get, accumulate_dtype=config.accumulate_dtype)


class PushHandle:
    """A push in flight (snapshot taken). ``result(timeout)`` -> SyncMetrics, or raises SyncError.

    Attributes:
        version: the pushed weight version. backpressure_s: seconds ``push_async`` waited for an
        in-flight slot. snapshot_s: seconds the trainers' snapshot took (all ``push_async`` blocked).
    """

    def __init__(self, version: int, future: concurrent.futures.Future, *, backpressure_s: float = 0.0,
                 snapshot_s: float = 0.0) -> None:
        self.version, self._future = version, future
        self.backpressure_s, self.snapshot_s = backpressure_s, snapshot_s

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> SyncMetrics:
        """Blocks up to ``timeout`` s. Raises TimeoutError, SyncError."""
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"push({self.version}) not finished within {timeout} s") from None


class WeightSync:
    """Streams merged weights from trainer shards (``actors.trainer.TrainerShard``) to rollout
    engines (``actors.rollout.RolloutEngine``). Transfers run one at a time, in call order; versions
    must increase.

    Raises (constructor):
        PlanMismatchError: an engine's table does not fit the trainers' plan (a float64/float32/float16/
            bfloat16 tensor an engine holds in another of these dtypes fits: it is cast once into the engine's).
        DtypeConflictError: engines hold one tensor in different dtypes (one bucket stream serves them all).
        ValueError: bad config, no trainers, a box produced by two trainers.
    """

    def __init__(self, *, trainers: Sequence, engines: Sequence, config: SyncConfig | None = None) -> None:
        self.config = config or SyncConfig()
        self._coordinator = Coordinator(trainers, engines, self.config, mode=_mode_of(self.config))
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-push")
        self._slots = threading.BoundedSemaphore(self.config.max_in_flight)
        self._push_lock = threading.Lock()  # push_async calls snapshot in call order
        self._in_flight = 0
        self._count_lock = threading.Lock()
        self._latest: int | None = None
        self._closed = False
        self.telemetry = None  # sync_service.telemetry.SyncTelemetry, from the first serve_metrics on
        if self.config.metrics_port is not None:
            try:
                self.serve_metrics(self.config.metrics_port, self.config.metrics_host)
            except BaseException:
                self.close()
                raise

    def serve_metrics(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Count every later push in Prometheus metrics (``sync_service/telemetry.py``) and serve them on
        ``host:port/metrics`` until ``close()``; 0 picks a free port. Returns the bound port.

        Raises:
            OSError: the port is taken. RuntimeError: already serving.
        """
        from sync_service.telemetry import SyncTelemetry

        if self.telemetry is None:
            self.telemetry = SyncTelemetry(versions=lambda: self._coordinator.versions.snapshot(),
                                           latest=lambda: self._latest)
        return self.telemetry.serve(port, host)

    @property
    def metrics_port(self) -> int | None:
        """The port Prometheus metrics are served on, ``None`` when not serving."""
        return None if self.telemetry is None else self.telemetry.port

    def push(self, version: int) -> SyncMetrics:
        """Snapshot, stream and commit ``version`` on every engine; blocks. Raises SyncError."""
        return self.push_async(version).result(self.config.timeout_s * 2 + 60)

    def push_async(self, version: int, *, timeout_s: float | None = None) -> PushHandle:
        """Take the snapshot of ``version`` on every trainer, then stream it in the background; returns
        once the snapshot is taken, so the trainers may change their factors right away (the next
        training step overlaps the transfer).

        Back-pressure: while ``config.max_in_flight`` pushes are in flight this first blocks, up to
        ``timeout_s`` (default ``config.timeout_s``), until the oldest finished (committed or failed).

        Raises:
            TypeError: ``version`` not an int (a bool is not one).
            ValueError: ``version`` outside int64's [0, 2**63 - 1], not above the last push, or at or below what an engine served (unless ``config.reset_versions``).
            RuntimeError: after ``close()``.
            TimeoutError: no in-flight slot freed within ``timeout_s`` (nothing snapshotted).
        """
        check_version(version, "push_async")
        wait = self.config.timeout_s if timeout_s is None else timeout_s
        with self._push_lock:
            if self._closed:
                raise RuntimeError(f"push_async({version}): this WeightSync is closed; make a new one over the actors")
            with self._count_lock:
                previous = self._latest
            self._coordinator.check_version(version, previous)  # above the last push and what the engines serve
            t0 = time.perf_counter()
            if not self._slots.acquire(timeout=wait):
                raise TimeoutError(f"push_async({version}): {self.config.max_in_flight} push(es) still in flight after "
                                   f"{wait} s (back-pressure); wait for them or raise SyncConfig.max_in_flight")
            t1 = time.perf_counter()
            try:
                changed = self._coordinator.snapshot(version)
                future = self._pool.submit(self._transfer, version, changed if self.config.delta else None)
            except BaseException:
                self._slots.release()
                raise
            with self._count_lock:
                self._in_flight += 1
                self._latest = version
            future.add_done_callback(lambda f: self._push_done(f, version, previous))
            return PushHandle(version, future, backpressure_s=t1 - t0, snapshot_s=time.perf_counter() - t1)

    def _transfer(self, version: int, changed: frozenset[str] | None) -> SyncMetrics:
        """``Coordinator.transfer``, counted in ``telemetry`` (when served) before the push's future completes."""
        telemetry = self.telemetry
        try:
            metrics = self._coordinator.transfer(version, changed)
        except BaseException as exc:
            if telemetry is not None:
                telemetry.record_failure(exc)
            raise
        if telemetry is not None:
            telemetry.record(metrics)
        return metrics

    def _push_done(self, future: concurrent.futures.Future, version: int, previous: int | None) -> None:
        with self._count_lock:
            self._in_flight -= 1
            exc = future.exception()
            used = exc is not None and any(e.committed for e in getattr(getattr(exc, "metrics", None), "engines", ()))
            if exc is not None and not used and self._latest == version:
                self._latest = previous  # a failed push does not use up its version: push(version) again
        self._slots.release()

    # -- versions and staleness ------------------------------------------------------------
    @property
    def latest_version(self) -> int | None:
        """The last version given to ``push_async`` (the trainers' policy version); ``None`` before."""
        return self._latest

    @property
    def committed_version(self) -> int | None:
        """The lowest version committed on the member engines (``None``: one has none from this sync)."""
        return self._coordinator.versions.min_committed()

    def min_rollout_version(self) -> int | None:
        """Oldest version a rollout may use: ``latest_version - max_staleness`` (``None``: nothing pushed)."""
        return None if self._latest is None else self._latest - self.config.max_staleness

    def is_stale(self, version: int | None) -> bool:
        """Whether a rollout produced by weight ``version`` is older than the staleness bound allows."""
        low = self.min_rollout_version()
        return low is not None and (version is None or version < low)

    def wait_for_version(self, min_version: int, timeout_s: float | None = None) -> int:
        """Block until every member engine committed ``>= min_version``; returns the lowest committed.

        Raises:
            TimeoutError: not reached within ``timeout_s`` (default ``config.timeout_s``).
            SyncError: it cannot arrive: no push is in flight (never pushed, or the push failed).
        """
        def hopeless() -> str | None:
            return None if self._in_flight else f"no push in flight (last pushed: {self._latest})"

        try:
            return self._coordinator.versions.wait_min(min_version, self.config.timeout_s if timeout_s is None else timeout_s,
                                                       hopeless=hopeless)
        except RuntimeError as exc:
            raise SyncError(str(exc), None) from None

    def wait_for_fresh(self, timeout_s: float | None = None) -> int | None:
        """``wait_for_version(min_rollout_version())``: returns (the lowest committed version) once
        rollouts may start within the staleness bound; at once when nothing was pushed yet."""
        low = self.min_rollout_version()
        if low is None:
            return self.committed_version
        return self.wait_for_version(low, timeout_s)

    def engine_versions(self) -> dict[str, int | None]:
        """Committed weight version per engine name, asked of the engines (before a first push too; ``None``: never synced)."""
        return self._coordinator.engine_versions()

    def add_engine(self, engine, *, reset_versions: bool = False, continue_above: bool = False) -> str:
        """Admit a RolloutEngine while training runs: validated, then (after any push in flight) brought
        to the fleet's committed version by a peer copy from a member engine; later pushes are deltas
        for every member. Without a member that can export a version, its first push is full for all.
        Returns its name; ``joins[-1]`` says how it joined.

        An engine never goes back to a lower version: one serving a version above the fleet's is refused,
        unless ``continue_above=True`` (admitted as it is; the next push must go above its version) or
        ``reset_versions=True`` (it takes the fleet's version, explicitly at the engine).

        Raises:
            ValueError: it serves a version above the fleet's (one line naming both versions and the options).
            PlanMismatchError: its table does not fit. SyncError: the peer copy failed. Not admitted either way.
        """
        return self._pool.submit(self._coordinator.add_engine, engine, reset_versions=reset_versions,
                                 continue_above=continue_above).result()

    @property
    def joins(self) -> list[JoinMetrics]:
        """One ``JoinMetrics`` per ``add_engine``, in call order."""
        return list(self._coordinator.joins)

    def remove_engine(self, engine) -> None:
        """Stop syncing to ``engine`` (after any push in flight); it keeps its last version."""
        self._pool.submit(self._coordinator.remove_engine, engine).result()

    @property
    def plan(self):
        """The sync plan (``protocols.wire.SyncPlan``): who sends which box, in which bucket."""
        return self._coordinator.plan

    @property
    def dtype_conversions(self) -> dict[tuple[str, str], int]:
        """The plan's casts: ``(trainer dtype, engine dtype)`` → number of tensors the trainers merge in their
        accumulation dtype and cast once into the engines' dtype (empty when the engines hold the trainers')."""
        return dict(self._coordinator.conversions)

    def close(self) -> None:
        with self._push_lock:
            self._closed = True
        self._pool.shutdown(wait=True)
        if self.telemetry is not None:
            self.telemetry.close()
        self._coordinator.close()
