"""Receiver side of factor streaming: ``FactorEngine`` merges LoRA factors into an engine.

``FactorEngine`` wraps any ``EngineAdapter`` and is itself one, so ``BucketReceiver`` drives it
unchanged. It keeps a resident *pristine* copy W0 of every factor-mode target (received in full
syncs) and the factors of every term (received as recipe blocks; a delta brings only changed
blocks). At ``finish_update`` it merges each target whose factors changed with the merge core's own
code — ``MergedSource.fill`` over a ``TensorDictBase`` of the pristine copies and a ``LoraAdapter``
of the rebuilt terms — over the same boxes a merged-mode plan has, and applies the result to the
wrapped engine: the engine holds bitwise what a merged-mode sync of the version would have written.

State is copy-on-write: a sync writes staged pristine tensors and term buffers; ``commit`` promotes
them, ``abort`` drops them. A target without a complete pristine copy or complete terms is never
merged: ``FactorStateError`` fails the sync (the coordinator then runs a full sync).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protocols.interfaces import FinishReport
from protocols.params import Box, ParamMeta, box_numel, box_shape, full_box
from protocols.recipe import Recipe
from protocols.wire import SyncPlan
from sync_service.dtypes import TORCH_DTYPES
from sync_service.factor_stream.plan import merged_boxes
from sync_service.factor_stream.recipes import TermBuffers, terms_by_target
from sync_service.merge.base import TensorDictBase
from sync_service.merge.source import MergeConfig, MergedSource
from sync_service.merge.terms import LoraAdapter

__all__ = ["FactorEngine", "FactorReceiverConfig", "FactorStateError"]


class FactorStateError(RuntimeError):
    """The receiver lacks the pristine base or factors a delta needs (it joined late, restarted, or
    missed a version); nothing was merged. Run a full sync."""


@dataclass(kw_only=True, slots=True)
class FactorReceiverConfig:
    """Where a receiver keeps its pristine copies and how it merges."""

    pristine_device: str = "cpu"
    """Device of the resident pristine W0 and factors: ``"cpu"`` (host memory) or the engine's device
    (``"cuda:0"``: engine memory, the merge runs there)."""
    staging_bytes: int = 64 << 20
    """fp32 merge scratch budget, bytes: must equal the trainers' ``MergeConfig.staging_bytes`` (a
    different chunking may round differently)."""


class FactorEngine:
    """``EngineAdapter`` over ``engine`` for a factor ``plan`` (``factor_stream.plan.build_factor_plan``)."""

    def __init__(self, engine, plan: SyncPlan, *, config: FactorReceiverConfig | None = None) -> None:
        self.inner = engine
        self.plan = plan
        self.config = config or FactorReceiverConfig()
        self.device = torch.device(self.config.pristine_device)
        self._recipes: dict[str, Recipe] = {e.name: e.recipe for e in plan.entries if e.recipe is not None}
        self._dtypes = {e.name: e.dtype for e in plan.entries if e.recipe is not None}
        self._blocks = {t: {i: [r.experts for r in rs] for i, rs in terms.items()}
                        for t, terms in terms_by_target(list(self._recipes.values())).items()}
        self._boxes = merged_boxes(plan)
        self._table = {m.name: m for m in engine.param_metas()}
        self._pristine: dict[str, torch.Tensor] = {}
        self._terms: dict[str, dict[int, TermBuffers]] = {}
        self._reset_staged()
        self.merge_s = 0.0
        """Seconds spent merging in the last ``finish_update``."""

    # -- EngineAdapter delegation ----------------------------------------------------------
    def param_metas(self) -> Sequence[ParamMeta]:
        return self.inner.param_metas()

    def weight_version(self) -> int | None:
        return self.inner.weight_version()

    def reset_caches(self) -> None:
        self.inner.reset_caches()

    # -- state -----------------------------------------------------------------------------
    def factor_ready(self) -> bool:
        """Every factor-mode target has a committed pristine copy and complete terms (a delta can apply)."""
        return all(self._complete(t, self._pristine, self._terms) is None for t in self._blocks)

    def resident_bytes(self) -> int:
        """Bytes this wrapper holds beyond the engine: pristine copies + factor buffers (committed)."""
        return (sum(t.numel() * t.element_size() for t in self._pristine.values())
                + sum(b.nbytes() for terms in self._terms.values() for b in terms.values()))

    def _reset_staged(self) -> None:
        self._st_pristine: dict[str, torch.Tensor] = {}
        self._st_covered: dict[str, int] = {}
        self._st_terms: dict[str, dict[int, TermBuffers]] = {}
        self._remerge: dict[str, None] = {}  # targets to re-merge this sync (an ordered set)

    # -- update lifecycle ------------------------------------------------------------------
    def begin_update(self, version: int, names: Sequence[str]) -> None:
        """Split ``names`` into recipes, pristine bases and plain tensors; begin the engine's update
        with the plain tensors and every target it will re-merge."""
        self._reset_staged()
        engine_names: list[str] = []
        for name in names:
            recipe = self._recipes.get(name)
            if recipe is not None:
                self._remerge[recipe.target] = None
                engine_names.append(recipe.target)
            elif name in self._blocks:
                self._remerge[name] = None
                engine_names.append(name)
            else:
                engine_names.append(name)
        self.inner.begin_update(version, list(dict.fromkeys(engine_names)))

    def apply(self, name: str, box: Box, data: torch.Tensor) -> None:
        recipe = self._recipes.get(name)
        if recipe is not None:
            terms = self._staged_terms(recipe.target)
            if recipe.term not in terms:
                terms[recipe.term] = TermBuffers.empty(recipe, self._dtypes[name], self.device)
            terms[recipe.term].put(recipe, data)
        elif name in self._blocks:
            meta = self._table[name]
            staged = self._st_pristine.get(name)
            if staged is None:
                staged = self._st_pristine[name] = torch.empty(meta.shape, dtype=data.dtype, device=self.device)
                self._st_covered[name] = 0
            staged[tuple(slice(a, b) for a, b in box)].copy_(data)
            self._st_covered[name] += box_numel(box)
        else:
            self.inner.apply(name, box, data)

    def finish_update(self) -> FinishReport:
        """Merge every target whose pristine copy or factors changed, then finish the engine's update.

        Raises:
            FactorStateError: a target lacks its pristine copy or a term block (nothing merged).
        """
        import time

        t0 = time.perf_counter()
        pristine = {**self._pristine, **self._st_pristine}
        terms = {**self._terms, **self._st_terms}
        for target in self._remerge:
            why = self._complete(target, pristine, terms)
            if why:
                raise FactorStateError(f"cannot merge {target}: {why}; this receiver needs a full sync first")
        for target in self._remerge:  # whole targets: an engine stages and serves whole tensors
            self._merge(target, pristine[target], terms[target])
        self.merge_s = time.perf_counter() - t0
        return self.inner.finish_update()

    def commit(self, version: int) -> None:
        self.inner.commit(version)
        self._pristine.update(self._st_pristine)
        self._terms.update(self._st_terms)
        self._reset_staged()

    def abort(self) -> None:
        self._reset_staged()
        self.inner.abort()

    # -- internals -------------------------------------------------------------------------
    def _staged_terms(self, target: str) -> dict[int, TermBuffers]:
        staged = self._st_terms.get(target)
        if staged is None:
            staged = self._st_terms[target] = {i: b.clone() for i, b in self._terms.get(target, {}).items()}
        return staged

    def _complete(self, target: str, pristine: dict, terms: dict) -> str | None:
        """Why ``target`` cannot be merged from ``pristine``/``terms``, or ``None``."""
        if target not in pristine:
            return "no pristine base copy"
        if target in self._st_pristine and self._st_covered[target] != box_numel(full_box(self._table[target].shape)):
            return "the pristine base arrived incomplete"
        have = terms.get(target, {})
        for index, blocks in self._blocks[target].items():
            if index not in have or not have[index].complete(blocks):
                return f"LoRA term {index} is missing expert blocks"
        return None

    def _merge(self, target: str, w0: torch.Tensor, bufs: dict[int, TermBuffers]) -> None:
        """Merge every box of ``target`` into the engine's staging. A delta carries only the changed expert
        blocks' factors, but an engine's update covers whole tensors (``engines.staging``: never pre-filled
        from served values), so the unchanged blocks are re-merged from the resident W0 and terms (bitwise
        what they were)."""
        meta = self._table[target]
        adapter = LoraAdapter(terms={target: [bufs[i].term() for i in sorted(bufs)]})
        source = MergedSource(TensorDictBase({target: w0}), adapter, config=MergeConfig(staging_bytes=self.config.staging_bytes),
                              owned=[ParamMeta(target, meta.dtype, meta.shape)])
        dtype = TORCH_DTYPES[meta.dtype]
        for box in self._boxes[target]:
            out = torch.empty(box_shape(box), dtype=dtype, device=self.device)
            source.fill(target, box, out)
            self.inner.apply(target, box, out)

