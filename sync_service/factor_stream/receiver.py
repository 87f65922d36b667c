"""Receiver side of factor streaming: ``FactorEngine`` merges LoRA factors into an engine.

``FactorEngine`` wraps any ``EngineAdapter`` and is itself one, so ``BucketReceiver`` drives it
unchanged. It keeps a resident *pristine* copy W0 of every factor-mode target (received in full
syncs) and the factors of every term (received as recipe blocks; a delta brings only changed
blocks). It merges each target the sync changes — and only those: a delta names the changed blocks,
so a target none of whose factors changed is neither re-merged nor restaged, the engine keeps
serving it — with the merge core's own code (``MergedSource.fill`` over a ``TensorDictBase`` of the
pristine copies and a ``LoraAdapter`` of the rebuilt terms) over the same boxes a merged-mode plan
has, and applies the result to the wrapped engine's staging: the engine holds bitwise what a
merged-mode sync of the version would have written. A target the engine serves in block FP8 arrives as the
trainers' base in their dtype (never FP8) and is merged and quantized into its FP8 values and scales over the
merged plan's pieces (``rx_fp8``), so those bytes too are merged mode's. A target is merged on a worker thread
(``rx_merge.MergePool``) as soon as its last piece of the sync (base box or factor block) has been
applied, overlapped with the rest of the stream; ``finish_update`` waits for the tail.

Behind the served check (``SyncConfig.check_served``; ``inner`` is then its ``AppliedDigests``) every merged box
the engine stages is checked as it landed (applied exactly once, the bytes handed over, finite), and every factor
block and pristine box as this receiver stored it (``_check_landed``).

State is copy-on-write: a sync writes staged pristine tensors and term buffers; ``commit`` promotes
them, ``abort`` drops them. A target without a complete pristine copy or complete terms is never
merged: ``FactorStateError`` fails the sync (the coordinator then runs a full sync).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protocols.interfaces import FinishReport
from protocols.params import Box, ParamMeta, box_numel, box_shape, full_box
from protocols.recipe import Recipe
from protocols.wire import SyncPlan
from sync_service.dtypes import TORCH_DTYPES
from sync_service.factor_stream.plan import merged_boxes
from sync_service.factor_stream.recipes import TermBuffers, term_dtype, terms_by_target
from sync_service.factor_stream.rx_fp8 import fp8_targets
from sync_service.factor_stream.rx_merge import MergePool
from sync_service.fp8 import table_blocks, table_scale_dtypes
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
    accumulate_dtype: str = "float32"
    """The merge's accumulation dtype (``MergeConfig.accumulate_dtype``): must equal the trainers'
    (``SyncConfig.accumulate_dtype``), or the engine serves other roundings than merged mode."""
    merge_threads: int = 0
    """Worker threads merging targets while the stream goes on (each one target at a time, on the
    torch intra-op threads the process has); ``0``: the CPUs this process may run on, at most 4.
    Each holds one output buffer of the largest box (<= a bucket)."""
    merge_timeout_s: float = 600.0
    """Longest wait at ``finish_update`` / ``abort`` for the merges still running, seconds."""


class FactorEngine:
    """``EngineAdapter`` over ``engine`` for a factor ``plan`` (``factor_stream.plan.build_factor_plan``)."""

    def __init__(self, engine, plan: SyncPlan, *, config: FactorReceiverConfig | None = None) -> None:
        self.inner = engine
        self.plan = plan
        self.config = config or FactorReceiverConfig()
        self.device = torch.device(self.config.pristine_device)
        self._recipes: dict[str, Recipe] = {e.name: e.recipe for e in plan.entries if e.recipe is not None}
        self._dtypes = {e.name: term_dtype(e.dtype) for e in plan.entries if e.recipe is not None}  # bf16 wire → fp32
        self._blocks = {t: {i: [r.experts for r in rs] for i, rs in terms.items()}
                        for t, terms in terms_by_target(list(self._recipes.values())).items()}
        self._boxes = merged_boxes(plan)
        table = list(engine.param_metas())
        self._table = {m.name: m for m in table}
        self._fp8 = fp8_targets(plan, table, table_blocks(table), table_scale_dtypes(table), frozenset(self._blocks))
        """Targets the engine serves in block FP8: merged over the trainers' base and quantized (``rx_fp8``)."""
        self._pristine: dict[str, torch.Tensor] = {}
        self._terms: dict[str, dict[int, TermBuffers]] = {}
        self._update_id: str | None = None  # the engine's token of the update this receiver staged
        threads = self.config.merge_threads or min(4, len(os.sched_getaffinity(0)))
        self._pool = MergePool(threads=threads, timeout_s=self.config.merge_timeout_s)
        self._apply_lock = threading.Lock()  # the wrapped engine's apply: one thread at a time
        self._reset_staged()
        self.merge_s = 0.0
        """Wall seconds of the last sync during which the receiver merged (workers, overlapping the stream)."""
        self.merged_targets = 0
        """Factor-mode targets merged by the last sync."""

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
        self._waiting: dict[str, set[str]] = {}  # target → pieces of this sync not yet applied
        self._unmergeable: dict[str, str] = {}  # target → why it cannot be merged

    # -- update lifecycle ------------------------------------------------------------------
    def begin_update(self, version: int, names: Sequence[str], *, reset_versions: bool = False) -> str | None:
        """Split ``names`` into recipes, pristine bases and plain tensors; begin the engine's update
        with the plain tensors and every target it will re-merge. Returns the engine's update token; the
        engine's refusal (another update staged, a fenced version) is raised before anything is touched."""
        gate = getattr(self.inner, "commit_gate", None)
        if gate is not None and gate.staged_id is not None:  # another sync's update: leave its state alone
            return self.inner.begin_update(version, list(names), reset_versions=reset_versions)
        self._pool.cancel()
        self._pool.reset()
        self._reset_staged()
        engine_names: list[str] = []
        for name in names:
            recipe = self._recipes.get(name)
            target = recipe.target if recipe is not None else name if name in self._blocks else None
            if target is not None:  # a recipe block, or the pristine base (the target's own name)
                self._remerge[target] = None
                self._waiting.setdefault(target, set()).add(name)
            engine_names.append(target or name)
            if target in self._fp8:
                engine_names.append(self._fp8[target].scales)
        names = list(dict.fromkeys(engine_names))
        self._update_id = (self.inner.begin_update(version, names, reset_versions=True) if reset_versions
                           else self.inner.begin_update(version, names))
        return self._update_id

    def apply(self, name: str, box: Box, data: torch.Tensor) -> None:
        """Stage a recipe block or pristine box (merging the target once its last piece arrived), or
        apply a plain tensor. Raises a failed merge's error, or what the engine's ``apply`` raises."""
        error = self._pool.failure()
        if error is not None:
            raise error
        recipe = self._recipes.get(name)
        if recipe is not None:
            terms = self._staged_terms(recipe.target)
            if recipe.term not in terms:
                terms[recipe.term] = TermBuffers.empty(recipe, self._dtypes[name], self.device)
            stored = terms[recipe.term].put(recipe, data)
            self._check_landed(name, box, *stored)
            self._arrived(recipe.target, name)
        elif name in self._blocks:
            meta = self._table[name]
            staged = self._st_pristine.get(name)
            if staged is None:
                staged = self._st_pristine[name] = torch.empty(meta.shape, dtype=data.dtype, device=self.device)
                self._st_covered[name] = 0
            landed = staged[tuple(slice(a, b) for a, b in box)]
            landed.copy_(data)
            self._check_landed(name, box, (data, landed))
            self._st_covered[name] += box_numel(box)
            if self._st_covered[name] == box_numel(full_box(meta.shape)):
                self._arrived(name, name)
        else:
            with self._apply_lock:
                self.inner.apply(name, box, data)

    def finish_update(self) -> FinishReport:
        """Wait for the merges of this sync's targets, then finish the engine's update.

        Raises:
            FactorStateError: a target lacks its pristine copy or a term block (its merge never ran).
            TimeoutError: merges still running after ``merge_timeout_s``; or a merge's own error.
        """
        for target in self._remerge:
            why = self._unmergeable.get(target) or ("its factor blocks or base arrived incomplete"
                                                    if self._waiting.get(target) else None)
            if why:
                self._pool.cancel()
                raise FactorStateError(f"cannot merge {target}: {why}; this receiver needs a full sync first")
        self._pool.wait()
        self.merge_s, self.merged_targets = self._pool.busy_s(), self._pool.submitted
        return self.inner.finish_update()

    def commit(self, version: int, update_id: str | None = None) -> None:
        self.inner.commit(*(version,) if update_id is None else (version, update_id))
        self._pristine.update(self._st_pristine)
        self._terms.update(self._st_terms)
        self._reset_staged()

    def abort(self, update_id: str | None = None) -> bool:
        """Stop the merges (none applies afterwards), drop everything staged, abort the engine's update —
        only when ``update_id`` is that update's token (``None``: whatever is staged); another update's
        token does nothing. Returns whether an update was dropped."""
        if update_id is not None and update_id != self._update_id:
            return False
        self._pool.cancel()
        self._reset_staged()
        self._update_id = None
        return bool(self.inner.abort(*() if update_id is None else (update_id,)))

    def close(self) -> None:
        """Stop the merge workers (after ``abort`` or ``commit``)."""
        self._pool.cancel()
        self._pool.close()

    # -- internals -------------------------------------------------------------------------
    def _check_landed(self, name: str, box: Box, *pairs: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Behind the served check (``engines.served_check.AppliedDigests`` as ``inner``): each ``(handed, stored)``
        factor block or pristine box is compared as this receiver stored it with the verified bytes handed over."""
        check = getattr(self.inner, "check_landed", None)
        if check is not None:
            for handed, stored in pairs:
                check(name, box, handed, stored)

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

    def _arrived(self, target: str, piece: str) -> None:
        """``piece`` of ``target`` is staged; once none is missing, queue the target's merge."""
        waiting = self._waiting[target]
        waiting.discard(piece)
        if waiting:
            return
        pristine = {**self._pristine, **self._st_pristine}
        terms = {**self._terms, **self._st_terms}
        why = self._complete(target, pristine, terms)
        if why:
            self._unmergeable[target] = why
        else:
            self._pool.submit(self._merge, target, pristine[target], terms[target])

    def _merge(self, target: str, w0: torch.Tensor, bufs: dict[int, TermBuffers]) -> None:
        """Merge every box of ``target`` into the engine's staging (on a merge worker). A delta carries
        only the changed expert blocks' factors, but an engine's update covers whole tensors
        (``engines.staging``: never pre-filled from served values), so the unchanged blocks are
        re-merged from the resident W0 and terms (bitwise what they were). A block-FP8 target is merged
        and quantized into its values and scales over the merged plan's pieces (``rx_fp8``)."""
        meta = self._table[target]
        adapter = LoraAdapter(terms={target: [bufs[i].term() for i in sorted(bufs)]})
        config = MergeConfig(staging_bytes=self.config.staging_bytes, accumulate_dtype=self.config.accumulate_dtype)
        fp8 = self._fp8.get(target)
        if fp8 is None:
            owned = [ParamMeta(target, meta.dtype, meta.shape)]
            pieces = [(target, box, meta.dtype) for box in self._boxes[target]]
        else:
            config, owned, pieces = fp8.merge_config(config), fp8.owned, fp8.pieces
        source = MergedSource(TensorDictBase({target: w0}), adapter, config=config, owned=owned)
        for name, box, dtype in pieces:
            if self._pool.cancelled.is_set():
                return
            out = self._pool.out_buffer(box_shape(box), TORCH_DTYPES[dtype], self.device)
            source.fill(name, box, out)
            with self._apply_lock:
                self.inner.apply(name, box, out)
