"""Which global boxes of each tensor a trainer rank holds under expert / tensor parallelism.

Shape legend: E experts (global), E_local = E / ep experts per EP rank, H hidden, I expert
intermediate, tp TP size. Names are the transformers v5 in-memory ("hf-fused") names.

- Expert parallel (as Megatron / torchtitan / vLLM): rank ``ep_rank`` holds the contiguous expert
  block ``[ep_rank·E_local, (ep_rank+1)·E_local)``; global expert id = ep_rank·E_local + i.
- Tensor parallel (Megatron column/row parallel): column-parallel weights split dim 0 (out),
  row-parallel weights split dim 1 (in). Fused ``experts.gate_up_proj`` [E, 2I, H] is split per
  half: TP rank t holds ``[gate_shard_t; up_shard_t]`` = global rows ``[t·I/tp, (t+1)·I/tp)`` and
  ``[I + t·I/tp, I + (t+1)·I/tp)`` stacked (Megatron ``linear_fc1``, vLLM ``w13``), not ``[G; U]``.
  ``experts.down_proj`` [E, H, I] splits its I dim (dim 2). Families stored ``in_out`` (gpt_oss, llama4:
  ``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H]; the layout row's ``orientation``) split the same
  dims where they sit: the 2I dim 2 and the I dim 1; interleaved gate/up columns (gpt_oss) split in plain
  contiguous blocks, so each rank holds whole (gate, up) column pairs (``EXPERT_TP_RULES``).
- Everything else is replicated; a replicated tensor (or a tensor replicated along one mesh axis) is
  produced only by the ranks whose coordinate on that axis is 0, so nothing is sent twice.

Rank order: rank = ep_rank · tp + tp_rank (TP innermost, as Megatron orders its groups).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from protocols.params import Box, ParamMeta
from sync_service.merge.layouts import expert_names

__all__ = ["Piece", "ShardSpec", "SHARD_RULES", "shard_pieces", "owns", "local_shape"]


@dataclass(kw_only=True, slots=True, frozen=True)
class ShardSpec:
    """One trainer rank's place in the (ep × tp) mesh."""

    rank: int = 0
    """Global trainer rank, ``ep_rank · tp + tp_rank``."""
    ep: int = 1
    """Expert-parallel size; must divide the number of experts E."""
    tp: int = 1
    """Tensor-parallel size; must divide every split dimension (I for experts, heads·head_dim, ...)."""

    def __post_init__(self) -> None:
        if self.ep < 1 or self.tp < 1 or not 0 <= self.rank < self.ep * self.tp:
            raise ValueError(f"ShardSpec needs ep, tp >= 1 and 0 <= rank < ep·tp, got rank={self.rank} ep={self.ep} tp={self.tp}")

    @property
    def world_size(self) -> int:
        return self.ep * self.tp

    @property
    def ep_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def coord(self, axis: str) -> int:
        return {"ep": self.ep_rank, "tp": self.tp_rank}[axis]

    def size(self, axis: str) -> int:
        return {"ep": self.ep, "tp": self.tp}[axis]


# (orientation, gate_up_order) of the family's layout row -> (gate_up_proj dims, down_proj dims), as SHARD_RULES.
EXPERT_TP_RULES: dict[tuple[str, str], tuple[dict[int, tuple[str, str]], dict[int, tuple[str, str]]]] = {
    ("out_in", "concat"): ({0: ("ep", "chunk"), 1: ("tp", "halves")}, {0: ("ep", "chunk"), 2: ("tp", "chunk")}),
    ("in_out", "concat"): ({0: ("ep", "chunk"), 2: ("tp", "halves")}, {0: ("ep", "chunk"), 1: ("tp", "chunk")}),
    ("in_out", "interleaved"): ({0: ("ep", "chunk"), 2: ("tp", "chunk")}, {0: ("ep", "chunk"), 1: ("tp", "chunk")}),
}

# name pattern -> {dim: (mesh axis, split kind)}; first match wins. "chunk": equal contiguous
# blocks; "halves": each half of the dim ([gate; up]) chunked separately and stacked. The expert rows are
# those of out_in families; ``_rule`` takes another family's from ``EXPERT_TP_RULES``.
SHARD_RULES: tuple[tuple[re.Pattern[str], dict[int, tuple[str, str]]], ...] = (
    (expert_names().fused_gate_up, EXPERT_TP_RULES["out_in", "concat"][0]),
    (expert_names().fused_down, EXPERT_TP_RULES["out_in", "concat"][1]),
    (re.compile(r"\.(q_proj|k_proj|v_proj)\.(weight|bias)$"), {0: ("tp", "chunk")}),
    (re.compile(r"\.mlp\.(gate_proj|up_proj)\.weight$"), {0: ("tp", "chunk")}),
    (re.compile(r"\.(o_proj|mlp\.down_proj)\.weight$"), {1: ("tp", "chunk")}),
    (re.compile(r"(^|\.)(embed_tokens\.weight|lm_head\.weight)$"), {0: ("tp", "chunk")}),
)


@dataclass(frozen=True, slots=True)
class Piece:
    """A global box of a tensor and where it sits in the rank's local tensor (same shape)."""

    global_box: Box
    local_box: Box


def _rule(name: str, layout: object | None = None) -> dict[int, tuple[str, str]]:
    """The split dims of ``name``; ``layout``: the family's ``FamilyLayout`` (``None``: out_in, concat)."""
    for i, (pattern, dims) in enumerate(SHARD_RULES):
        if pattern.search(name):
            if i < 2 and layout is not None:
                key = (layout.orientation, layout.gate_up_order)
                if key not in EXPERT_TP_RULES:
                    raise ValueError(f"{name!r}: no tensor-parallel split for experts stored {key[0]} with "
                                     f"{key[1]} gate/up; sync this family with tp=1")
                return EXPERT_TP_RULES[key][i]
            return dims
    return {}


def _dim_segments(name: str, dim: int, n: int, kind: str, size: int, coord: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(global range, local range) segments of one dimension."""
    if size == 1:
        return [((0, n), (0, n))]
    parts = 2 if kind == "halves" else 1
    if n % (parts * size):
        raise ValueError(
            f"cannot shard {name!r} dim {dim} of size {n} into {parts}×{size} equal blocks; "
            f"choose a parallel size that divides {n // parts}"
        )
    half, block = n // parts, n // (parts * size)
    return [((p * half + coord * block, p * half + (coord + 1) * block), (p * block, (p + 1) * block)) for p in range(parts)]


def shard_pieces(meta: ParamMeta, spec: ShardSpec, layout: object | None = None) -> list[Piece]:
    """The global boxes of tensor ``meta`` rank ``spec.rank`` holds, with their local positions.
    ``layout``: the family's ``FamilyLayout`` (its experts' orientation; ``None``: out_in, concat).

    Raises:
        ValueError: a split dimension is not divisible by its parallel size.
    """
    dims = _rule(meta.name, layout)
    per_dim = []
    for d, n in enumerate(meta.shape):
        axis, kind = dims.get(d, (None, "chunk"))
        size, coord = (spec.size(axis), spec.coord(axis)) if axis else (1, 0)
        per_dim.append(_dim_segments(meta.name, d, n, kind, size, coord))
    return [
        Piece(global_box=tuple(g for g, _ in combo), local_box=tuple(l for _, l in combo))
        for combo in itertools.product(*per_dim)
    ]


def local_shape(meta: ParamMeta, spec: ShardSpec, layout: object | None = None) -> tuple[int, ...]:
    """Shape of the rank's local tensor for ``meta`` (``layout`` as ``shard_pieces``)."""
    pieces = shard_pieces(meta, spec, layout)
    return tuple(max(p.local_box[d][1] for p in pieces) for d in range(len(meta.shape))) if pieces else ()


def owns(meta: ParamMeta, spec: ShardSpec, layout: object | None = None) -> bool:
    """Whether this rank produces its pieces of ``meta``: coordinate 0 on every mesh axis that does
    not shard the tensor (so a replicated tensor is sent by exactly one rank)."""
    used = {axis for axis, _ in _rule(meta.name, layout).values()}
    return all(spec.coord(axis) == 0 for axis in ("ep", "tp") if axis not in used and spec.size(axis) > 1)
