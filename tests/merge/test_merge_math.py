"""Merge math on tiny hand-built inputs: scaling, gate/up slots, orientation, PEFT packing."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig

from protocols.params import full_box
from sync_service.merge.adapter import adapter_from_state_dict
from sync_service.merge.base import TensorDictBase
from sync_service.merge.derive import layout_for
from sync_service.synthetic import build_config
from sync_service.merge.source import MergeConfig, MergedSource

P = "base_model.model.model.layers.0.mlp.experts"
GU = "model.layers.0.mlp.experts.gate_up_proj"
DOWN = "model.layers.0.mlp.experts.down_proj"


def merged(family: str, base: dict, config: LoraConfig, adapter_sd: dict, **cfg) -> dict[str, torch.Tensor]:
    provider = TensorDictBase(base)
    adapter = adapter_from_state_dict(config, adapter_sd, layout_for(build_config(family)), provider.metas())
    source = MergedSource(provider, adapter, config=MergeConfig(**cfg))
    return dict(source.iter_tensors("hf-fused"))


def pack(a_e: torch.Tensor, b_e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert A_e [E, r, in], B_e [E, out, r] → PEFT ParamWrapper lora_A [r·E, in] (row e·r + k)
    and lora_B [out, r·E] (column k·E + e), written element by element from the PEFT rule."""
    num_experts, r, in_f = a_e.shape
    out_f = b_e.shape[1]
    a = torch.empty(r * num_experts, in_f)
    b = torch.empty(out_f, r * num_experts)
    for e in range(num_experts):
        for k in range(r):
            a[e * r + k] = a_e[e, k]
            b[:, k * num_experts + e] = b_e[e, :, k]
    return a, b


def test_merge_rslora_scaling_per_expert():
    torch.manual_seed(0)
    base = {GU: torch.randn(4, 16, 8), DOWN: torch.zeros(4, 8, 8)}
    a_e, b_e = torch.randn(4, 2, 8), torch.randn(4, 16, 2)
    a, b = pack(a_e, b_e)
    config = LoraConfig(r=2, lora_alpha=4, use_rslora=True, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"])
    out = merged("qwen3_moe", base, config, {f"{P}.lora_A.weight": a, f"{P}.lora_B.weight": b})
    for e in range(4):
        expected = (4 / math.sqrt(2)) * b_e[e] @ a_e[e]
        torch.testing.assert_close(out[GU][e] - base[GU][e], expected, rtol=1e-5, atol=1e-5)


def _slot_adapter(prefix: str, i: int, h: int, e_count: int, down: bool = False) -> dict:
    """Legacy per-expert LoRA, r=1: gate ΔW all 1, up ΔW all 2 (optionally down ΔW = B_e@A_e)."""
    sd = {}
    for e in range(e_count):
        sd[f"{prefix}.{e}.gate_proj.lora_A.weight"] = torch.ones(1, h)
        sd[f"{prefix}.{e}.gate_proj.lora_B.weight"] = torch.ones(i, 1)
        sd[f"{prefix}.{e}.up_proj.lora_A.weight"] = torch.ones(1, h)
        sd[f"{prefix}.{e}.up_proj.lora_B.weight"] = torch.full((i, 1), 2.0)
    return sd


def test_merge_gate_up_slots_concat_and_interleaved():
    config = LoraConfig(r=1, lora_alpha=1, target_modules=["gate_proj", "up_proj"])
    sd = _slot_adapter(P, i=4, h=4, e_count=2)
    concat = merged("qwen3_moe", {GU: torch.zeros(2, 8, 4)}, config, sd)[GU]
    assert torch.equal(concat[:, :4], torch.ones(2, 4, 4)) and torch.equal(concat[:, 4:], torch.full((2, 4, 4), 2.0))
    inter = merged("gpt_oss", {GU: torch.zeros(2, 4, 8)}, config, sd)[GU]  # [E, H, 2I]
    assert torch.equal(inter[..., 0::2], torch.ones(2, 4, 4)) and torch.equal(inter[..., 1::2], torch.full((2, 4, 4), 2.0))


def _down_adapter(a_e: torch.Tensor, b_e: torch.Tensor) -> dict:
    sd = {}
    for e in range(a_e.shape[0]):
        sd[f"{P}.{e}.down_proj.lora_A.weight"] = a_e[e]
        sd[f"{P}.{e}.down_proj.lora_B.weight"] = b_e[e]
    return sd


@pytest.mark.parametrize("h,i", [(4, 4), (8, 2)])
def test_merge_orientation_from_table_not_shape(h, i):
    torch.manual_seed(1)
    num_experts, r = 2, 1
    out_in = torch.arange(num_experts * h * i, dtype=torch.float32).reshape(num_experts, h, i)  # [E, H, I]
    a_e, b_e = torch.randn(num_experts, r, i), torch.randn(num_experts, h, r)
    config = LoraConfig(r=r, lora_alpha=r, target_modules=["down_proj"])
    m_out_in = merged("qwen3_moe", {DOWN: out_in}, config, _down_adapter(a_e, b_e))[DOWN]
    m_in_out = merged("gpt_oss", {DOWN: out_in.transpose(1, 2).contiguous()}, config, _down_adapter(a_e, b_e))[DOWN]
    x = torch.randn(3, i)
    for e in range(num_experts):
        torch.testing.assert_close(x @ m_out_in[e].T, x @ m_in_out[e])  # same forward
        torch.testing.assert_close(m_out_in[e] - out_in[e], b_e[e] @ a_e[e])  # every expert's delta
        torch.testing.assert_close(m_in_out[e] - out_in[e].T, (b_e[e] @ a_e[e]).T)


@pytest.mark.parametrize("family,shape", [("qwen3_moe", (2, 6, 4)), ("qwen3_moe", (2, 4, 4)), ("gpt_oss", (2, 4, 6)), ("gpt_oss", (2, 4, 4))])
def test_merge_target_parameters_engine_orientation(family, shape):
    torch.manual_seed(2)
    orient = layout_for(build_config(family)).orientation
    out_f, in_f = (shape[1], shape[2]) if orient == "out_in" else (shape[2], shape[1])
    a_e, b_e = torch.randn(2, 1, in_f), torch.randn(2, out_f, 1)
    a, b = pack(a_e, b_e)
    config = LoraConfig(r=1, lora_alpha=1, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"])
    out = merged(family, {GU: torch.zeros(shape)}, config, {f"{P}.lora_A.weight": a, f"{P}.lora_B.weight": b})[GU]
    for e in range(2):
        engine = out[e] if orient == "out_in" else out[e].T  # [out, in]
        torch.testing.assert_close(engine, b_e[e] @ a_e[e])


def test_merge_packed_factors_distinct_experts_e_ne_r():
    torch.manual_seed(3)
    num_experts, r, in_f, out_f = 3, 2, 4, 5
    a_e = torch.arange(num_experts * r * in_f, dtype=torch.float32).reshape(num_experts, r, in_f) / 7
    b_e = -torch.arange(num_experts * out_f * r, dtype=torch.float32).reshape(num_experts, out_f, r) / 11
    a, b = pack(a_e, b_e)
    config = LoraConfig(r=r, lora_alpha=r, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"])
    out = merged("qwen3_moe", {GU: torch.zeros(num_experts, out_f, in_f)}, config,
                 {f"{P}.lora_A.weight": a, f"{P}.lora_B.weight": b})[GU]
    deltas = [out[e] for e in range(num_experts)]
    for e in range(num_experts):
        torch.testing.assert_close(deltas[e], b_e[e] @ a_e[e])
    assert not torch.equal(deltas[0], deltas[1]) and not torch.equal(deltas[1], deltas[2])


def test_merge_nested_target_parameters_go_to_their_params():
    torch.manual_seed(4)
    num_experts, h, i = 2, 4, 4  # square: only the nesting rule tells gate_up from down
    base = {GU: torch.zeros(num_experts, 2 * i, h), DOWN: torch.zeros(num_experts, h, i)}
    gu_a, gu_b = pack(torch.randn(num_experts, 1, h), torch.randn(num_experts, 2 * i, 1))
    dn_a, dn_b = pack(torch.ones(num_experts, 1, i), torch.ones(num_experts, h, 1))
    config = LoraConfig(r=1, lora_alpha=1, target_modules=[],
                        target_parameters=["mlp.experts.down_proj", "mlp.experts.gate_up_proj"])
    sd = {f"{P}.base_layer.lora_A.weight": gu_a, f"{P}.base_layer.lora_B.weight": gu_b,
          f"{P}.lora_A.weight": dn_a, f"{P}.lora_B.weight": dn_b}
    out = merged("qwen3_moe", base, config, sd)
    assert torch.equal(out[DOWN], torch.ones(num_experts, h, i))
    assert not torch.equal(out[GU], torch.zeros_like(out[GU]))


def test_merge_dora_rows_rescaled_box_within_budget():
    torch.manual_seed(6)
    name = "model.layers.0.self_attn.q_proj.weight"
    w = torch.randn(6, 8)
    a, b, mag = torch.randn(2, 8), torch.randn(6, 2), torch.rand(6) + 0.5
    config = LoraConfig(r=2, lora_alpha=4, use_dora=True, target_modules=["q_proj"])
    sd = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
          "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b,
          "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": mag}
    provider = TensorDictBase({name: w})
    adapter = adapter_from_state_dict(config, sd, layout_for(build_config("qwen3_moe")), provider.metas())
    source = MergedSource(provider, adapter, config=MergeConfig(staging_bytes=16))  # 4 fp32: rows cut in pieces
    merged_w = w + 2.0 * b @ a
    expected = (mag / merged_w.norm(dim=1)).unsqueeze(1) * merged_w
    box = ((1, 5), (3, 7))
    out = torch.empty(4, 4)
    source.fill(name, box, out)
    torch.testing.assert_close(out, expected[1:5, 3:7])
    assert source.peak_staging_bytes <= 16


def test_merge_tied_lm_head_lora_lands_on_embeddings():
    torch.manual_seed(7)
    emb = torch.randn(16, 4)
    state = {"model.embed_tokens.weight": emb, "lm_head.weight": emb}  # tied: one storage
    provider = TensorDictBase(state)
    assert [m.name for m in provider.metas()] == ["model.embed_tokens.weight"]
    a, b = torch.randn(1, 4), torch.randn(16, 1)
    config = LoraConfig(r=1, lora_alpha=1, target_modules=["lm_head"])
    sd = {"base_model.model.lm_head.lora_A.weight": a, "base_model.model.lm_head.lora_B.weight": b}
    adapter = adapter_from_state_dict(config, sd, layout_for(build_config("qwen3_moe")), provider.metas(), tied_aliases=provider.tied_aliases)
    source = MergedSource(provider, adapter, config=MergeConfig(), layout=layout_for(build_config("qwen3_moe")))
    out = dict(source.iter_tensors("hf"))
    assert list(out) == ["model.embed_tokens.weight"]
    torch.testing.assert_close(out["model.embed_tokens.weight"], emb + b @ a)
