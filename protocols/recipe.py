"""The merge recipe of a ``PlanEntry`` of kind ``"recipe"``: one LoRA term block merged on the receiver.

In factor streaming the trainer ships the low-rank factors of a term instead of the merged tensor,
and the rollout engine computes ``W = W0 + s · x @ y`` itself over a resident pristine copy of W0
(``sync_service/factor_stream``). A recipe entry's bytes are the factors of one expert block of one term:

    entry.offset + x_at : x, ``x_shape`` row-major, entry dtype   (x_t: the bytes are xᵀ of the last two dims)
    entry.offset + y_at : y, ``y_shape`` row-major, entry dtype   (y_t likewise)

with ``x_shape = [n_e, n_rows, rank]`` / ``y_shape = [n_e, rank, n_cols]`` for a 3D target
(``n_e = experts[1] - experts[0]``) and ``[n_rows, rank]`` / ``[rank, n_cols]`` for a 2D target.
The entry itself is a flat box ``((0, n),)`` of ``n = numel(x) + numel(y)`` elements, so plans pack
and subset it like any tensor entry. Row and column selections are ``(start, stop, step)`` on the
target's last two dims, as the merge core's ``LoraTerm`` holds them (gate/up order, interleaving,
orientation and TP slices are all expressed by them).

Legend: E experts, r rank, s scaling. Sources: LoRA ΔW = s·B@A (Hu et al. 2021, arXiv:2106.09685).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Sel = tuple[int, int, int]
"""``(start, stop, step)`` as ``range`` takes them; ``step >= 1``."""

RECIPE_SEPARATOR = "@lora"
"""Recipe entry names are ``<target>@lora<term>`` or ``<target>@lora<term>:e<e0>-<e1>``."""


def sel_len(sel: Sel) -> int:
    return len(range(*sel))


@dataclass(frozen=True, slots=True)
class Recipe:
    """One expert block of one LoRA term of an engine tensor.

    Attributes:
        target: engine tensor name the term adds to (hf-fused naming).
        target_dtype: wire dtype of the target (the merge casts into it once).
        target_shape: shape of the whole target tensor (2D or 3D).
        term: index of the term among the target's terms (terms are added in this order).
        term_experts: ``(e0, e1)`` expert range of the whole term (3D), ``None`` for a 2D target.
        experts: ``(e0, e1)`` expert block carried by this entry, inside ``term_experts``; ``None`` (2D).
        rows, cols: selections on the target's second-to-last and last dims.
        rank: r, the inner dim of x @ y.
        scaling: s.
        x_at, y_at: byte offsets of x and y from the entry's offset (``x_at = 0``, ``y_at`` = bytes of x).
        x_t, y_t: the factor travels transposed in its last two dims (kept so the receiver holds
            the same strides as the trainer: the GEMM then runs the same kernel path).
    """

    target: str
    target_dtype: str
    target_shape: tuple[int, ...]
    term: int
    term_experts: tuple[int, int] | None
    experts: tuple[int, int] | None
    rows: Sel
    cols: Sel
    rank: int
    scaling: float
    x_at: int
    y_at: int
    x_t: bool = False
    y_t: bool = False

    @property
    def num_experts(self) -> int:
        return 1 if self.experts is None else self.experts[1] - self.experts[0]

    def x_shape(self) -> tuple[int, ...]:
        lead = () if self.experts is None else (self.num_experts,)
        return lead + (sel_len(self.rows), self.rank)

    def y_shape(self) -> tuple[int, ...]:
        lead = () if self.experts is None else (self.num_experts,)
        return lead + (self.rank, sel_len(self.cols))

    def numel(self) -> int:
        return math.prod(self.x_shape()) + math.prod(self.y_shape())

    def entry_name(self) -> str:
        return recipe_name(self.target, self.term, self.experts)


def recipe_name(target: str, term: int, experts: tuple[int, int] | None) -> str:
    """The plan entry name of a recipe block (unique per target, term and block)."""
    block = "" if experts is None else f":e{experts[0]}-{experts[1]}"
    return f"{target}{RECIPE_SEPARATOR}{term}{block}"


def recipe_list(r: Recipe) -> list:
    """msgpack form: a flat list in field order (tuples as lists, ``None`` kept)."""
    return [r.target, r.target_dtype, list(r.target_shape), r.term,
            None if r.term_experts is None else list(r.term_experts),
            None if r.experts is None else list(r.experts), list(r.rows), list(r.cols), r.rank,
            float(r.scaling), r.x_at, r.y_at, r.x_t, r.y_t]


def recipe_from_list(v: list) -> Recipe:
    """Inverse of ``recipe_list`` for trusted, already validated values (between own processes);
    data from the wire goes through ``protocols.recipe_check.check_recipe`` instead."""
    pair = lambda p: None if p is None else (p[0], p[1])  # noqa: E731
    return Recipe(target=v[0], target_dtype=v[1], target_shape=tuple(v[2]), term=v[3], term_experts=pair(v[4]),
                  experts=pair(v[5]), rows=tuple(v[6]), cols=tuple(v[7]), rank=v[8], scaling=v[9], x_at=v[10],
                  y_at=v[11], x_t=v[12], y_t=v[13])
