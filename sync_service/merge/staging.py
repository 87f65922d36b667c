"""fp32 scratch and the merge kernel: base box → scratch → + Σ s·x@y → one cast into ``out``.

The scratch is allocated once (grown at most up to the budget) and reused: first-touch
allocation runs at ~3 GB/s, copies into touched memory at ~20 GB/s (DESIGN.md, measured).
A box larger than the budget is cut into chunks along its leading dims (experts first, then rows,
then columns), so no step holds a whole fused [E, 2I, H] fp32 temporary.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

import torch

from protocols.params import Box, box_shape
from sync_service.merge.adapter import LoraTerm, Sel

_FP32_BYTES = 4


class Scratch:
    """One reusable accumulation buffer of at most ``budget_bytes``; records the peak bytes handed out.

    fp32 (float64 for a float64 base, so an exact base is not rounded through fp32)."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.peak_bytes = 0
        self._buf: torch.Tensor | None = None

    def view(self, shape: Sequence[int], device: torch.device, base_dtype: torch.dtype) -> torch.Tensor:
        dtype = torch.float64 if base_dtype == torch.float64 else torch.float32
        nbytes = math.prod(shape) * dtype.itemsize
        assert nbytes <= self.budget_bytes, "chunking must respect the staging budget"
        if self._buf is None or self._buf.numel() < nbytes or self._buf.device != device:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.peak_bytes = max(self.peak_bytes, nbytes)
        return self._buf[:nbytes].view(dtype).view(tuple(shape))


def chunks(box: Box, budget_bytes: int, itemsize: int = _FP32_BYTES) -> Iterator[Box]:
    """Cut ``box`` into row-major sub-boxes of at most ``budget_bytes`` of ``itemsize``-byte elements."""
    shape = box_shape(box)
    budget = max(1, budget_bytes // itemsize)
    if math.prod(shape) <= budget:
        yield box
        return
    dim = 0
    while math.prod(shape[dim + 1:]) > budget:
        dim += 1
    step = max(1, budget // math.prod(shape[dim + 1:]))
    outer = [range(a, b) for a, b in box[:dim]]
    a, b = box[dim]
    for idx in itertools.product(*outer):
        for start in range(a, b, step):
            yield tuple((i, i + 1) for i in idx) + ((start, min(b, start + step)),) + tuple(box[dim + 1:])


def _intersect(sel: Sel, lo: int, hi: int) -> tuple[slice, slice] | None:
    """Selection ∩ [lo, hi) → (slice into the factor, slice local to [lo, hi)), or ``None``."""
    start, stop, step = sel
    k_lo = max(0, -(-(lo - start) // step))
    k_hi = max(0, -(-(min(hi, stop) - start) // step))
    if k_lo >= k_hi:
        return None
    first = start + k_lo * step - lo
    return slice(k_lo, k_hi), slice(first, first + (k_hi - k_lo - 1) * step + 1, step)


def apply_terms(scratch: torch.Tensor, box: Box, terms: Sequence[LoraTerm]) -> None:
    """``scratch`` (fp32, shape ``box_shape(box)``) += every term's part inside ``box``, in place.

    Fused ops only (``addmm_`` / ``baddbmm_``): no temporary the size of the box.
    """
    for term in terms:
        rows = _intersect(term.rows, *box[-2])
        cols = _intersect(term.cols, *box[-1])
        if rows is None or cols is None:
            continue
        (xr, lr), (yc, lc) = rows, cols
        if term.experts is None:
            view = scratch[lr, lc]
            view.addmm_(_as(term.x[xr], view), _as(term.y[:, yc], view), alpha=term.scaling)
            continue
        e0, e1 = max(term.experts[0], box[0][0]), min(term.experts[1], box[0][1])
        if e0 >= e1:
            continue
        te = slice(e0 - term.experts[0], e1 - term.experts[0])
        view = scratch[e0 - box[0][0]: e1 - box[0][0], lr, lc]
        view.baddbmm_(_as(term.x[te, xr], view), _as(term.y[te, :, yc], view), alpha=term.scaling)


def _as(factor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return factor.to(device=like.device, dtype=like.dtype)
