"""What a push streams: merged tensors (``MergedMode``) or LoRA factors where they pay
(``sync_service.factor_stream.coordination.FactorCoordination``, ``SyncConfig.mode`` "factors" / "auto").
The coordinator is given one ``SyncMode`` (``WeightSync`` picks it) and never branches on the mode.

A mode builds the plan from the trainers' owned boxes, validates it against an engine's table,
chooses a push's names (``None``: everything) and hears how the push ended.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from protocols.params import ParamMeta
from protocols.wire import SyncPlan
from sync_service.coordinator.metrics import SyncMetrics
from sync_service.coordinator.planning import build_sync_plan, validate_plan

__all__ = ["MergedMode", "SyncMode"]


class SyncMode(Protocol):
    def build_plan(self, owned: Sequence[Sequence[ParamMeta]], *, bucket_bytes: int) -> SyncPlan: ...

    def validate(self, plan: SyncPlan, table: Sequence[ParamMeta], *, engine: str) -> None: ...

    def names(self, version: int, changed: frozenset[str] | None, full: bool) -> frozenset[str] | None:
        """The push's names (``None``: full). ``full``: some engine needs everything."""
        ...

    def committed(self, version: int) -> None: ...

    def failed(self) -> None: ...

    def joined(self) -> None:
        """An engine joined by a peer copy."""
        ...

    def report(self, metrics: SyncMetrics) -> SyncMetrics:
        """``metrics`` with what the mode adds (``mode``, ``factor_tensors``)."""
        ...


class MergedMode:
    """Trainers merge; engines receive merged tensors (full, then the adapter's changed names)."""

    def build_plan(self, owned: Sequence[Sequence[ParamMeta]], *, bucket_bytes: int) -> SyncPlan:
        return build_sync_plan(owned, bucket_bytes=bucket_bytes)

    def validate(self, plan: SyncPlan, table: Sequence[ParamMeta], *, engine: str) -> None:
        validate_plan(plan, table, engine=engine)

    def names(self, version: int, changed: frozenset[str] | None, full: bool) -> frozenset[str] | None:
        return None if full or changed is None else changed

    def committed(self, version: int) -> None:
        pass

    def failed(self) -> None:
        pass

    def joined(self) -> None:
        pass

    def report(self, metrics: SyncMetrics) -> SyncMetrics:
        return metrics
