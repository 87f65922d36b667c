"""Block FP8 straight into the bucket: the trainer side of an engine that serves block FP8.

For a tensor the plan sends as ``float8_e4m3fn`` (``sync_service.fp8``: values ``X`` plus scales
``scale_name(X)``), ``MergedSource.fill`` hands both names here. A values box is widened to the block edges
around it (the plan may cut an owned box anywhere when it packs buckets; an owned box itself is aligned,
``coordinator.planning``) and merged in the accumulation dtype (fp32, or float64) band by band — whole blocks,
at most ``MergeConfig.tile_bytes`` of float32, so a band stays in cache — into the merge's scratch, quantized
there in place by ``quantize.BlockQuantizer`` (transformers' ``Fp8Quantize`` arithmetic, in the scale format of
the engines' scales: float32, or ue8m0's power-of-two rounding) and cast straight into the bucket; a box cut
inside a block row goes through one reused FP8 buffer of its region. Every block is quantized from its own
values alone, so a widened box, and any band of it, gives exactly the values of the whole tensor's
quantization.

Scales without a second merge: the scales of every region quantized for values are kept (``Fp8Fill._kept``,
1/(bm·bn) of the values' elements) until the scale box that covers them is filled — in the plan the scales
box follows its values box. A scale box not fully covered by kept regions (a delta sending scales alone, a
values box sent by another rank) is merged and quantized again: same values, more time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping

import torch

from protocols.params import Box, box_numel, box_shape
from sync_service.fp8 import scale_name
from sync_service.merge.quantize import FP8_DTYPE, BlockQuantizer

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


def _bands(region: Box, block: tuple[int, int], budget: int) -> Iterator[Box]:
    """``region`` (aligned) cut into aligned sub-boxes of at most ``budget`` elements where a block allows:
    whole trailing slices grouped along the last leading dim, else bands of whole block rows, else one block
    row cut into groups of whole blocks."""
    *lead, (r0, r1), (c0, c1) = region
    bm, bn = block
    per_slice = (r1 - r0) * (c1 - c0)
    if lead and per_slice <= budget:
        (e0, e1), step = lead[-1], max(1, budget // per_slice)
        for outer in itertools.product(*(range(a, b) for a, b in lead[:-1])):
            for e in range(e0, e1, step):
                yield (*((i, i + 1) for i in outer), (e, min(e + step, e1)), (r0, r1), (c0, c1))
        return
    rows = max(1, budget // (bm * (c1 - c0))) * bm
    cols = (c1 - c0) if bm * (c1 - c0) <= budget else max(1, budget // (bm * bn)) * bn
    for outer in itertools.product(*(range(a, b) for a, b in lead)):
        for r in range(r0, r1, rows):
            for c in range(c0, c1, cols):
                yield (*((i, i + 1) for i in outer), (r, min(r + rows, r1)), (c, min(c + cols, c1)))


def _grid_of(box: Box, block: tuple[int, int]) -> Box:
    """The block grid box of an aligned values ``box``."""
    (r0, r1), (c0, c1) = box[-2:]
    return (*box[:-2], (r0 // block[0], r1 // block[0]), (c0 // block[1], c1 // block[1]))


class Fp8Fill:
    """Quantized values and scales of the block-FP8 tensors of one ``MergedSource``.

    Each region is merged and quantized in bands of at most ``tile_bytes`` of float32 (whole blocks): the merge
    writes a band into its reused scratch, ``BlockQuantizer`` scales it there and casts it straight into the
    bucket (or, for a box cut inside a block row, into one reused FP8 buffer of the region). Steady state, a
    fill allocates only the kept scales of its region (1/(bm·bn) of its elements).

    Args:
        blocks: FP8 value name → block ``(bm, bn)`` (``MergeConfig.fp8_blocks``).
        merge: merged values of a box in an accumulation dtype (``MergedSource._merge_box``); the returned
            scratch is overwritten here (scaled in place).
        accumulate: value name → the accumulation dtype of its merge.
        scale_fmt: value name → its ``FineGrainedFP8Config.scale_fmt`` (``"float"`` or ``"ue8m0"``), from the
            dtype the plan sends its scales in.
        tile_bytes: float32 bytes merged and quantized per step (``MergeConfig.tile_bytes``: cache-sized); a
            block row wider than it is one step per group of whole blocks.
    """

    def __init__(self, blocks: Mapping[str, tuple[int, int]], merge: Merge, accumulate: Callable[[str], torch.dtype],
                 scale_fmt: Callable[[str], str], tile_bytes: int = 2 << 20):
        self.blocks = {n: tuple(b) for n, b in blocks.items()}
        self._scale_fmt = scale_fmt
        self.values_of = {scale_name(n): n for n in self.blocks}
        """Scales name → its values' name."""
        self._merge, self._accumulate = merge, accumulate
        self._tile = max(1, tile_bytes // 4)
        self._quantizers: dict[tuple, BlockQuantizer] = {}
        self._f32 = torch.empty(0, dtype=torch.float32)
        self._q = torch.empty(0, dtype=FP8_DTYPE)
        self._kept: dict[str, list[tuple[Box, torch.Tensor]]] = {}
        self._last: tuple[str, Box, torch.Tensor] | None = None

    def fill_values(self, name: str, box: Box, out: torch.Tensor) -> None:
        """FP8 values of ``box`` of ``name`` into ``out`` (``float8_e4m3fn``, ``box_shape(box)``)."""
        region = _widen(box, self.blocks[name])
        if region == box:  # the common case: quantized straight into the bucket
            self._quantize(name, region, out)
            return
        if self._last is None or self._last[:2] != (name, region):  # consecutive pieces of one block row share it
            n = box_numel(region)
            if self._q.numel() < n or self._q.device != out.device:
                self._q = torch.empty(n, dtype=FP8_DTYPE, device=out.device)
            self._last = (name, region, self._q[:n].view(box_shape(region)))
            self._quantize(name, region, self._last[2])
        out.copy_(self._last[2][_rel(box, region)])

    def fill_scales(self, name: str, box: Box, out: torch.Tensor) -> None:
        """Scales (float32 or float8_e8m0fnu) of ``box`` of the scales tensor ``name`` into ``out``: from the kept
        regions when they cover it, else merged and quantized again (scales only)."""
        values = self.values_of[name]
        bm, bn = self.blocks[values]
        region = (*box[:-2], (box[-2][0] * bm, box[-2][1] * bm), (box[-1][0] * bn, box[-1][1] * bn))
        covered = torch.zeros(box_shape(box), dtype=torch.bool)
        kept = self._kept.get(values, [])
        for r, s in kept:
            meet = _meet(r, region)
            if meet is None:
                continue
            blocks = _grid_of(meet, (bm, bn))
            out[_rel(blocks, box)].copy_(s[_rel(blocks, _grid_of(r, (bm, bn)))])
            covered[_rel(blocks, box)] = True
        if not bool(covered.all()):
            self._quantize(values, region, None, scales=out)
        self._kept[values] = [(r, s) for r, s in kept if _meet(r, region) != r]  # fully sent: dropped

    def _quantize(self, name: str, region: Box, q_out: torch.Tensor | None, scales: torch.Tensor | None = None) -> None:
        """Quantize the aligned ``region`` of ``name`` band by band into ``q_out`` (FP8, ``region``'s shape; ``None``:
        scales only) and ``scales`` (its grid; ``None``: a new tensor, kept for the scales box that follows)."""
        block, fmt = self.blocks[name], self._scale_fmt(name)
        quantizer = self._quantizers.get((block, fmt)) or self._quantizers.setdefault((block, fmt), BlockQuantizer(block, fmt))
        grid = _grid_of(region, block)
        if scales is None:
            assert q_out is not None, "scales only into a given grid"
            scales = torch.empty(box_shape(grid), dtype=quantizer.scale_dtype, device=q_out.device)
            self._kept.setdefault(name, []).append((region, scales))
        for band in _bands(region, block, self._tile):
            merged = self._merge(name, band, self._accumulate(name))
            if merged.dtype != torch.float32:  # float64 accumulation: cast once to float32, as transformers
                merged = self._f32_view(merged).copy_(merged)
            quantizer(merged, None if q_out is None else q_out[_rel(band, region)], scales[_rel(_grid_of(band, block), grid)])

    def _f32_view(self, like: torch.Tensor) -> torch.Tensor:
        """A reused float32 buffer of ``like``'s shape, on its device."""
        if self._f32.numel() < like.numel() or self._f32.device != like.device:
            self._f32 = torch.empty(like.numel(), dtype=torch.float32, device=like.device)
        return self._f32[:like.numel()].view(like.shape)
