"""Factor mode into a block-FP8 engine: the receiver merges over the trainers' base and quantizes as they would.

A factor-mode target ``X`` the engine serves in block FP8 (``sync_service.fp8``: ``float8_e4m3fn`` values plus
scales ``scale_name(X)``) travels as the trainers' *pristine base* in the trainers' own dtype (the recipe's
``target_dtype``: bf16, fp32, or an FP8 checkpoint read dequantized as float32), never as FP8: the engine keeps that
copy resident and merges over it, so it holds the trainers' base, not a rounded one. The merge is the trainers' own
``MergedSource`` with ``MergeConfig.fp8_blocks`` (merge in the accumulation dtype, ``merge.fp8_fill`` quantizing
per block with ``merge.quantize.BlockQuantizer`` in the engine's scale format, ``fp8.SCALE_WIRES``) over the boxes
and in the order a merged-mode plan sends them: for each trainer rank's owned box, its FP8 values pieces
(``split_box`` at 1 byte per element) then its scales pieces. So the engine's bytes are those a merged-mode sync
of the version writes, bit for bit.

The owned boxes are read back from the factor plan: a rank's pristine pieces of ``X`` are ``split_box`` of each
owned box in the trainers' dtype, in order; consecutive pieces are joined while they are exactly the split of
their union (two owned boxes of one rank that touch and split as one would be joined: a rank owns one box of a
tensor, or strided boxes that never touch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from protocols.params import DTYPE_BYTES, Box, ParamMeta, box_numel
from protocols.wire import SyncPlan
from sync_service.fp8 import FP8_WIRE, scale_box, scale_name
from sync_service.merge.source import MergeConfig
from sync_service.streaming.plan import split_box

__all__ = ["Fp8Target", "fp8_targets", "owned_boxes"]


def _union(boxes: Sequence[Box]) -> Box | None:
    """The box that ``boxes`` (disjoint) tile exactly, or ``None``."""
    hull = tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(boxes[0])))
    return hull if box_numel(hull) == sum(box_numel(b) for b in boxes) else None


def owned_boxes(pieces: Sequence[Box], itemsize: int, cap_bytes: int) -> list[Box]:
    """One rank's owned boxes of a tensor from its plan pieces (``split_box(owned, itemsize, cap_bytes)`` of
    each owned box, concatenated in order): each run of pieces joined to the longest union they split into."""
    out, i = [], 0
    while i < len(pieces):
        j = len(pieces)
        while j > i + 1:
            hull = _union(pieces[i:j])
            if hull is not None and list(split_box(hull, itemsize, cap_bytes)) == list(pieces[i:j]):
                break
            j -= 1
        out.append(pieces[i] if j == i + 1 else _union(pieces[i:j]))
        i = j
    return out


class Fp8Target:
    """How the receiver merges one factor-mode target ``meta`` (FP8 in the engine's table) into the engine.

    Args:
        meta: the engine's ``float8_e4m3fn`` entry. block: its ``(bm, bn)``. scale_dtype: its scales' wire dtype
            (a key of ``fp8.SCALE_WIRES``). base_dtype: the trainers' dtype of its pristine base (the plan's).
        boxes: the trainers' owned boxes of it, per rank in plan order (``owned_boxes``).
        cap_bytes: the plan's bucket size.
    """

    def __init__(self, meta: ParamMeta, block: tuple[int, int], scale_dtype: str, base_dtype: str,
                 boxes: Sequence[Box], cap_bytes: int):
        self.name, self.block, self.scale_dtype, self.base_dtype = meta.name, block, scale_dtype, base_dtype
        self.scales = scale_name(meta.name)
        self.owned = [ParamMeta(meta.name, base_dtype, tuple(meta.shape), box) for box in boxes]
        self.pieces: list[tuple[str, Box, str]] = []
        """``(name, box, wire dtype)`` in merged-mode plan order: values pieces of an owned box, then its scales."""
        for box in boxes:
            self.pieces += [(self.name, b, FP8_WIRE) for b in split_box(box, DTYPE_BYTES[FP8_WIRE], cap_bytes)]
            self.pieces += [(self.scales, b, scale_dtype)
                            for b in split_box(scale_box(box, block), DTYPE_BYTES[scale_dtype], cap_bytes)]

    def merge_config(self, config: MergeConfig) -> MergeConfig:
        """``config`` with this target quantized into the engine's FP8 values and scales (as the trainers' is set
        per send from the plan, ``live.endpoint``)."""
        return replace(config, fp8_blocks={self.name: self.block},
                       out_dtypes={self.name: FP8_WIRE, self.scales: self.scale_dtype})


def fp8_targets(plan: SyncPlan, table: Sequence[ParamMeta], blocks: dict[str, tuple[int, int]],
                scale_dtypes: dict[str, str], targets: frozenset[str]) -> dict[str, Fp8Target]:
    """Factor-mode target → its ``Fp8Target``, for the ``targets`` the engine's ``table`` lists in block FP8
    (``blocks`` / ``scale_dtypes``: ``fp8.table_blocks`` / ``table_scale_dtypes`` of the table)."""
    metas = {m.name: m for m in table}
    out = {}
    for name in sorted(targets & blocks.keys()):
        entries = [e for e in plan.entries if e.recipe is None and e.name == name]
        boxes: list[Box] = []
        for sender in dict.fromkeys(e.sender for e in entries):
            boxes += owned_boxes([e.box for e in entries if e.sender == sender], DTYPE_BYTES[entries[0].dtype],
                                 plan.bucket_bytes)
        out[name] = Fp8Target(metas[name], blocks[name], scale_dtypes[name], entries[0].dtype, boxes, plan.bucket_bytes)
    return out
