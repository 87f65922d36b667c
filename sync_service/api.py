"""The weightsync API for an RL loop: ``WeightSync(trainers=..., engines=..., config=SyncConfig(...))``.

    sync = WeightSync(trainers=shards, engines=engines, config=SyncConfig(transport="shm"))
    for step in range(steps):
        ray.get([t.train_step.remote(step) for t in shards])   # the trainer changes its LoRA factors
        metrics = sync.push(step)                               # blocking; every engine serves `step`
    handle = sync.push_async(step)   # returns once the snapshot is taken; training may continue
    handle.result(timeout=60)        # -> SyncMetrics

Conventions of the peers: this is verl's/slime's "update_weights" and NeMo-RL's
``WeightSynchronizer.sync_weights() -> metrics``, with the snapshot / transfer split of an async
trainer. Setup (in the constructor) builds the plan once and validates it against every engine's
parameter table before any byte moves (``PlanMismatchError``).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass, field

from sync_service.coordinator import Coordinator, PlanMismatchError
from sync_service.coordinator.metrics import EngineResult, SyncError, SyncMetrics

__all__ = ["EngineResult", "PlanMismatchError", "PushHandle", "SyncConfig", "SyncError", "SyncMetrics", "WeightSync"]


@dataclass(kw_only=True, slots=True)
class SyncConfig:
    """Settings of a WeightSync."""

    bucket_bytes: int = 64 << 20
    """Bucket payload size, bytes (multiple of 64); larger tensors are cut into boxes along dim 0."""
    transport: str = "shm"
    """``"shm"`` (same host shared memory), ``"ray"`` (object store), ``"torch"`` (torch.distributed)."""
    timeout_s: float = 120.0
    """Bound of every blocking step of a push (connect, send, receive, commit), seconds."""
    check_finite: bool = False
    """Refuse a version whose merged weights hold NaN/Inf: the trainers' ``MergeConfig.check_finite``
    (one extra pass over each merged box); the push fails naming the tensor, nothing is applied."""
    secret: bytes | None = field(default=None, repr=False)
    """HMAC-SHA256 key authenticating every bucket (>= 16 bytes; see ``sync_service/security.py``);
    ``None``: a fresh random one per WeightSync. Never printed (excluded from repr)."""
    delta: bool = True
    """After an engine's first full sync, send only the names the adapter changes."""

    def __post_init__(self) -> None:
        from sync_service.coordinator.driver import TRANSPORT_KINDS

        if self.transport not in TRANSPORT_KINDS:
            raise ValueError(f"SyncConfig.transport={self.transport!r}; use one of {sorted(TRANSPORT_KINDS)}")
        if self.bucket_bytes <= 0 or self.bucket_bytes % 64:
            raise ValueError(f"SyncConfig.bucket_bytes={self.bucket_bytes} must be a positive multiple of 64")
        if self.timeout_s <= 0:
            raise ValueError(f"SyncConfig.timeout_s={self.timeout_s} must be > 0")
        if self.secret is not None:
            from sync_service.security import check_secret

            check_secret(self.secret, "SyncConfig.secret")


class PushHandle:
    """A push in flight (snapshot taken). ``result(timeout)`` -> SyncMetrics, or raises SyncError."""

    def __init__(self, version: int, future: concurrent.futures.Future) -> None:
        self.version, self._future = version, future

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
    engines (``actors.rollout.RolloutEngine``). Pushes run one at a time, in call order.

    Raises (constructor):
        PlanMismatchError: an engine's table does not fit the trainers' plan.
        ValueError: bad config, no trainers, a box produced by two trainers.
    """

    def __init__(self, *, trainers: Sequence, engines: Sequence, config: SyncConfig | None = None) -> None:
        self.config = config or SyncConfig()
        self._coordinator = Coordinator(trainers, engines, self.config)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-push")

    def push(self, version: int) -> SyncMetrics:
        """Snapshot, stream and commit ``version`` on every engine; blocks. Raises SyncError."""
        return self.push_async(version).result(self.config.timeout_s * 2 + 60)

    def push_async(self, version: int) -> PushHandle:
        """Take the snapshot of ``version`` on every trainer (blocking), then stream it in the
        background. After this returns the trainers may change their factors freely."""
        changed = self._coordinator.snapshot(version)
        if not self.config.delta:
            changed = None
        return PushHandle(version, self._pool.submit(self._coordinator.transfer, version, changed))

    def engine_versions(self) -> dict[str, int | None]:
        """Committed weight version per engine name (``None`` before its first sync)."""
        return self._coordinator.engine_versions()

    def add_engine(self, engine) -> str:
        """Admit a RolloutEngine (validated now; its first sync is full). Returns its name."""
        return self._pool.submit(self._coordinator.add_engine, engine).result()

    def remove_engine(self, engine) -> None:
        """Stop syncing to ``engine`` (after any push in flight); it keeps its last version."""
        self._pool.submit(self._coordinator.remove_engine, engine).result()

    @property
    def plan(self):
        """The sync plan (``protocols.wire.SyncPlan``): who sends which box, in which bucket."""
        return self._coordinator.plan

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._coordinator.close()
