"""Where a Megatron-Core rank's base boxes land in the engines' tensors: ``Segment``s in hf-fused naming.

A rank's base parameter (its ``placement.Placement``: global ``torch_dist`` key, boxes) maps through the table of
``layouts.py`` (``Row``: plain, ``qkv`` per query group, ``gated`` [gate; up]) to the HF checkpoint names, and
from there to the transformers in-memory (hf-fused) names the engines hold (``merge.layouts.FamilyLayout``: an
expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` → a box of ``mlp.experts.gate_up_proj`` [E, 2I, H] /
``down_proj`` [E, H, I]). A ``Segment`` is one such box: the hf-fused name and box, and which rows / columns of
the rank's local Megatron tensor (and of the global Megatron tensor, for the LoRA factors' rows and columns)
fill it. A TP shard of ``linear_qkv`` holds whole query groups: its q, k and v rows are each contiguous in the
HF tensors; a shard of ``linear_fc1`` holds [gate_r; up_r]: two segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocols.params import Box
from sync_service.megatron.layouts import EXPERT_ROWS, LAYER_ROWS, TOP_ROWS, Row
from sync_service.megatron.placement import Placement, PlacementError

__all__ = ["Segment", "segments_of", "geometry_of"]

_EXPERT = ".mlp.experts.local_experts."


@dataclass(frozen=True, slots=True)
class Segment:
    """One box of an engine tensor filled from one local Megatron base tensor.

    Attributes:
        hf: the hf-fused name (``model.layers.0.self_attn.q_proj.weight``, ``model.layers.0.mlp.experts.gate_up_proj``).
        box: the box of it (global, hf-fused coordinates).
        shape: the hf-fused tensor's global shape.
        param: the Megatron base parameter's local name (``…linear_qkv.to_wrap.weight``).
        local_rows: the local tensor's rows (dim 0), in the box's row order.
        global_rows: the same rows in the global Megatron tensor (the LoRA ``linear_out`` rows they need).
        cols: (local, global) column ranges (2-D tensors; ``None`` for 1-D).
        expert_dim: the box has a leading expert dim of size 1 (fused experts).
    """

    hf: str
    box: Box
    shape: tuple[int, ...]
    param: str
    local_rows: torch.Tensor
    global_rows: torch.Tensor
    cols: tuple[tuple[int, int], tuple[int, int]] | None
    expert_dim: bool


def geometry_of(config: dict) -> dict[str, int]:
    """Attention geometry of an HF ``config.json`` dict: heads, groups (KV heads), head_dim."""
    heads = int(config["num_attention_heads"])
    groups = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    return {"heads": heads, "groups": groups, "head_dim": head_dim}


def _row_map(row: Row, rows: int, geometry: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(which HF tensor of ``row.hf``, the row in it) of every global Megatron row."""
    g = torch.arange(rows)
    if row.kind == "qkv":
        d, per = geometry["head_dim"], geometry["heads"] // geometry["groups"]
        group, within = g // ((per + 2) * d), g % ((per + 2) * d)
        which = torch.where(within < per * d, 0, torch.where(within < (per + 1) * d, 1, 2))
        hf_row = torch.where(which == 0, group * per * d + within, group * d + within - per * d - (which == 2) * d)
        return which, hf_row
    if row.kind == "gated":
        return g // (rows // 2), g % (rows // 2)
    return torch.zeros_like(g), g


def _lookup(key: str) -> tuple[Row, str, int | None, int | None] | None:
    """(row, per-layer / per-expert remainder, layer, expert) of a global Megatron base key."""
    for row in TOP_ROWS:
        if key == row.megatron:
            return row, key, None, None
    if not key.startswith("decoder.layers."):
        return None
    layer, _, rest = key.removeprefix("decoder.layers.").partition(".")
    if rest.startswith(_EXPERT.lstrip(".")):
        expert, _, leaf = rest.removeprefix(_EXPERT.lstrip(".")).partition(".")
        for row in EXPERT_ROWS:
            if leaf == row.megatron:
                return row, leaf, int(layer), int(expert)
        return None
    for row in LAYER_ROWS:
        if rest == row.megatron:
            return row, rest, int(layer), None
    return None


def _hf_name(row: Row, which: int, layer: int | None, expert: int | None) -> str:
    name = row.hf[which]
    if layer is None:
        return name
    if expert is None:
        return f"model.layers.{layer}.{name}"
    return f"model.layers.{layer}.mlp.experts.{expert}.{name}"


def segments_of(p: Placement, *, geometry: dict[str, int], layout, num_experts: int | None) -> list[Segment]:
    """The segments of base placement ``p`` (every box it covers, whether or not this rank sends it).

    Raises:
        PlacementError: a key outside the table of ``layouts.py``, or experts in a layout other than [E, out, in]
            with gate before up (named)."""
    found = _lookup(p.key)
    if found is None:
        raise PlacementError(f"{p.name} (global {p.key}) is not in weightsync's Megatron-Bridge table "
                             f"(sync_service/megatron/layouts.py); its model family is not supported yet")
    row, _, layer, expert = found
    which_of, hf_row_of = _row_map(row, p.global_shape[0], geometry)
    out = []
    for box, index in p.pieces:
        (r0, r1), cols = box[0], (box[1] if len(box) > 1 else None)
        local0 = index[0].start if index else 0
        rows = torch.arange(r0, r1)
        for which in sorted(set(which_of[r0:r1].tolist())):
            sel = rows[which_of[r0:r1] == which]
            hf_rows = hf_row_of[sel]
            h0, h1 = int(hf_rows.min()), int(hf_rows.max()) + 1
            if h1 - h0 != len(sel) or not bool((hf_rows.diff() == 1).all() if len(sel) > 1 else True):
                raise PlacementError(f"{p.name}: its rows of {row.hf[which]} are not contiguous there")
            hf_total = int((which_of == which).sum())
            width = () if cols is None else (p.global_shape[1],)
            col_box = () if cols is None else (tuple(cols),)
            name, shape, hbox, is_expert = _hf_name(row, which, layer, expert), (hf_total, *width), \
                ((h0, h1), *col_box), False
            if expert is not None:
                name, shape, hbox = _fused(name, layer, expert, shape, hbox, layout, num_experts)
                is_expert = True
            local_cols = None if cols is None else ((0, cols[1] - cols[0]), tuple(cols))
            out.append(Segment(hf=name, box=hbox, shape=shape, param=p.name, local_rows=sel - r0 + local0,
                               global_rows=sel, cols=local_cols, expert_dim=is_expert))
    return out


def _fused(name: str, layer: int, expert: int, shape, hbox, layout, num_experts: int | None):
    """An expert's per-expert HF name / shape / box → its fused experts tensor's (``layout``'s)."""
    if layout.orientation != "out_in" or layout.gate_up_order != "concat" or num_experts is None:
        raise PlacementError(f"{name}: the engine's experts layout ({layout.family}: {layout.orientation}, "
                             f"{layout.gate_up_order}) is not [E, out, in] with gate before up; not built for Megatron")
    leaf = name.rpartition(".")[0].rpartition(".")[2]
    slot = layout.slot_of(leaf)
    if slot is None:
        raise PlacementError(f"{name}: {leaf} is not one of {layout.per_expert_names}")
    out_total = shape[0] * (1 if slot == "down" else 2)
    start = layout.out_selection(slot, out_total)[0]
    fused = f"model.layers.{layer}.{layout.experts_module}.{layout.slot_param(slot)}"
    (h0, h1), *rest = hbox
    return fused, (num_experts, out_total, *shape[1:]), ((expert, expert + 1), (start + h0, start + h1), *rest)
