"""Plan building and validation: pure functions over ``ParamMeta`` lists (no Ray).

``build_sync_plan`` packs each trainer rank's owned boxes into its own buckets
(``streaming.plan.build_plan``, sender = rank) and combines them. ``validate_plan`` checks the plan
against one engine's parameter table *before the first byte moves*: every sent name resolves to
exactly one engine parameter with the same shape and dtype, every engine parameter is covered
completely (a full sync must leave nothing at the engine's initial values), and no element is sent
twice. Errors list the offending names on both sides.

``engine_dtypes`` runs first: the engines' tables decide the dtype a tensor is sent in. Where every engine
holding a tensor holds it in one merge dtype (``protocols.params.MERGE_DTYPES``) other than the trainers' (an
fp32 trainer, bf16 engines), the plan carries the engines' dtype and the trainers merge in their accumulation
dtype and cast once into it, straight into the bucket (``MergeConfig.out_dtypes``). One bucket stream serves
every engine, so engines that hold one tensor in two dtypes are refused (``DtypeConflictError``); a shape
or an integer dtype that differs is left to ``validate_plan`` to refuse.

Block FP8 (``sync_service.fp8``): a tensor the engines hold as ``float8_e4m3fn`` with its scales beside it is
sent as FP8 values plus a scale companion box per owned box (``scale_meta``, in the engines' scale dtype: float32
or ue8m0), produced by the rank that owns the box (it merges in the accumulation dtype and quantizes per block
straight into the bucket, with the rounding of that scale format). Every owned box must start and stop on block
edges in its last two dims (``BlockAlignmentError``, naming the tensor, the box and the block: a TP split that
cuts blocks is refused, not gathered, as vLLM refuses a TP shard off the block grid); a delta sends a changed
tensor's scales with its values (``with_scales``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace

from protocols.params import DTYPE_BYTES, MERGE_DTYPES, ParamMeta, box_numel
from protocols.wire import MAX_HEADER_BYTES, MAX_PLAN_ENTRIES, SyncPlan, encode
from sync_service.fp8 import FP8_WIRE, box_aligned, scale_meta, scale_name, table_blocks, table_scale_dtypes
from sync_service.streaming.plan import build_plan, combine_plans, plan_entries, smallest_bucket_bytes
from sync_service.coordinator.tiling import TrainerMeshError, check_tiling  # noqa: F401 (re-exported)

__all__ = ["BlockAlignmentError", "DtypeConflictError", "PlanMismatchError", "build_sync_plan", "check_plan_size",
           "engine_dtypes", "scale_companions", "validate_plan", "with_scales"]


class PlanMismatchError(ValueError):
    """The trainers' plan does not fit an engine's parameter table; nothing was sent.

    Attributes:
        engine: the engine's name. unexpected: sent names the engine lacks. missing: engine
        parameters nobody sends (fully). mismatched: ``name: sent dtype[shape] vs engine dtype[shape]``.
    """

    def __init__(self, engine: str, unexpected: list[str], missing: list[str], mismatched: list[str]):
        parts = []
        if unexpected:
            parts.append(f"{len(unexpected)} sent name(s) not in the engine table, e.g. {unexpected[:3]}")
        if missing:
            parts.append(f"{len(missing)} engine parameter(s) not (fully) produced by any trainer, e.g. {missing[:3]}")
        if mismatched:
            parts.append(f"{len(mismatched)} shape/dtype mismatch(es), e.g. {mismatched[:3]}")
        super().__init__(
            f"engine {engine!r}: plan does not match its parameter table: {'; '.join(parts)}. "
            f"Load the engine from the same model family/size as the trainers' base (a float64/float32/"
            f"float16/bfloat16 engine tensor is served cast from the trainers' dtype; FP8 and integer dtypes must match)."
        )
        self.engine, self.unexpected, self.missing, self.mismatched = engine, unexpected, missing, mismatched


class DtypeConflictError(ValueError):
    """Engines hold one tensor in different dtypes; one bucket stream cannot serve both. Nothing was sent.

    Attributes:
        conflicts: tensor name → {engine name: the dtype it holds the tensor in}.
    """

    def __init__(self, conflicts: Mapping[str, Mapping[str, str]]):
        first = sorted(conflicts)[:3]
        shown = "; ".join(f"{n}: " + ", ".join(f"engine {e!r} {d}" for e, d in sorted(conflicts[n].items()))
                          for n in first)
        super().__init__(
            f"{len(conflicts)} tensor(s) held in different dtypes by different engines, e.g. {shown}; one bucket "
            f"stream serves every engine of a WeightSync: load every engine in one dtype (e.g. --dtype / "
            f"from_pretrained(dtype=...)), or sync the engines of each dtype with a WeightSync of their own"
        )
        self.conflicts = {n: dict(d) for n, d in conflicts.items()}


class BlockAlignmentError(ValueError):
    """A trainer box of a tensor an engine serves in block FP8 does not start and stop on block edges; nothing
    was sent. Attributes: ``name``, ``box``, ``block``."""

    def __init__(self, name: str, box, block: tuple[int, int]):
        super().__init__(f"{name}: trainer box {list(box)} is not aligned to the engines' FP8 block {list(block)} in "
                         f"its last two dims; every box must start and stop on multiples of the block (a TP split "
                         f"cuts blocks here: use a tp whose shards are block multiples, e.g. tp=1, or serve this "
                         f"engine a checkpoint with a smaller --weight-block-size, or a bf16 one)")
        self.name, self.box, self.block = name, box, block


def _scale_dtypes(tables: Mapping[str, Sequence[ParamMeta]]) -> dict[str, str]:
    """FP8 value name → the wire dtype every engine holds its scales in (float32 or ue8m0's float8_e8m0fnu).

    Raises:
        DtypeConflictError: engines holding one tensor's scales in both (one bucket stream serves them all).
    """
    held: dict[str, dict[str, str]] = defaultdict(dict)  # scales name → engine → their dtype
    for engine, table in tables.items():
        for name, dtype in table_scale_dtypes(table).items():
            held[scale_name(name)][engine] = dtype
    conflicts = {n: engines for n, engines in held.items() if len(set(engines.values())) > 1}
    if conflicts:
        raise DtypeConflictError(conflicts)
    return {name: dtype for table in tables.values() for name, dtype in table_scale_dtypes(table).items()}


def _fp8_boxes(owned: Sequence[Sequence[ParamMeta]], tables: Mapping[str, Sequence[ParamMeta]]
               ) -> tuple[list[list[ParamMeta]], dict[tuple[str, str], int]]:
    """``owned`` with every box of a tensor an engine holds in block FP8 retyped to FP8 and followed by its scale
    box. Raises ``BlockAlignmentError``; ``ValueError`` for a trainer base provider that lists FP8 values itself
    (a checkpoint directory is read dequantized by ``merge.fp8_base``)."""
    blocks: dict[str, tuple[int, int]] = {}
    for table in tables.values():
        blocks.update(table_blocks(table))
    scales = _scale_dtypes(tables)
    counts: dict[tuple[str, str], int] = defaultdict(int)
    out: list[list[ParamMeta]] = []
    for ranks in owned:
        out.append([])
        for m in ranks:
            if m.dtype == FP8_WIRE:
                raise ValueError(f"trainer base holds {m.name} in {FP8_WIRE} (an FP8 checkpoint under a LoRA): not "
                                 f"merged (the delta must not be added to FP8 values); give the trainers a base "
                                 f"provider that reads it dequantized (merge.fp8_base.Fp8Base, what load_rank and "
                                 f"weightsync sync use for a block-FP8 checkpoint directory) or a bf16/fp32 base")
            block = blocks.get(m.name)
            if block is None:
                out[-1].append(m)
                continue
            if m.dtype not in MERGE_DTYPES or not box_aligned(m.covered_box(), block):
                raise BlockAlignmentError(m.name, m.covered_box(), block)
            out[-1] += [replace(m, dtype=FP8_WIRE), scale_meta(m, block, scales[m.name])]
    sent = {m.name: m.dtype for ranks in owned for m in ranks if m.name in blocks}
    for dtype in sent.values():  # per tensor, not per box
        counts[(dtype, FP8_WIRE)] += 1
    return out, dict(counts)


def scale_companions(plan: SyncPlan) -> dict[str, str]:
    """FP8 value name → its scales' name, for the block-FP8 tensors of ``plan``."""
    names = {e.name for e in plan.entries}
    return {e.name: scale_name(e.name) for e in plan.entries if e.dtype == FP8_WIRE and scale_name(e.name) in names}


def with_scales(names: frozenset[str] | None, companions: Mapping[str, str]) -> frozenset[str] | None:
    """A push's ``names`` with the scales of every FP8 tensor among them (a delta re-sends both)."""
    return None if names is None else names | {companions[n] for n in names if n in companions}


def engine_dtypes(owned: Sequence[Sequence[ParamMeta]], tables: Mapping[str, Sequence[ParamMeta]]
                  ) -> tuple[list[list[ParamMeta]], dict[tuple[str, str], int]]:
    """``owned`` with each tensor's dtype set to the one its engines hold, where that is a cast the merge makes.

    ``owned[rank]``: the trainer ranks' boxes (the base's dtype); ``tables``: engine name → its parameter table.
    A tensor whose engines all hold it in one dtype ``d`` that differs from the trainers' ``t``, with both
    in ``MERGE_DTYPES`` (float64 / float32 / float16 / bfloat16), is sent as ``d``. A tensor held in block FP8
    with its scales (``sync_service.fp8``) is sent as FP8 plus a scale box per owned box (``_fp8_boxes``).
    Anything else keeps the trainers' dtype, so ``validate_plan`` refuses it by name (an integer tensor is
    never converted).

    Returns:
        ``(owned with the engines' dtypes, {(from, to): number of tensors converted})``.

    Raises:
        TrainerMeshError: the trainer ranks' boxes of a tensor do not tile it (ranks on different meshes;
            ``tiling.check_tiling``), checked first: before an engine's table is compared with them.
        DtypeConflictError: a tensor the engines hold in two or more dtypes, naming it, the engines and the dtypes.
        BlockAlignmentError: a box of an FP8 tensor off the block edges.
    """
    check_tiling(owned)
    held: dict[str, dict[str, str]] = defaultdict(dict)  # tensor → engine → dtype
    for engine, table in tables.items():
        for m in table:
            held[m.name][engine] = m.dtype
    sent = {m.name: m.dtype for ranks in owned for m in ranks}
    conflicts = {n: held[n] for n in sorted(sent) if len(set(held.get(n, {}).values())) > 1}
    if conflicts:
        raise DtypeConflictError(conflicts)
    cast: dict[str, str] = {}
    for name, dtype in sent.items():
        want = next(iter(held[name].values()), dtype) if name in held else dtype
        if want != dtype and want in MERGE_DTYPES and dtype in MERGE_DTYPES:
            cast[name] = want
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for name, want in cast.items():
        counts[(sent[name], want)] += 1
    retyped = [[replace(m, dtype=cast[m.name]) if m.name in cast else m for m in ranks] for ranks in owned]
    retyped, fp8 = _fp8_boxes(retyped, tables)
    return retyped, {**counts, **fp8}


def build_sync_plan(owned: Sequence[Sequence[ParamMeta]], *, bucket_bytes: int) -> SyncPlan:
    """One plan for all trainer ranks: ``owned[rank]`` are rank's global boxes, in production order.

    Raises:
        ValueError: a box produced by two ranks, bad dtype, or bad ``bucket_bytes``.
    """
    return combine_plans([build_plan(list(metas), bucket_bytes=bucket_bytes, sender=rank)
                          for rank, metas in enumerate(owned)])


def check_plan_size(owned: Sequence[Sequence[ParamMeta]], *, bucket_bytes: int, encoded: int | None = None) -> None:
    """The plan of ``owned`` cut at ``bucket_bytes`` fits one message: at most ``MAX_PLAN_ENTRIES`` entries
    (checked from the metas, before the plan is built) and, given ``encoded`` (its encoded size, bytes), at
    most ``MAX_HEADER_BYTES``. Runs before any byte moves: a plan too large would fail only on the
    endpoints, after seconds of splitting and encoding.

    Raises:
        ValueError: naming ``bucket_bytes``, the smallest value that fits and the fix.
    """
    metas = [m for ranks in owned for m in ranks]
    entries = plan_entries(metas, bucket_bytes)
    if encoded is None and entries <= MAX_PLAN_ENTRIES or encoded is not None and encoded <= MAX_HEADER_BYTES:
        return
    if encoded is None:  # bytes per entry of this model's names, from its plan without splits
        whole = build_sync_plan(owned, bucket_bytes=smallest_bucket_bytes(metas, len(metas)))
        per_entry = len(encode(whole)) / max(1, len(whole.entries))
    else:
        per_entry = encoded / entries
    limit = min(MAX_PLAN_ENTRIES, int(0.9 * MAX_HEADER_BYTES / per_entry))
    largest = max(box_numel(m.covered_box()) * DTYPE_BYTES[m.dtype] for m in metas)
    size = f"{entries} entries" if encoded is None else f"{entries} entries, {encoded} bytes encoded"
    raise ValueError(f"SyncConfig.bucket_bytes={bucket_bytes} cuts the model (largest tensor {largest} bytes) into a plan of "
                     f"{size}; a plan travels as one message of at most {MAX_PLAN_ENTRIES} entries and "
                     f"{MAX_HEADER_BYTES} bytes (the header limit, protocols.wire: ~{limit} entries of these names); "
                     f"set bucket_bytes to at least {smallest_bucket_bytes(metas, limit)} (the default is 64 MiB)")


def validate_plan(plan: SyncPlan, table: Sequence[ParamMeta], *, engine: str) -> None:
    """Check ``plan`` against one engine's table (whole tensors).

    Raises:
        PlanMismatchError: unexpected, missing, partially covered or mismatched names.
    """
    by_name: dict[str, ParamMeta] = {}
    duplicates = []
    for m in table:
        if m.name in by_name:
            duplicates.append(m.name)
        by_name[m.name] = m
    sent: dict[str, int] = defaultdict(int)
    kinds: dict[str, tuple[str, tuple[int, ...]]] = {}
    for e in plan.entries:
        sent[e.name] += box_numel(e.box)
        kinds[e.name] = (e.dtype, tuple(e.shape))
    unexpected = sorted(n for n in sent if n not in by_name) + sorted(duplicates)
    mismatched = sorted(
        f"{n}: sent {d}{list(s)} vs engine {by_name[n].dtype}{list(by_name[n].shape)}"
        for n, (d, s) in kinds.items() if n in by_name and (d, s) != (by_name[n].dtype, tuple(by_name[n].shape))
    )
    missing = sorted(
        n for n, m in by_name.items()
        if sent.get(n, 0) != box_numel(m.covered_box()) and not any(x.startswith(n + ":") for x in mismatched)
    )
    if unexpected or missing or mismatched:
        raise PlanMismatchError(engine, unexpected, missing, mismatched)
