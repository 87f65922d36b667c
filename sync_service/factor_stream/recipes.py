"""LoRA terms ↔ recipe blocks: what a trainer writes into a bucket and what a receiver rebuilds.

Legend: E experts, r rank, n_e experts of a block. A merge-core ``LoraTerm`` (``sync_service.merge
.adapter``) on a 3D target is cut into blocks of at most ``experts_per_recipe`` experts (aligned to
multiples of it, so a block never straddles two EP ranks of equal size); a 2D term is one block.
Each block travels as one plan entry of kind ``"recipe"`` (``protocols.recipe``): x then y, in the
term's own dtype (fp32, or float64 for a float64 adapter) — or in bf16 when every factor of the
trainer's adapter is bf16 (``factor_wire_dtype``: the merge core's fp32 terms are then widened bf16
values, so the bf16 bytes carry them exactly in half the bytes and the receiver widens them back) —
and in the term's own memory order (a factor the merge core holds transposed travels transposed,
flag ``x_t``/``y_t``), so the receiver rebuilds a term with the same fp32 values *and strides* as the
trainer's and the merge kernel (``addmm_``/``baddbmm_``) takes the same path: the merged values are
bitwise equal.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from protocols.params import DTYPE_BYTES, ParamMeta
from protocols.recipe import Recipe, sel_len
from sync_service.dtypes import TORCH_DTYPES, WIRE_DTYPES
from sync_service.merge.terms import LoraTerm

__all__ = ["TermBuffers", "factor_wire_dtype", "recipes_for_target", "term_dtype", "term_factor_bytes", "write_block",
           "read_block"]

_ITEM_DTYPES = {2: "bfloat16", 4: "float32", 8: "float64"}
"""Bytes per factor element on the wire → its dtype (a 2-byte factor is always bf16, see ``factor_wire_dtype``)."""


def factor_wire_dtype(factors: Iterable[torch.Tensor]) -> str | None:
    """``"bfloat16"`` when every one of the trainer's LoRA factors (as the trainer holds them, before the
    merge core widens them to fp32) is bf16, else ``None`` (ship the terms' own dtype). Widening is
    exact and the merge core only reshapes, concatenates and block-diagonalizes factors, so every term
    value is then a bf16 value: the bf16 wire loses nothing."""
    dtypes = {t.dtype for t in factors}
    return "bfloat16" if dtypes == {torch.bfloat16} else None


def term_dtype(wire: str) -> str:
    """The dtype a receiver rebuilds a term in from factors of wire dtype ``wire`` (the trainer's term
    dtype: fp32, or float64 for a float64 adapter)."""
    return "float64" if wire == "float64" else "float32"


def _transposed(t: torch.Tensor) -> bool:
    """The factor is stored as the transpose of its last two dims (a ``.T`` view of a contiguous tensor)."""
    return not t.is_contiguous() and t.transpose(-1, -2).is_contiguous()


def _wire(t: torch.Tensor, flag: bool) -> torch.Tensor:
    return t.transpose(-1, -2) if flag else t


def recipes_for_target(meta: ParamMeta, terms: Sequence[LoraTerm], *, experts_per_recipe: int,
                       max_block_bytes: int, wire_dtype: str | None = None) -> list[Recipe]:
    """Every recipe block of ``terms`` on target ``meta`` (whole tensor), in term order.

    ``max_block_bytes`` (a bucket) caps a block: blocks shrink below ``experts_per_recipe`` to fit.
    ``wire_dtype``: the factors' dtype on the wire (``factor_wire_dtype``); ``None``: the terms' own.

    Raises:
        ValueError: one expert's (or a 2D term's) factors are larger than ``max_block_bytes``,
            or ``experts_per_recipe < 1``.
    """
    if experts_per_recipe < 1:
        raise ValueError(f"experts_per_recipe={experts_per_recipe} must be >= 1")
    out = []
    for index, term in enumerate(terms):
        item = DTYPE_BYTES[wire_dtype or WIRE_DTYPES[term.x.dtype]]
        x_t, y_t = _transposed(term.x), _transposed(term.y)
        r = term.x.shape[-1]
        per_expert = (sel_len(term.rows) + sel_len(term.cols)) * r * item
        if per_expert > max_block_bytes:
            raise ValueError(f"{meta.name}: the factors of one expert of LoRA term {index} take {per_expert} bytes, "
                             f"more than a bucket ({max_block_bytes}); raise bucket_bytes or stream {meta.name} merged")
        base = dict(target=meta.name, target_dtype=meta.dtype, target_shape=tuple(meta.shape), term=index,
                    rows=tuple(term.rows), cols=tuple(term.cols), rank=r, scaling=float(term.scaling), x_at=0,
                    x_t=x_t, y_t=y_t)
        if term.experts is None:
            out.append(Recipe(term_experts=None, experts=None, y_at=sel_len(term.rows) * r * item, **base))
            continue
        block = max(1, min(experts_per_recipe, max_block_bytes // per_expert))
        e0, e1 = term.experts
        starts = [e0] + list(range((e0 // block + 1) * block, e1, block))
        for a, b in zip(starts, starts[1:] + [e1]):
            out.append(Recipe(term_experts=(e0, e1), experts=(a, b), y_at=(b - a) * sel_len(term.rows) * r * item, **base))
    return out


def factor_dtype_of(recipe: Recipe) -> str:
    """Wire dtype of a recipe's factors, from its layout (``y_at`` = numel(x) · itemsize): bf16 (see
    ``factor_wire_dtype``), or the merge-core terms' fp32 / float64 (``adapter_keys._acc``)."""
    return _ITEM_DTYPES[recipe.y_at // math.prod(recipe.x_shape())]


def term_factor_bytes(terms: Sequence[LoraTerm]) -> int:
    """Bytes of every factor of ``terms`` as they travel (x and y, all experts)."""
    return sum(t.x.numel() * t.x.element_size() + t.y.numel() * t.y.element_size() for t in terms)


def _block(term: LoraTerm, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    if recipe.experts is None:
        return term.x, term.y
    sl = slice(recipe.experts[0] - term.experts[0], recipe.experts[1] - term.experts[0])
    return term.x[sl], term.y[sl]


def write_block(term: LoraTerm, recipe: Recipe, out: torch.Tensor) -> None:
    """Write the block's x then y into ``out`` (flat, the entry's dtype, ``recipe.numel()`` elements)."""
    x, y = _block(term, recipe)
    nx = x.numel()
    out[:nx].view(_wire(x, recipe.x_t).shape).copy_(_wire(x, recipe.x_t))
    out[nx:].view(_wire(y, recipe.y_t).shape).copy_(_wire(y, recipe.y_t))


def read_block(recipe: Recipe, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of x and y *in wire order* (transposed where flagged) into ``data`` (flat); no copy."""
    xs, ys = recipe.x_shape(), recipe.y_shape()
    nx = math.prod(xs)
    return data[:nx].view(_wire_shape(xs, recipe.x_t)), data[nx:].view(_wire_shape(ys, recipe.y_t))


def _wire_shape(shape: tuple[int, ...], flag: bool) -> tuple[int, ...]:
    return shape[:-2] + (shape[-1], shape[-2]) if flag else shape


@dataclass(slots=True)
class TermBuffers:
    """One whole term held by a receiver: x and y in wire order, and which expert blocks are filled.

    Attributes:
        first: a recipe of the term (selections, rank, scaling, flags, whole expert range).
        xw, yw: wire-order buffers of the whole term ([E_term, ...] for a 3D target).
        filled: expert blocks ``(e0, e1)`` written so far (``None`` for a 2D term).
    """

    first: Recipe
    xw: torch.Tensor
    yw: torch.Tensor
    filled: set

    @classmethod
    def empty(cls, recipe: Recipe, dtype: str, device: torch.device | str = "cpu") -> "TermBuffers":
        whole = recipe
        if recipe.experts is not None:
            from dataclasses import replace

            whole = replace(recipe, experts=recipe.term_experts)
        torch_dtype = TORCH_DTYPES[dtype]
        xw = torch.empty(_wire_shape(whole.x_shape(), recipe.x_t), dtype=torch_dtype, device=device)
        yw = torch.empty(_wire_shape(whole.y_shape(), recipe.y_t), dtype=torch_dtype, device=device)
        return cls(first=recipe, xw=xw, yw=yw, filled=set())

    def clone(self) -> "TermBuffers":
        return TermBuffers(first=self.first, xw=self.xw.clone(), yw=self.yw.clone(), filled=set(self.filled))

    def put(self, recipe: Recipe, data: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Copy one block (``data``: the entry's flat view) into the buffers. Returns ``(handed, stored)`` for x and
        y: the block's views of ``data`` and where they were copied (the served check compares them)."""
        x, y = read_block(recipe, data)
        if recipe.experts is None:
            xs, ys = self.xw, self.yw
        else:
            e0 = recipe.experts[0] - recipe.term_experts[0]
            e1 = recipe.experts[1] - recipe.term_experts[0]
            xs, ys = self.xw[e0:e1], self.yw[e0:e1]
        xs.copy_(x)
        ys.copy_(y)
        self.filled.add(recipe.experts)
        return (x, xs), (y, ys)

    def complete(self, blocks: Sequence[tuple[int, int] | None]) -> bool:
        return set(blocks) <= self.filled

    def nbytes(self) -> int:
        return self.xw.numel() * self.xw.element_size() + self.yw.numel() * self.yw.element_size()

    def term(self) -> LoraTerm:
        """The merge-core term (views of the buffers, same strides as the trainer's)."""
        r = self.first
        return LoraTerm(r.term_experts, r.rows, r.cols, _wire(self.xw, r.x_t), _wire(self.yw, r.y_t), r.scaling)


def terms_by_target(recipes: Sequence[Recipe]) -> Mapping[str, dict[int, list[Recipe]]]:
    """target → term index → its recipe blocks (in plan order)."""
    out: dict[str, dict[int, list[Recipe]]] = {}
    for r in recipes:
        out.setdefault(r.target, {}).setdefault(r.term, []).append(r)
    return out
