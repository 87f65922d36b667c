"""Block FP8 straight into the bucket: the trainer side of an engine that serves block FP8.

For a tensor the plan sends as ``float8_e4m3fn`` (``sync_service.fp8``: values ``X`` plus scales
``scale_name(X)``), ``MergedSource.fill`` hands both names here. A values box is widened to the block edges
around it (the plan may cut an owned box anywhere when it packs buckets; an owned box itself is aligned,
``coordinator.planning``), merged in the accumulation dtype (fp32, or float64) into a scratch, quantized by
``quantize.quantize_blocks`` (transformers' ``Fp8Quantize`` arithmetic, in the scale format of the engines'
scales: float32, or ue8m0's power-of-two rounding) and the asked part copied out. Every
block is quantized from its own values alone, so a widened box gives exactly the values of the whole tensor's
quantization.

Scales without a second merge: the scales of every region quantized for values are kept (``Fp8Fill._kept``,
1/(bm·bn) of the values' elements) until the scale box that covers them is filled — in the plan the scales
box follows its values box. A scale box not fully covered by kept regions (a delta sending scales alone, a
values box sent by another rank) is merged and quantized again: same values, more time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from protocols.params import Box, box_shape
from sync_service.fp8 import scale_name
from sync_service.merge.quantize import quantize_blocks

__all__ = ["Fp8Fill"]

Merge = Callable[[str, Box, torch.dtype], torch.Tensor]
"""``(name, box, accumulate dtype) → merged values of box`` (a scratch valid until the next call)."""


def _widen(box: Box, block: tuple[int, int]) -> Box:
    """``box`` widened to the block edges of its last two dims."""
    (r0, r1), (c0, c1) = box[-2:]
    bm, bn = block
    return (*box[:-2], (r0 // bm * bm, -(-r1 // bm) * bm), (c0 // bn * bn, -(-c1 // bn) * bn))


def _rel(inner: Box, outer: Box) -> tuple[slice, ...]:
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer))


def _meet(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in box) else box


class Fp8Fill:
    """Quantized values and scales of the block-FP8 tensors of one ``MergedSource``.

    Args:
        blocks: FP8 value name → block ``(bm, bn)`` (``MergeConfig.fp8_blocks``).
        merge: merged values of a box in an accumulation dtype (``MergedSource._merge_box``).
        accumulate: value name → the accumulation dtype of its merge.
        scale_fmt: value name → its ``FineGrainedFP8Config.scale_fmt`` (``"float"`` or ``"ue8m0"``), from the
            dtype the plan sends its scales in.
    """

    def __init__(self, blocks: Mapping[str, tuple[int, int]], merge: Merge, accumulate: Callable[[str], torch.dtype],
                 scale_fmt: Callable[[str], str]):
        self.blocks = {n: tuple(b) for n, b in blocks.items()}
        self._scale_fmt = scale_fmt
        self.values_of = {scale_name(n): n for n in self.blocks}
        """Scales name → its values' name."""
        self._merge, self._accumulate = merge, accumulate
        self._kept: dict[str, list[tuple[Box, torch.Tensor]]] = {}
        self._last: tuple[str, Box, torch.Tensor, torch.Tensor] | None = None

    def fill_values(self, name: str, box: Box, out: torch.Tensor) -> None:
        """FP8 values of ``box`` of ``name`` into ``out`` (``float8_e4m3fn``, ``box_shape(box)``)."""
        region = _widen(box, self.blocks[name])
        q, s = self._quantized(name, region)
        out.copy_(q[_rel(box, region)])

    def fill_scales(self, name: str, box: Box, out: torch.Tensor) -> None:
        """Scales (float32 or float8_e8m0fnu) of ``box`` of the scales tensor ``name`` into ``out``: from the kept
        regions when they cover it, else merged and quantized again."""
        values = self.values_of[name]
        bm, bn = self.blocks[values]
        region = (*box[:-2], (box[-2][0] * bm, box[-2][1] * bm), (box[-1][0] * bn, box[-1][1] * bn))
        covered = torch.zeros(box_shape(box), dtype=torch.bool)
        kept = self._kept.get(values, [])
        for r, s in kept:
            meet = _meet(r, region)
            if meet is None:
                continue
            blocks = (*meet[:-2], (meet[-2][0] // bm, meet[-2][1] // bm), (meet[-1][0] // bn, meet[-1][1] // bn))
            rb = (*r[:-2], (r[-2][0] // bm, r[-2][1] // bm), (r[-1][0] // bn, r[-1][1] // bn))
            out[_rel(blocks, box)].copy_(s[_rel(blocks, rb)])
            covered[_rel(blocks, box)] = True
        if not bool(covered.all()):
            out.copy_(self._quantized(values, region)[1])
        self._kept[values] = [(r, s) for r, s in kept if _meet(r, region) != r]  # fully sent: dropped

    def _quantized(self, name: str, region: Box) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q, s)`` of the aligned ``region`` (the last one is reused: consecutive pieces of one block row)."""
        if self._last is not None and self._last[:2] == (name, region):
            return self._last[2], self._last[3]
        merged = self._merge(name, region, self._accumulate(name))
        q, s = quantize_blocks(merged, self.blocks[name], self._scale_fmt(name))
        self._kept.setdefault(name, []).append((region, s))
        self._last = (name, region, q, s)
        return q, s
