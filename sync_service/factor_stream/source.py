"""Trainer side of factor streaming: ``FactorSource`` (a ``WeightSource``) and ``FactorLedger`` (deltas).

``FactorSource.fill`` serves three kinds of plan entries (``factor_stream.plan``):
- a recipe entry: the x then y bytes of one term block of the version's adapter;
- a tensor entry of a factor-mode target: the pristine base W0 (full syncs only);
- any other tensor entry: the merged values, exactly as merged mode (``MergedSource.fill``).

``FactorLedger`` remembers an xxh3_64 digest of every recipe block the receivers committed, so a
delta sync moves only the blocks whose factors changed (digests of in-flight versions are promoted
only when the coordinator reports the commit; an aborted version changes nothing).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import xxhash

from protocols.params import Box, ParamMeta
from protocols.recipe import Recipe
from protocols.wire import SyncPlan
from sync_service.dtypes import TORCH_DTYPES
from sync_service.factor_stream.recipes import factor_dtype_of, write_block
from sync_service.merge.source import MergedSource
from sync_service.merge.terms import LoraTerm

__all__ = ["FactorSource", "FactorLedger", "AdapterStructureError"]


class AdapterStructureError(ValueError):
    """The adapter's terms no longer match the plan's recipes (rank, selections, scaling changed).
    Rebuild the WeightSync (a new plan) after changing the adapter's structure."""


def _matches(term: LoraTerm, r: Recipe) -> bool:
    return (tuple(term.rows) == r.rows and tuple(term.cols) == r.cols and term.x.shape[-1] == r.rank
            and float(term.scaling) == r.scaling and (term.experts is None) == (r.experts is None)
            and (term.experts is None or tuple(term.experts) == r.term_experts))


class FactorSource:
    """``WeightSource`` over a version's ``MergedSource`` for the entries of a factor ``plan``."""

    def __init__(self, merged: MergedSource, plan: SyncPlan):
        self.merged = merged
        self.recipes: dict[str, Recipe] = {e.name: e.recipe for e in plan.entries if e.recipe is not None}
        self.targets = frozenset(r.target for r in self.recipes.values())

    def param_metas(self) -> Sequence[ParamMeta]:
        return self.merged.param_metas()

    def changed_names(self) -> frozenset[str]:
        return self.merged.changed_names()

    def term(self, recipe: Recipe) -> LoraTerm:
        """The adapter term a recipe describes. Raises AdapterStructureError when it does not match."""
        terms = self.merged.adapter.terms.get(recipe.target, [])
        if recipe.term >= len(terms) or not _matches(terms[recipe.term], recipe):
            raise AdapterStructureError(f"{recipe.entry_name()}: the adapter's term {recipe.term} of {recipe.target} "
                                        f"does not match the plan's recipe; rebuild the WeightSync after changing the adapter")
        return terms[recipe.term]

    def fill(self, name: str, box: Box, out: torch.Tensor) -> None:
        """Write entry ``name``/``box`` into ``out`` (see the module docstring).

        Raises:
            KeyError: unknown name. AdapterStructureError: recipe and adapter disagree.
            ValueError: what ``MergedSource.fill`` raises.
        """
        recipe = self.recipes.get(name)
        if recipe is not None:
            write_block(self.term(recipe), recipe, out)
        elif name in self.targets:
            out.copy_(self.merged.base.read(name, box))
        else:
            self.merged.fill(name, box, out)

    def block_digests(self, names: Iterable[str]) -> dict[str, int]:
        """xxh3_64 of each named recipe block's bytes as they travel."""
        out = {}
        for name in names:
            recipe = self.recipes[name]
            buf = torch.empty(recipe.numel(), dtype=TORCH_DTYPES[factor_dtype_of(recipe)])
            write_block(self.term(recipe), recipe, buf)
            out[name] = xxhash.xxh3_64_intdigest(buf.view(torch.uint8).numpy())
        return out


class FactorLedger:
    """Per trainer rank: digests of the recipe blocks committed on the receivers, and of versions in flight."""

    def __init__(self) -> None:
        self._committed: dict[str, int] = {}
        self._pending: dict[int, dict[str, int]] = {}

    def changed(self, version: int, source: FactorSource, names: Iterable[str]) -> list[str]:
        """Names among ``names`` (blocks this rank sends) whose bytes differ from the committed ones;
        remembers this version's digests until ``commit(version)``."""
        digests = source.block_digests(names)
        self._pending[version] = digests
        return [n for n, d in digests.items() if self._committed.get(n) != d]

    def commit(self, version: int) -> None:
        """Every receiver committed ``version``: its digests become the baseline (older pending ones drop)."""
        digests = self._pending.pop(version, None)
        if digests is not None:
            self._committed.update(digests)
        self._pending = {v: d for v, d in self._pending.items() if v > version}

    def forget(self) -> None:
        """Receivers' factor state is unknown (a member joined or failed): the next delta moves every block."""
        self._committed.clear()
