"""fp32 scratch and the merge kernel: base box → scratch → + Σ s·x@y → one cast into ``out``.

The scratch is allocated once (grown at most up to the budget) and reused: first-touch
allocation runs at ~3 GB/s, copies into touched memory at ~20 GB/s (DESIGN.md, measured).
A box is cut into tiles along its leading dims (experts first, then rows, then columns) of at most
``MergeConfig.tile_bytes`` under the ``staging_bytes`` budget, so no step holds a whole fused [E, 2I, H]
fp32 temporary. The tile size is the device's (``tile_bytes_for``): on a CPU cache-sized (2 MiB), so each
tile's cast-in / add / cast-out passes run in cache; on a GPU the whole staging budget, so a tile is whole
expert blocks and a 600 MB expert tensor is ~10 tiles of a few kernel launches each instead of ~300 launch-bound
ones (a GPU's L2 holds no useful tile; its cost is the launches). Tiles that no term touches skip the scratch
(one cast, same values). The values are bitwise the same at every tile size.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

import torch

from protocols.params import Box, box_shape
from sync_service.merge.terms import LoraTerm, Sel

_FP32_BYTES = 4

TILE_BYTES: dict[str, int | None] = {"cpu": 2 << 20, "cuda": None}
"""Device type → merge tile, bytes of the accumulation dtype (``None``: the whole staging budget). CPU: 2 MiB,
measured (docs/benchmarks.md, Merge); CUDA: the budget (whole expert blocks; unmeasured until a GPU run)."""


def tile_bytes_for(device: torch.device | str, staging_bytes: int, configured: int | None = None) -> int:
    """The merge tile for ``device``, bytes: ``configured`` (``MergeConfig.tile_bytes``) when given, else the
    device's ``TILE_BYTES``; never above ``staging_bytes``. An unknown device type takes the CPU's."""
    kind = torch.device(device).type
    tile = configured if configured is not None else TILE_BYTES.get(kind, TILE_BYTES["cpu"])
    return min(staging_bytes if tile is None else tile, staging_bytes)


class Scratch:
    """One reusable accumulation buffer of at most ``budget_bytes``; records the peak bytes handed out.

    Its dtype is the caller's accumulation dtype (``MergeConfig.accumulate_dtype``; float64 for a float64 base)."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.peak_bytes = 0
        self._buf: torch.Tensor | None = None
        self._views: dict[tuple, torch.Tensor] = {}  # (shape, dtype) → view of _buf; tiles repeat shapes

    def view(self, shape: Sequence[int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """A ``dtype`` view of ``shape`` into the buffer (valid until the next call)."""
        key = (tuple(shape), dtype)
        cached = self._views.get(key)
        if cached is not None and cached.device == device:
            return cached
        nbytes = math.prod(shape) * dtype.itemsize
        assert nbytes <= self.budget_bytes, "chunking must respect the staging budget"
        if self._buf is None or self._buf.numel() < nbytes or self._buf.device != device:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._views.clear()
        self.peak_bytes = max(self.peak_bytes, nbytes)
        view = self._buf[:nbytes].view(dtype).view(key[0])
        if len(self._views) < 64:
            self._views[key] = view
        return view


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


Part = tuple[tuple[slice, ...], torch.Tensor, torch.Tensor, float]
"""One term's share of a box: (index into the box's scratch, x view, y view, scaling)."""


def term_parts(terms: Sequence[LoraTerm], box: Box) -> list[Part]:
    """The share of every term inside ``box`` (empty: no term touches ``box``)."""
    parts = []
    for term in terms:
        if term.experts is not None and (term.experts[1] <= box[0][0] or box[0][1] <= term.experts[0]):
            continue
        rows = _intersect(term.rows, *box[-2])
        cols = _intersect(term.cols, *box[-1])
        if rows is None or cols is None:
            continue
        (xr, lr), (yc, lc) = rows, cols
        if term.experts is None:
            parts.append(((lr, lc), term.x[xr], term.y[:, yc], term.scaling))
            continue
        e0, e1 = max(term.experts[0], box[0][0]), min(term.experts[1], box[0][1])
        te = slice(e0 - term.experts[0], e1 - term.experts[0])
        parts.append(((slice(e0 - box[0][0], e1 - box[0][0]), lr, lc), term.x[te, xr], term.y[te, :, yc], term.scaling))
    return parts


def apply_parts(scratch: torch.Tensor, parts: Sequence[Part]) -> None:
    """``scratch`` += s · x @ y for every part, in place: fused ``addmm_`` / ``baddbmm_``, no temporary."""
    for index, x, y, scaling in parts:
        view = scratch[index]
        if view.dim() == 2:
            view.addmm_(_as(x, view), _as(y, view), alpha=scaling)
        else:
            view.baddbmm_(_as(x, view), _as(y, view), alpha=scaling)


def apply_terms(scratch: torch.Tensor, box: Box, terms: Sequence[LoraTerm]) -> None:
    """``scratch`` (fp32, shape ``box_shape(box)``) += every term's part inside ``box``, in place."""
    apply_parts(scratch, term_parts(terms, box))


def _as(factor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if factor.dtype == like.dtype and factor.device == like.device:
        return factor
    return factor.to(device=like.device, dtype=like.dtype)
