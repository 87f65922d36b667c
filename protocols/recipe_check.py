"""Validation of a decoded recipe (``protocols.recipe``): types, bounds, sizes, consistency with its entry.

Raises only ``ProtocolError`` naming the field (``header.entries[3].recipe.rows``).
"""

from __future__ import annotations

import math
from typing import Any

from protocols.params import DTYPE_BYTES, MERGE_DTYPES, Box
from protocols.recipe import Recipe, recipe_name, sel_len
from protocols.wire import I63_MAX, MAX_NAME_CHARS, ProtocolError

MAX_TERMS = 1 << 16
MAX_RANK = 1 << 16
RECIPE_ITEMS = 14


def _int(v: Any, field: str, lo: int = 0, hi: int = I63_MAX) -> int:
    if type(v) is not int:
        raise ProtocolError(field, f"expected int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ProtocolError(field, f"{v} outside [{lo}, {hi}]")
    return v


def _list(v: Any, field: str, n: int | None = None) -> list:
    if type(v) is not list:
        raise ProtocolError(field, f"expected array, got {type(v).__name__}")
    if n is not None and len(v) != n:
        raise ProtocolError(field, f"expected {n} items, got {len(v)}")
    return v


def _bool(v: Any, field: str) -> bool:
    if type(v) is not bool:
        raise ProtocolError(field, f"expected bool, got {type(v).__name__}")
    return v


def _float_dtype(v: Any, field: str) -> str:
    if type(v) is not str or v not in MERGE_DTYPES:
        raise ProtocolError(field, f"{v!r} is not a floating dtype; use one of {sorted(MERGE_DTYPES)}")
    return v


def _sel(v: Any, field: str, dim: int) -> tuple[int, int, int]:
    start, stop, step = _list(v, field, 3)
    start = _int(start, f"{field}.start", 0, dim)
    stop = _int(stop, f"{field}.stop", start, dim)
    step = _int(step, f"{field}.step", 1, max(dim, 1))
    if sel_len((start, stop, step)) == 0:
        raise ProtocolError(field, f"selection ({start}, {stop}, {step}) is empty")
    return start, stop, step


def _range(v: Any, field: str, lo: int, hi: int) -> tuple[int, int]:
    a, b = _list(v, field, 2)
    a = _int(a, f"{field}.start", lo, hi)
    b = _int(b, f"{field}.stop", a + 1, hi)
    return a, b


def check_recipe(raw: Any, field: str, *, name: str, dtype: str, shape: tuple[int, ...], box: Box) -> Recipe:
    """Decode and validate one recipe against its entry (``name``, ``dtype``, flat ``shape``/``box``).

    Raises:
        ProtocolError: a bad type, an out-of-bounds selection or expert range, sizes that do not add
            up to the entry's elements, or an entry name that is not the recipe's own.
    """
    items = _list(raw, field, RECIPE_ITEMS)
    target, target_dtype, tshape_raw, term, term_experts, experts, rows, cols, rank, scaling, x_at, y_at, x_t, y_t = items
    if type(target) is not str or not 0 < len(target) <= MAX_NAME_CHARS:
        raise ProtocolError(f"{field}.target", f"expected a name of 1..{MAX_NAME_CHARS} chars")
    target_dtype = _float_dtype(target_dtype, f"{field}.target_dtype")
    tshape = tuple(_int(d, f"{field}.target_shape[{i}]", 1) for i, d in enumerate(_list(tshape_raw, f"{field}.target_shape")))
    if len(tshape) not in (2, 3):
        raise ProtocolError(f"{field}.target_shape", f"a LoRA target is 2D or 3D, got {len(tshape)} dims")
    term = _int(term, f"{field}.term", 0, MAX_TERMS)
    if len(tshape) == 3:
        if term_experts is None or experts is None:
            raise ProtocolError(f"{field}.experts", "a 3D target needs term_experts and experts ranges")
        term_experts = _range(term_experts, f"{field}.term_experts", 0, tshape[0])
        experts = _range(experts, f"{field}.experts", term_experts[0], term_experts[1])
    elif term_experts is not None or experts is not None:
        raise ProtocolError(f"{field}.experts", "a 2D target has no expert range (expected nil)")
    rows = _sel(rows, f"{field}.rows", tshape[-2])
    cols = _sel(cols, f"{field}.cols", tshape[-1])
    rank = _int(rank, f"{field}.rank", 1, MAX_RANK)
    if type(scaling) is not float or not math.isfinite(scaling):
        raise ProtocolError(f"{field}.scaling", f"expected a finite float, got {scaling!r}")
    recipe = Recipe(target=target, target_dtype=target_dtype, target_shape=tshape, term=term,
                    term_experts=term_experts, experts=experts, rows=rows, cols=cols, rank=rank, scaling=scaling,
                    x_at=_int(x_at, f"{field}.x_at"), y_at=_int(y_at, f"{field}.y_at"),
                    x_t=_bool(x_t, f"{field}.x_t"), y_t=_bool(y_t, f"{field}.y_t"))
    _check_sizes(recipe, field, name=name, dtype=dtype, shape=shape, box=box)
    return recipe


def _check_sizes(r: Recipe, field: str, *, name: str, dtype: str, shape: tuple[int, ...], box: Box) -> None:
    _float_dtype(dtype, f"{field}.dtype")
    n = r.numel()
    if shape != (n,) or box != ((0, n),):
        raise ProtocolError(f"{field}.size", f"entry shape {shape} box {box} != the recipe's {n} factor elements")
    x_bytes = math.prod(r.x_shape()) * DTYPE_BYTES[dtype]
    if r.x_at != 0 or r.y_at != x_bytes:
        raise ProtocolError(f"{field}.y_at", f"x at {r.x_at}, y at {r.y_at}: expected 0 and {x_bytes} (x, then y)")
    if name != r.entry_name():
        raise ProtocolError(f"{field}.target", f"entry name {name!r} != recipe name {r.entry_name()!r}")
