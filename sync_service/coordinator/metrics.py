"""Typed results of a sync: ``SyncMetrics`` (per push) and ``EngineResult`` (per engine)."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocols.endpoints import SendReport


STAGES = ("gather_s", "merge_s", "pack_s", "transfer_s", "apply_s", "rx_merge_s", "commit_s")
"""``SyncMetrics``' stage-second fields in pipeline order: every breakdown (CLI rows, JSON, benchmarks) uses these."""

@dataclass(frozen=True, slots=True)
class EngineResult:
    """One engine's outcome of one push.

    Attributes:
        engine: the engine's name. committed: it serves the pushed version now.
        error: why the sync failed on it (its own error, or ``"sync aborted"`` when another member
            failed); ``None`` when committed. apply_s: seconds in ``EngineAdapter.apply``.
        payload_bytes: bytes it received. rx_merge_s: wall seconds it merged factor-mode targets.
        served_findings: problems its served check found in the version (``ReceiveReport.served_findings``:
            0 clean; under ``check_served="log"`` it committed anyway); ``None``: the check is off, or no report.
    """

    engine: str
    committed: bool
    error: str | None
    apply_s: float
    payload_bytes: int
    rx_merge_s: float = 0.0
    served_findings: int | None = None


@dataclass(frozen=True, slots=True)
class SyncMetrics:
    """What one push moved and where its time went.

    Stage seconds are the slowest trainer's (stages of different trainers run in parallel):
    ``gather_s`` preparing the factors before the first bucket (the adapter refresh; in factor modes
    the trainer group's all-gather), ``merge_s`` merge into bucket views (``WeightSource.fill``),
    ``pack_s`` checksums + headers, ``transfer_s`` inside ``Transport.send`` (overlaps packing),
    ``apply_s`` the slowest engine's apply copies, ``rx_merge_s`` the slowest engine's merge of
    factor-mode targets (wall seconds with a merge running, overlapping the stream; 0 in merged
    mode), ``commit_s`` the commit round.
    ``seconds`` is the wall time of the transfer (after the snapshot), ``bytes`` the payload bytes
    sent by all trainers (each frame reaches every engine), ``gb_per_s`` = bytes / seconds / 1e9.
    ``mode`` is ``SyncConfig.mode``; ``factor_tensors`` the tensors streamed as LoRA factors and
    merged by the engines (``sync_service/factor_stream``), empty in merged mode.
    """

    version: int
    full: bool
    bytes: int
    buckets: int
    seconds: float
    gather_s: float
    merge_s: float
    pack_s: float
    transfer_s: float
    apply_s: float
    commit_s: float
    engines: tuple[EngineResult, ...] = field(default_factory=tuple)
    mode: str = "merged"
    factor_tensors: tuple[str, ...] = ()
    rx_merge_s: float = 0.0

    def stage_seconds(self) -> dict[str, float]:
        """``STAGES`` → seconds of this push."""
        return {k: getattr(self, k) for k in STAGES}

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @classmethod
    def from_stats(cls, *, version: int, full: bool, sent: list[SendReport], engines: list[EngineResult],
                   commit_s: float, seconds: float) -> "SyncMetrics":
        """From the trainers' ``SendReport``s and the engines' results of one push."""
        def slowest(key: str) -> float:
            return max((getattr(s, key) for s in sent), default=0.0)

        return cls(version=version, full=full, bytes=sum(s.payload_bytes for s in sent),
                   buckets=sum(s.buckets for s in sent), seconds=seconds, gather_s=slowest("gather_s"),
                   merge_s=slowest("merge_s"), pack_s=slowest("pack_s"), transfer_s=slowest("transfer_s"),
                   apply_s=max((e.apply_s for e in engines), default=0.0), commit_s=commit_s, engines=tuple(engines),
                   rx_merge_s=max((e.rx_merge_s for e in engines), default=0.0))


class SyncError(RuntimeError):
    """A push failed and was aborted on every engine (each serves its previous version).

    Attributes:
        metrics: what was measured up to the failure, with per-engine errors (``None`` if the push
            never started moving bytes).
    """

    def __init__(self, message: str, metrics: SyncMetrics | None = None):
        super().__init__(message)
        self.metrics = metrics

    def __reduce__(self):
        """Pickled with its metrics (Ray re-raises it in a caller's process: a training actor's coordinator)."""
        return type(self), (str(self), self.metrics)
