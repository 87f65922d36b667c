"""Factor plans: the sync plan of factor streaming, its costs, its validation and its delta names.

A factor plan lists, per sender (trainer rank), in layer order:
- every owned box of every tensor as a ``"tensor"`` entry, split to fit a bucket exactly as
  ``streaming.plan.build_plan`` splits it (so the boxes are those of a merged-mode plan): for a
  factor-mode target these carry the *pristine base* W0 (sent in full syncs only), for any other
  tensor the merged values (as in merged mode);
- after the last box of a factor-mode target T, the ``"recipe"`` entries of T whose anchor element
  (first expert, first row, first column of the block) lies in a box the rank owns.

A full sync sends everything; a delta sync (``Begin.names``) sends the changed merged-mode tensors
and the changed recipe blocks only. The receiver merges T over the same boxes the merged plan has,
so its values are those a merged-mode sync would have written, box for box.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from protocols.params import DTYPE_BYTES, Box, ParamMeta, box_numel
from protocols.recipe import Recipe
from protocols.wire import PlanEntry, SyncPlan
from sync_service.coordinator.planning import PlanMismatchError, validate_plan
from sync_service.factor_stream.choose import TargetCost
from sync_service.factor_stream.recipes import factor_dtype_of, recipes_for_target, term_factor_bytes
from sync_service.fp8 import FP8_WIRE, scale_name, table_blocks
from sync_service.merge.terms import LoraAdapter
from sync_service.streaming.plan import _pack, combine_plans, split_box

__all__ = ["target_costs", "engine_merged_bytes", "adapter_recipes", "build_factor_plan", "validate_factor_plan", "factor_targets",
           "recipe_names_of", "merged_boxes"]


def target_costs(adapter: LoraAdapter, base_metas: Sequence[ParamMeta], out_dtypes: Mapping[str, str]) -> list[TargetCost]:
    """Per changed tensor: merged bytes, factor bytes and resident bytes (``choose.TargetCost``)."""
    metas = {m.name: m for m in base_metas}
    costs = []
    for name in sorted(adapter.changed_names()):
        meta = metas[name]
        out = out_dtypes.get(name, meta.dtype)
        merged = box_numel(meta.covered_box()) * DTYPE_BYTES[out]
        why = ("modules_to_save replacement" if name in adapter.replacements else
               "DoRA is not additive" if name in adapter.dora_magnitudes else
               "trainable_token_indices rows are replaced, not added" if name in adapter.row_overrides else
               f"merged dtype {out} != base dtype {meta.dtype}" if out != meta.dtype else
               "no LoRA terms" if not adapter.terms.get(name) else "")
        costs.append(TargetCost(name=name, merged_bytes=merged, factor_bytes=term_factor_bytes(adapter.terms.get(name, [])),
                                pristine_bytes=box_numel(meta.covered_box()) * DTYPE_BYTES[meta.dtype], why_not=why))
    return costs


def engine_merged_bytes(costs: Sequence[TargetCost], owned: Sequence[Sequence[ParamMeta]]) -> list[TargetCost]:
    """``costs`` (``target_costs``, the trainers' dtypes) with the merged bytes of each tensor the engines serve in
    block FP8 as they travel merged: its FP8 values plus its scales (``owned``: the engines' dtypes and scale boxes,
    ``coordinator.planning.engine_dtypes``), about half a bf16 tensor's: what ``choose`` weighs factors against."""
    fp8 = {m.name for ranks in owned for m in ranks if m.dtype == FP8_WIRE}
    values_of = {**{n: n for n in fp8}, **{scale_name(n): n for n in fp8}}
    sent: dict[str, int] = {}
    for m in (m for ranks in owned for m in ranks):
        values = values_of.get(m.name)
        if values is not None:
            sent[values] = sent.get(values, 0) + box_numel(m.covered_box()) * DTYPE_BYTES[m.dtype]
    return [replace(c, merged_bytes=sent[c.name]) if c.name in sent else c for c in costs]


def adapter_recipes(adapter: LoraAdapter, base_metas: Sequence[ParamMeta], targets: Iterable[str], *,
                    experts_per_recipe: int, bucket_bytes: int, wire_dtype: str | None = None) -> list[Recipe]:
    """Every recipe block of ``targets`` (factor-mode names), in target then term order; factors travel
    in ``wire_dtype`` (``recipes.factor_wire_dtype``; ``None``: the terms' own dtype)."""
    metas = {m.name: m for m in base_metas}
    out: list[Recipe] = []
    for name in targets:
        out.extend(recipes_for_target(metas[name], adapter.terms[name], experts_per_recipe=experts_per_recipe,
                                      max_block_bytes=bucket_bytes, wire_dtype=wire_dtype))
    return out


def _anchor(r: Recipe) -> tuple[int, ...]:
    lead = () if r.experts is None else (r.experts[0],)
    return lead + (r.rows[0], r.cols[0])


def _contains(box: Box, point: tuple[int, ...]) -> bool:
    return len(box) == len(point) and all(a <= p < b for (a, b), p in zip(box, point))


def _pristine_dtypes(owned: Sequence[Sequence[ParamMeta]], by_target: Mapping[str, list[Recipe]]
                     ) -> tuple[dict[str, str], set[str]]:
    """Factor target → the dtype its pristine base travels in (the trainers': the recipes' ``target_dtype``), and
    the scales names of the targets the engines serve in block FP8 (the receiver quantizes them).

    Raises:
        ValueError: a target the engines hold in another floating dtype than the trainers' base.
    """
    dtypes: dict[str, str] = {}
    scales: set[str] = set()
    for m in (m for ranks in owned for m in ranks if m.name in by_target):
        base = by_target[m.name][0].target_dtype
        if m.dtype == FP8_WIRE:
            scales.add(scale_name(m.name))
        elif m.dtype != base:
            raise ValueError(f"factor streaming of {m.name}: the engines hold it in {m.dtype}, the trainers' base in "
                             f"{base}, and the engine merges over the base it holds (a {m.dtype} copy is not the "
                             f"trainers' base: it would serve other values than merged mode); load the engines in "
                             f"{base} or in block FP8, or use SyncConfig(mode='merged')")
        dtypes[m.name] = base
    return dtypes, scales


def build_factor_plan(owned: Sequence[Sequence[ParamMeta]], recipes: Sequence[Recipe], *, bucket_bytes: int) -> SyncPlan:
    """One plan for all trainer ranks (``owned[rank]``: the rank's global boxes in production order).

    ``owned`` carries the engines' dtypes (``coordinator.planning.engine_dtypes``): a target listed as FP8 values
    plus scales is planned as its pristine base in the trainers' dtype, without the scales.

    Raises:
        ValueError: a recipe whose anchor no rank owns, a target the engines hold in another floating dtype
            (``_pristine_dtypes``), or any ``build_plan`` error.
    """
    by_target: dict[str, list[Recipe]] = {}
    for r in recipes:
        by_target.setdefault(r.target, []).append(r)
    sender_of: dict[str, int] = {}
    for rank, metas in enumerate(owned):
        for m in metas:
            for r in by_target.get(m.name, []):
                if _contains(m.covered_box(), _anchor(r)):
                    sender_of.setdefault(r.entry_name(), rank)
    orphans = [r.entry_name() for r in recipes if r.entry_name() not in sender_of]
    if orphans:
        raise ValueError(f"no trainer rank owns the first element of recipe(s) {orphans[:3]}; the owned boxes do not cover the targets")
    pristine, fp8_scales = _pristine_dtypes(owned, by_target)
    plans = []
    for rank, metas in enumerate(owned):
        metas = [replace(m, dtype=pristine.get(m.name, m.dtype)) for m in metas if m.name not in fp8_scales]
        last_box = {m.name: i for i, m in enumerate(metas)}
        pieces: list[tuple] = []
        for i, m in enumerate(metas):
            pieces.extend((m.name, m.dtype, m.shape, b) for b in split_box(m.covered_box(), DTYPE_BYTES[m.dtype], bucket_bytes))
            if last_box[m.name] == i:
                for r in by_target.get(m.name, []):
                    if sender_of[r.entry_name()] == rank:
                        n = r.numel()
                        pieces.append((r.entry_name(), factor_dtype_of(r), (n,), ((0, n),), "recipe", r))
        plans.append(SyncPlan(bucket_bytes=bucket_bytes, entries=tuple(_pack(pieces, rank, bucket_bytes))))
    return combine_plans(plans)


def factor_targets(plan: SyncPlan) -> frozenset[str]:
    """Names streamed as factors by ``plan`` (targets of its recipe entries)."""
    return frozenset(e.recipe.target for e in plan.entries if e.recipe is not None)


def recipe_names_of(plan: SyncPlan, sender: int | None = None) -> list[str]:
    """Recipe entry names of ``plan`` (of one sender when given), in plan order."""
    return [e.name for e in plan.entries if e.recipe is not None and (sender is None or e.sender == sender)]


def merged_boxes(plan: SyncPlan) -> dict[str, list[Box]]:
    """Factor target → the boxes of its tensor entries (all senders): where the receiver merges."""
    targets = factor_targets(plan)
    out: dict[str, list[Box]] = {}
    for e in plan.entries:
        if e.recipe is None and e.name in targets:
            out.setdefault(e.name, []).append(e.box)
    return out


def _factor_table(plan: SyncPlan, table: Sequence[ParamMeta]) -> list[ParamMeta]:
    """The engine's ``table`` as a factor plan covers it: a factor target it serves in block FP8 listed in the
    plan's dtype of its pristine base (the trainers'), its scales left out (the receiver quantizes them).
    Raises what ``fp8.table_blocks`` raises."""
    fp8 = factor_targets(plan) & table_blocks(table).keys()
    dtypes = {e.name: e.dtype for e in plan.entries if e.recipe is None and e.name in fp8}
    scales = {scale_name(n) for n in fp8}
    return [replace(m, dtype=dtypes.get(m.name, m.dtype)) for m in table if m.name not in scales]


def validate_factor_plan(plan: SyncPlan, table: Sequence[ParamMeta], *, engine: str) -> None:
    """Check a factor plan against one engine's table before any byte moves.

    Tensor entries must cover the table exactly (``coordinator.planning.validate_plan``; a block-FP8 target as its
    pristine base in the plan's dtype, its scales made by the receiver: ``_factor_table``); each recipe
    must name a tensor of the table with the recipe's shape and dtype, and every term's blocks must
    cover its expert range exactly once.

    Raises:
        PlanMismatchError: names, shapes or dtypes do not fit; ValueError: incomplete term blocks.
    """
    table = _factor_table(plan, table)
    validate_plan(SyncPlan(bucket_bytes=plan.bucket_bytes, entries=tuple(e for e in plan.entries if e.recipe is None)),
                  table, engine=engine)
    by_name = {m.name: m for m in table}
    unexpected, mismatched = [], []
    blocks: dict[tuple[str, int], list[tuple[int, int] | None]] = {}
    spans: dict[tuple[str, int], tuple[int, int] | None] = {}
    for e in plan.entries:
        r = e.recipe
        if r is None:
            continue
        meta = by_name.get(r.target)
        if meta is None:
            unexpected.append(e.name)
        elif (meta.dtype, tuple(meta.shape)) != (r.target_dtype, r.target_shape):
            mismatched.append(f"{e.name}: recipe {r.target_dtype}{list(r.target_shape)} vs engine {meta.dtype}{list(meta.shape)}")
        blocks.setdefault((r.target, r.term), []).append(r.experts)
        spans[(r.target, r.term)] = r.term_experts
    if unexpected or mismatched:
        raise PlanMismatchError(engine, unexpected, [], mismatched)
    for key, got in blocks.items():
        span = spans[key]
        if span is None:
            ok = got == [None]
        else:
            ranges = sorted(got)
            ok = ranges[0][0] == span[0] and ranges[-1][1] == span[1] and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        if not ok:
            raise ValueError(f"factor plan: term {key[1]} of {key[0]} has blocks {sorted(got, key=str)} that do not tile {span}")
