"""Trainer-rank side of factor streaming behind the ``TrainerShard`` actor (``protocols.endpoints`` reports out).

``FactorTrainer`` answers the coordinator's planning questions from the adapter's *structure*
(``LiveState.structure()``: zero-filled full-size factors normalised by the merge core), computes a
version's changed recipe blocks (which gathers the factors, so it is a collective over the trainer
group, like ``LiveState.source(..., whole_adapter=True)``), and hands ``send`` the prepared
``FactorSource``.
"""

from __future__ import annotations

from protocols.endpoints import FactorCost
from protocols.recipe import Recipe
from protocols.wire import SyncPlan
from sync_service.factor_stream.plan import adapter_recipes, recipe_names_of, target_costs
from sync_service.factor_stream.recipes import factor_wire_dtype
from sync_service.factor_stream.source import FactorLedger, FactorSource
from sync_service.merge.source import MergedSource

__all__ = ["FactorTrainer"]


class FactorTrainer:
    """Factor-streaming state of one trainer rank: the delta ledger and sources prepared per version."""

    def __init__(self) -> None:
        self.ledger = FactorLedger()
        self._prepared: dict[int, MergedSource] = {}

    def costs(self, state) -> tuple[FactorCost, ...]:
        """Merged vs factor cost per changed tensor."""
        out_dtype = state.merge.out_dtype
        adapter = state.structure()
        outs = {m.name: out_dtype for m in state.base.metas()} if out_dtype else {}
        return tuple(target_costs(adapter, state.base.metas(), outs))

    def recipes(self, state, names: list[str], *, experts_per_recipe: int, bucket_bytes: int) -> tuple[Recipe, ...]:
        """Every recipe block of ``names``."""
        return tuple(adapter_recipes(state.structure(), state.base.metas(), names,
                                     experts_per_recipe=experts_per_recipe, bucket_bytes=bucket_bytes,
                                     wire_dtype=factor_wire_dtype(p.param for p in state.factors.values())))

    def delta(self, state, version: int, plan: SyncPlan, rank: int) -> list[str]:
        """Gather the snapshot's factors (collective), keep the source for ``source(version)``, and
        return this rank's recipe blocks whose bytes differ from the last committed version's."""
        merged = self._prepared.get(version) or state.source(version, whole_adapter=True)  # a retried push reuses it
        self._prepared = {version: merged}
        return self.ledger.changed(version, FactorSource(merged, plan), recipe_names_of(plan, rank))

    def source(self, state, version: int, plan: SyncPlan) -> FactorSource:
        """The version's ``FactorSource`` (prepared by ``delta`` when it ran; otherwise built now)."""
        merged = self._prepared.get(version) or state.source(version, whole_adapter=True)
        self._prepared = {version: merged}  # kept until the next version: a push retried without a dead engine
        return FactorSource(merged, plan)
