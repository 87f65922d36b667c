"""Block FP8 (e4m3) quantization of merged weights, with transformers' arithmetic bit for bit.

Format (DeepSeek-V3 / Qwen3-*-FP8, transformers ``FineGrainedFP8Config``): a weight ``[.., N, K]`` is cut
into blocks ``[bm, bn]`` over its last two dims; each block is stored as ``float8_e4m3fn`` values ``q`` and
one ``weight_scale_inv`` ``s`` (``[.., N / bm, K / bn]``), dequantized as ``q × s``.

Source of the arithmetic: ``transformers.integrations.finegrained_fp8.Fp8Quantize._quantize_one``
(transformers 5.19). ``quantize_blocks`` runs its torch operations in the same order on the same dtypes:

    x      = values.to(float32)
    amax   = |x|.amax over each block
    scale  = 448 / where(amax > 0, amax, 1);  scale = where(amax > 0, scale, 1)   (a zero block: scale 1)
    s      = (1.0 / scale).to(float32)                                            (not amax / 448: differs in ulps)
    ue8m0: s = 2 ** ceil(log2(max(s, tiny32)));  stored as float8_e8m0fnu;  scale = 1 / s
    q      = clamp(x × scale, -448, 448).to(float8_e4m3fn)

so a merged tensor equal to the reference's float32 tensor gives equal bytes and scales. Other FP8
quantizers differ (vLLM's ``per_block_cast_to_fp8`` clamps amax at 1e-4; verl / slime add eps 1e-10).

Boxes: every block is quantized on its own values alone, so ``quantize_blocks`` of a box of a tensor whose
last-two-dim offsets and extents are multiples of the block (``box_aligned``) gives exactly the values of
the same box of the whole result, and the scales of the block box ``[.., r0/bm : r1/bm, c0/bn : c1/bn]``.
Leading dims (experts) may be cut anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0, as transformers' _FP8_MAX
FP8_MIN = torch.finfo(FP8_DTYPE).min
SCALE_FMTS = ("float", "ue8m0")
"""``FineGrainedFP8Config.scale_fmt`` values: float32 scales, or power-of-two ``float8_e8m0fnu`` scales."""

__all__ = ["FP8_DTYPE", "SCALE_FMTS", "BlockQuantizer", "Dequantizer", "box_aligned", "dequantize_blocks", "divides", "quantize_blocks", "scale_dtype", "scale_name",
           "scale_shape"]


def scale_dtype(scale_fmt: str) -> torch.dtype:
    """dtype of ``weight_scale_inv``: float32 for ``"float"``, ``torch.float8_e8m0fnu`` for ``"ue8m0"``
    (what transformers' quantizer writes; both checked against its ``save_pretrained``)."""
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt {scale_fmt!r}: use one of {', '.join(SCALE_FMTS)}")
    return torch.float32 if scale_fmt == "float" else torch.float8_e8m0fnu


def scale_name(key: str) -> str:
    """Name of the scales of weight ``key``, transformers' rule: ``X.weight`` → ``X.weight_scale_inv``,
    any other name (a fused expert parameter ``experts.gate_up_proj``) → ``<key>_scale_inv``."""
    return key.rsplit(".", 1)[0] + ".weight_scale_inv" if key.endswith(".weight") else key + "_scale_inv"


def divides(shape: Sequence[int], block: tuple[int, int]) -> bool:
    """Whether a tensor of ``shape`` is quantized at all: at least 2D, last two dims multiples of the block
    (transformers passes every other tensor through unquantized)."""
    return len(shape) >= 2 and shape[-2] % block[0] == 0 and shape[-1] % block[1] == 0


def box_aligned(box: Sequence[tuple[int, int]], block: tuple[int, int]) -> bool:
    """Whether ``box`` (``(start, stop)`` per dim) starts and ends on block edges in its last two dims."""
    return len(box) >= 2 and all(a % b == 0 and c % b == 0 for (a, c), b in zip(box[-2:], block))


def scale_shape(shape: Sequence[int], block: tuple[int, int]) -> tuple[int, ...]:
    """Shape of the scales of a quantized ``shape``: ``[.., N / bm, K / bn]``."""
    return (*shape[:-2], shape[-2] // block[0], shape[-1] // block[1])


def quantize_blocks(values: torch.Tensor, block: tuple[int, int], scale_fmt: str = "float") -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize ``values`` ``[.., N, K]`` (float32 or float64; a float64 input is cast once to float32
    first, as transformers casts) into ``(q, s)``: ``q`` float8_e4m3fn of ``values``' shape, ``s`` the
    ``weight_scale_inv`` ``[.., N / bm, K / bn]`` in ``scale_dtype(scale_fmt)``. New tensors, on ``values``'
    device; ``values`` is only read. Transient memory: one float32 copy of ``values``
    (``BlockQuantizer`` quantizes into caller-owned buffers without it).

    Raises:
        ValueError: ``values`` is not floating or under 2D, the last two dims are not multiples of ``block``
            (check ``divides`` first: such tensors stay unquantized), or an unknown ``scale_fmt``.
    """
    if not values.is_floating_point() or not divides(values.shape, block):
        raise ValueError(f"quantize_blocks needs a floating [.., N, K] tensor with N % {block[0]} == 0 and "
                         f"K % {block[1]} == 0; got {values.dtype}{list(values.shape)}")
    quantizer = BlockQuantizer(block, scale_fmt)
    x = values.to(torch.float32, copy=True)
    q = torch.empty(values.shape, dtype=FP8_DTYPE, device=values.device)
    s = torch.empty(scale_shape(values.shape, block), dtype=quantizer.scale_dtype, device=values.device)
    quantizer(x, q, s)
    return q, s


class BlockQuantizer:
    """``quantize_blocks`` in place: transformers' ``Fp8Quantize`` operations, each written into a buffer.

    The per-block grids (amax, scales) live in one float32 buffer grown to the largest call's grid and reused;
    the values are scaled and clamped in the caller's float32 tensor and cast once into the caller's FP8 view
    (a bucket), so a steady-state call allocates nothing. Bitwise ``quantize_blocks`` / ``Fp8Quantize``: the
    same elementwise operations in the same dtypes and order. ``a / t`` of a Python number is
    ``t.reciprocal() * a`` in torch (``Tensor.__rdiv__``), so the scales are ``reciprocal`` then ``mul_``;
    the block amax of ``|x|`` is ``max(amax(x), -amin(x))``, the same float (no arithmetic on values).

    Args:
        block: ``(bm, bn)``.
        scale_fmt: ``"float"`` or ``"ue8m0"`` (``SCALE_FMTS``).

    Raises:
        ValueError: an unknown ``scale_fmt``.
    """

    def __init__(self, block: tuple[int, int], scale_fmt: str = "float"):
        self.block = tuple(block)
        self.scale_fmt = scale_fmt
        self.scale_dtype = scale_dtype(scale_fmt)
        self._grid = torch.empty(0, dtype=torch.float32)
        self._pos = torch.empty(0, dtype=torch.bool)
        self._one = torch.ones((), dtype=torch.float32)

    def _grids(self, shape: tuple[int, ...], device: torch.device) -> list[torch.Tensor]:
        """Views of ``shape`` into the reused grids: float32 amax, scales, inverse scales; bool amax > 0."""
        n = math.prod(shape)
        if self._grid.numel() < 3 * n or self._grid.device != device:
            self._grid = torch.empty(3 * n, dtype=torch.float32, device=device)
            self._pos = torch.empty(n, dtype=torch.bool, device=device)
            self._one = self._one.to(device)
        return [*(self._grid[i * n:(i + 1) * n].view(shape) for i in range(3)), self._pos[:n].view(shape)]

    def __call__(self, x: torch.Tensor, q_out: torch.Tensor | None, s_out: torch.Tensor) -> None:
        """Quantize ``x`` (float32 ``[.., N, K]``, contiguous, N and K multiples of the block) into ``q_out``
        (float8_e4m3fn, ``x``'s shape, any strides; ``None``: scales only) and ``s_out`` (``scale_dtype``,
        ``[.., N / bm, K / bn]``, any strides). ``x`` is overwritten (scaled and clamped); all three on one
        device."""
        bm, bn = self.block
        lead, rows, cols = x.shape[:-2], x.shape[-2], x.shape[-1]
        blocks = x.view(*lead, rows // bm, bm, cols // bn, bn)
        amax, scales, inv, pos = self._grids((*lead, rows // bm, cols // bn), x.device)
        torch.amax(blocks, dim=(-3, -1), out=amax)
        torch.amin(blocks, dim=(-3, -1), out=scales)
        torch.maximum(amax, scales.neg_(), out=amax)  # = |x|.amax over the block
        torch.gt(amax, 0, out=pos)
        torch.where(pos, amax, self._one, out=amax)  # safe amax
        torch.reciprocal(amax, out=scales).mul_(FP8_MAX)  # FP8_MAX / safe
        torch.where(pos, scales, self._one, out=scales)
        torch.reciprocal(scales, out=inv)  # (1.0 / scales), float32 already
        if self.scale_dtype != torch.float32:  # ue8m0: the stored inverse a power of two, the scale its reciprocal
            inv.clamp_(min=torch.finfo(torch.float32).tiny)
            torch.pow(2.0, torch.log2(inv, out=inv).ceil_(), out=inv)
            s_out.copy_(inv)
            torch.reciprocal(inv.copy_(s_out), out=scales)
        else:
            s_out.copy_(inv)
        blocks.mul_(scales.unsqueeze(-1).unsqueeze(-3)).clamp_(min=FP8_MIN, max=FP8_MAX)
        if q_out is not None:
            q_out.copy_(x)


DEQUANTIZE_CHUNK = 1 << 19
"""Elements dequantized per step of ``dequantize_blocks`` (its float32 work buffer: 2 MiB, cache-sized)."""


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` (float8_e4m3fn ``[.., N, K]``) × its block ``scales`` (``[.., N/bm, K/bn]``) in ``dtype``: the
    operations of transformers' ``Fp8Dequantize._dequantize_one`` in order (both to float32, one product per
    element, one cast), so bitwise what ``FineGrainedFP8Config(dequantize=True)`` loads. Written into ``out``
    (contiguous, ``q``'s shape, ``dtype``; reused across syncs) or a new tensor; ``Dequantizer`` with a work
    buffer of its own. Returns ``out``."""
    return Dequantizer()(q, scales, dtype, out)


class Dequantizer:
    """``dequantize_blocks`` over reused buffers (grown to the largest step; a long-lived engine keeps one, so a
    sync allocates nothing): a group of block rows of at most ``DEQUANTIZE_CHUNK`` elements (at least one block
    row) at a time is converted to float32 into a work buffer, scaled in place and cast into ``out`` (a float32
    ``out`` is its own work buffer). The FP8 → float32 conversion is a lookup in a 256-entry table built by that
    very cast of every byte (``index_select``: bitwise the cast, ~3x faster than torch's CPU cast)."""

    def __init__(self):
        self._work = torch.empty(0, dtype=torch.float32)
        self._index = torch.empty(0, dtype=torch.int32)
        self._table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).to(torch.float32)

    def __call__(self, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """As ``dequantize_blocks``."""
        rows, cols = q.shape[-2:]
        scale_rows, scale_cols = scales.shape[-2:]
        if out is None:
            out = torch.empty(q.shape, dtype=dtype, device=q.device)
        qv = q.reshape(-1, rows // scale_rows, scale_cols, cols // scale_cols)  # one block row per index
        sv = scales.reshape(-1, 1, scale_cols, 1)
        ov = out.view(qv.shape)
        step = max(1, DEQUANTIZE_CHUNK // (qv[0].numel() or 1))
        for i in range(0, qv.shape[0], step):
            o = ov[i:i + step]
            w = o if dtype == torch.float32 else self._buffers(o.numel(), q.device)[0].view(o.shape)
            self._to_float32(qv[i:i + step], w).mul_(sv[i:i + step].to(torch.float32))
            if w is not o:
                o.copy_(w)
        return out

    def _to_float32(self, q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``w.copy_(q)`` (FP8 → float32) by table lookup; ``w`` contiguous."""
        index = self._buffers(q.numel(), q.device)[1]
        index.copy_(q.reshape(-1).view(torch.uint8))
        torch.index_select(self._table, 0, index, out=w.view(-1))
        return w

    def _buffers(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._work.numel() < n or self._work.device != device:
            self._work = torch.empty(n, dtype=torch.float32, device=device)
            self._index = torch.empty(n, dtype=torch.int32, device=device)
            self._table = self._table.to(device)
        return self._work[:n], self._index[:n]
