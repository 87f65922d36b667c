"""``sync_service/megatron/targets.py``: a rank's Megatron boxes → the engines' hf-fused boxes. Every TP / expert-TP
rank's segments of a random global tensor, filled from its local shard, rebuild exactly what ``layouts.py``'s split of
the global tensor gives (q / k / v per query group; [gate; up] → the fused experts' ``gate_up_proj``). No processes."""

from __future__ import annotations

import json

import torch

from sync_service.megatron.layouts import split_gated, split_qkv
from sync_service.megatron.placement import Placement
from sync_service.megatron.targets import geometry_of, segments_of
from sync_service.merge.derive import layout_for


def _fill(placements, local_of, config) -> dict[str, torch.Tensor]:
    layout, geometry = layout_for(config), geometry_of(config)
    out: dict[str, torch.Tensor] = {}
    for p in placements:
        local = local_of(p)
        for seg in segments_of(p, geometry=geometry, layout=layout, num_experts=config.get("num_experts") or config["num_local_experts"]):
            t = out.setdefault(seg.hf, torch.full(seg.shape, float("nan")))
            values = local.index_select(0, seg.local_rows)[:, slice(*seg.cols[0])]
            t[tuple(slice(a, b) for a, b in seg.box)] = values.unsqueeze(0) if seg.expert_dim else values
    return out


def test_qkv_shards_of_two_tp_ranks_rebuild_q_k_v(hf_model):
    config = json.loads((hf_model / "config.json").read_text())
    g = geometry_of(config)
    rows = (g["heads"] + 2 * g["groups"]) * g["head_dim"]
    w = torch.randn(rows, config["hidden_size"])
    key = "decoder.layers.1.self_attention.linear_qkv.weight"
    half = rows // 2
    placements = [Placement(f"r{r}", key, "base", tuple(w.shape), ((((r * half, (r + 1) * half), (0, w.shape[1])), ()),),
                            True) for r in range(2)]
    got = _fill(placements, lambda p: w[int(p.name[1]) * half:(int(p.name[1]) + 1) * half], config)
    want = split_qkv(w, **g)
    for name, part in zip(("q_proj", "k_proj", "v_proj"), want):
        assert torch.equal(got[f"model.layers.1.self_attn.{name}.weight"], part)


def test_expert_fc1_shards_of_two_expert_tp_ranks_fill_the_fused_gate_up(hf_model):
    config = json.loads((hf_model / "config.json").read_text())
    i, h, e = config["moe_intermediate_size"], config["hidden_size"], 3
    w = torch.randn(2 * i, h)  # [gate; up] of expert 3, layer 0
    key = f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight"
    q = i // 2
    placements = [Placement(f"r{r}", key, "base", (2 * i, h), tuple(
        (((half * i + r * q, half * i + (r + 1) * q), (0, h)), (slice(half * q, (half + 1) * q),)) for half in range(2)),
        True) for r in range(2)]
    local = {r: torch.cat([w[r * q:(r + 1) * q], w[i + r * q:i + (r + 1) * q]]) for r in range(2)}  # [gate_r; up_r]
    got = _fill(placements, lambda p: local[int(p.name[1])], config)
    fused = got["model.layers.0.mlp.experts.gate_up_proj"]
    gate, up = split_gated(w)
    assert torch.equal(fused[e], torch.cat([gate, up])) and fused[[0, 1, 2]].isnan().all()
