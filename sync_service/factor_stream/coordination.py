"""Coordinator side of factor streaming (``SyncConfig.mode`` = ``factors`` | ``auto``).

``FactorCoordination`` plans (costs → ``choose`` → recipes → ``build_factor_plan``), validates the
plan against each engine, decides each push's names (full: everything; delta: changed merged-mode
tensors + every trainer's changed recipe blocks) and moves the trainers' delta baselines on commit.
After a failed push the receivers' factor state is unknown: the next push is full (never a merge
over a missing or stale pristine copy or factor).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

from protocols.params import ParamMeta
from protocols.wire import SyncPlan
from sync_service.coordinator.metrics import SyncMetrics
from sync_service.factor_stream.choose import FactorChoice, FactorPolicy, choose
from sync_service.factor_stream.plan import build_factor_plan, engine_merged_bytes, factor_targets, validate_factor_plan

__all__ = ["FactorCoordination"]
log = logging.getLogger("weightsync.factors")


class FactorCoordination:
    """The coordinator's ``SyncMode`` (``sync_service/coordinator/modes.py``) of factor streaming.

    Args: policy; trainers (``FactorTrainerEndpoint`` handles); get: the coordinator's bounded
    ``ray.get`` (raises ``EndpointError``)."""

    def __init__(self, policy: FactorPolicy, trainers: Sequence, get: Callable[[list, str], list], *,
                 accumulate_dtype: str = "float32") -> None:
        self.policy, self.trainers, self._get = policy, list(trainers), get
        self.accumulate_dtype = accumulate_dtype
        self.choice: FactorChoice | None = None
        self.plan: SyncPlan | None = None
        self.stale = True
        """Receivers' factor state unknown (start, failure): the next push must be full."""

    def build_plan(self, owned: Sequence[Sequence[ParamMeta]], *, bucket_bytes: int) -> SyncPlan:
        """The factor plan of ``owned`` (the engines' dtypes: a block-FP8 target travels as the trainers' base and
        the receiver quantizes it, ``factor_stream.rx_fp8``).

        Raises:
            ValueError: ``accumulate_dtype`` other than float32 (the receivers merge in float32), or what
                ``choose`` / ``build_factor_plan`` raise."""
        if self.accumulate_dtype != "float32":
            raise ValueError(f"SyncConfig.mode={self.policy.mode!r} with accumulate_dtype={self.accumulate_dtype!r}: "
                             f"the engines merge factor-mode tensors accumulating in float32 "
                             f"(FactorReceiverConfig.accumulate_dtype) and would serve other roundings than the "
                             f"trainers; use accumulate_dtype='float32' or mode='merged'")
        (costs,) = self._get([self.trainers[0].factor_costs.remote()], "factor_costs")
        self.choice = choose(engine_merged_bytes(list(costs), owned), self.policy)
        (raw,) = self._get([self.trainers[0].factor_recipes.remote(sorted(self.choice.factors), self.policy.experts_per_recipe,
                                                                   bucket_bytes)], "factor_recipes")
        self.plan = build_factor_plan(owned, list(raw), bucket_bytes=bucket_bytes)
        return self.plan

    def validate(self, plan: SyncPlan, table: Sequence[ParamMeta], *, engine: str) -> None:
        validate_factor_plan(plan, table, engine=engine)

    def names(self, version: int, changed: frozenset[str] | None, full: bool) -> frozenset[str] | None:
        """The push's names (``None``: full). Runs every trainer's ``factor_delta`` (a collective)."""
        full = full or self.stale or changed is None
        deltas = self._get([t.factor_delta.remote(version) for t in self.trainers], "factor_delta")
        if full:
            return None
        names = set(changed - factor_targets(self.plan))
        for d in deltas:
            names.update(d)
        log.info("push(%d): factor delta of %d recipe block(s), %d merged tensor(s)", version,
                 len(names) - len(set(changed - factor_targets(self.plan))), len(set(changed - factor_targets(self.plan))))
        return frozenset(names)

    def committed(self, version: int) -> None:
        self._get([t.factor_committed.remote(version) for t in self.trainers], "factor_committed")
        self.stale = False

    def failed(self) -> None:
        self.stale = True
        self._get([t.factor_forget.remote() for t in self.trainers], "factor_forget")

    def joined(self) -> None:
        """A peer copy carries no pristine base: the next push is full."""
        self.stale = True

    def report(self, metrics: SyncMetrics) -> SyncMetrics:
        return replace(metrics, mode=self.policy.mode, factor_tensors=tuple(sorted(self.choice.factors)))
