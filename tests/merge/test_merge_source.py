"""MergedSource behaviour: out of place, bounded staging, one cast, any box bitwise equal."""

from __future__ import annotations

import random

import pytest
import torch
from peft import LoraConfig

from protocols.interfaces import WeightSource
from protocols.params import ParamMeta, box_shape, full_box
from sync_service.merge.adapter import adapter_from_state_dict
from sync_service.merge.base import TensorDictBase
from sync_service.merge.errors import MergeError
from sync_service.merge.derive import layout_for
from sync_service.synthetic import build_config
from sync_service.merge.source import MergeConfig, MergedSource

P = "base_model.model.model.layers.0.mlp.experts"
GU = "model.layers.0.mlp.experts.gate_up_proj"


def _source(family: str, base: dict, r: int = 2, **cfg) -> MergedSource:
    """target_parameters LoRA on gate_up_proj with random fp32 factors (s = 2)."""
    g = torch.Generator().manual_seed(5)
    num_experts, d1, d2 = base[GU].shape
    out_f, in_f = (d1, d2) if layout_for(build_config(family)).orientation == "out_in" else (d2, d1)
    sd = {f"{P}.lora_A.weight": torch.randn(r * num_experts, in_f, generator=g),
          f"{P}.lora_B.weight": torch.randn(out_f, r * num_experts, generator=g)}
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"])
    provider = TensorDictBase(base)
    adapter = adapter_from_state_dict(config, sd, layout_for(build_config(family)), provider.metas())
    return MergedSource(provider, adapter, config=MergeConfig(**cfg))


def test_merge_source_is_a_weight_source():
    source = _source("qwen3_moe", {GU: torch.zeros(2, 4, 4)})
    assert isinstance(source, WeightSource)
    assert source.changed_names() == frozenset({GU})
    assert source.param_metas() == [ParamMeta(GU, "float32", (2, 4, 4))]


def test_merge_drift_base_bitwise_unchanged_after_100_merges():
    base = torch.randn(4, 8, 4).to(torch.bfloat16)
    before = base.clone()
    source = _source("qwen3_moe", {GU: base})
    out = torch.empty_like(base)
    first = None
    for _ in range(100):
        source.fill(GU, full_box(base.shape), out)
        first = out.clone() if first is None else first
        assert torch.equal(out, first)
    assert torch.equal(base.view(torch.int16), before.view(torch.int16))
    assert not torch.equal(out, base)


def test_merge_bounded_staging_per_expert_within_budget():
    base = torch.randn(16, 8, 8).to(torch.bfloat16)
    bounded = _source("qwen3_moe", {GU: base}, staging_bytes=512)
    unbounded = _source("qwen3_moe", {GU: base})
    out_b, out_u = torch.empty_like(base), torch.empty_like(base)
    bounded.fill(GU, full_box(base.shape), out_b)
    unbounded.fill(GU, full_box(base.shape), out_u)
    assert 0 < bounded.peak_staging_bytes <= 512
    assert bounded.peak_staging_bytes == 2 * 8 * 8 * 4  # whole experts, as many as fit the budget
    assert unbounded.peak_staging_bytes == 16 * 8 * 8 * 4
    assert torch.equal(out_b, out_u)


def test_merge_fp32_factors_bf16_base_one_cast():
    base = torch.randn(3, 8, 4).to(torch.bfloat16)
    source = _source("qwen3_moe", {GU: base})
    tensors = dict(source.iter_tensors("hf-fused"))
    assert list(tensors) == [GU]
    assert tensors[GU].dtype == torch.bfloat16
    assert tensors[GU].numel() * tensors[GU].element_size() == base.numel() * 2
    # one rounding: equals the fp32 merge cast once
    term = source.adapter.terms[GU][0]
    fp32 = base.float() + term.scaling * torch.bmm(term.x, term.y)
    assert torch.equal(tensors[GU], fp32.to(torch.bfloat16))


def _random_boxes(shape, rng: random.Random, n: int):
    for _ in range(n):
        box = []
        for size in shape:
            a = rng.randrange(size)
            box.append((a, rng.randrange(a + 1, size + 1)))
        yield tuple(box)


@pytest.mark.parametrize("family,shape", [("qwen3_moe", (4, 12, 8)), ("gpt_oss", (4, 8, 12))])
def test_merge_box_fill_equals_full_merge_bitwise(family, shape):
    base = torch.randn(shape).to(torch.bfloat16)
    full_source = _source(family, {GU: base})
    full = torch.empty_like(base)
    full_source.fill(GU, full_box(shape), full)
    source = _source(family, {GU: base}, staging_bytes=64)
    rng = random.Random(7)
    half = shape[1] // 2 if family == "qwen3_moe" else shape[2] // 2
    cut = ((1, 3), (half - 2, half + 3), (0, shape[2])) if family == "qwen3_moe" else ((1, 3), (0, shape[1]), (3, 8))
    boxes = [cut, *_random_boxes(shape, rng, 40)]
    for box in boxes:
        out = torch.empty(box_shape(box), dtype=torch.bfloat16)
        source.fill(GU, box, out)
        assert torch.equal(out, full[tuple(slice(a, b) for a, b in box)]), box
    assert source.peak_staging_bytes <= 64


def test_merge_owned_boxes_and_bad_fill():
    source_all = _source("qwen3_moe", {GU: torch.zeros(2, 4, 4)})
    provider = source_all.base
    owned = [ParamMeta(GU, "float32", (2, 4, 4), ((1, 2), (0, 4), (0, 4)))]
    source = MergedSource(provider, source_all.adapter, config=MergeConfig(), owned=owned)
    out = torch.empty(1, 4, 4)
    source.fill(GU, ((1, 2), (0, 4), (0, 4)), out)
    with pytest.raises(MergeError, match="not inside an owned box"):
        source.fill(GU, ((0, 1), (0, 4), (0, 4)), out)
    with pytest.raises(MergeError, match="want torch.float32"):
        source.fill(GU, ((1, 2), (0, 4), (0, 4)), out.to(torch.bfloat16))
    with pytest.raises(KeyError):
        source.fill("nope", ((0, 1),), out)


def test_merge_check_finite_names_the_tensor():
    source = _source("qwen3_moe", {GU: torch.full((2, 4, 4), float("inf"))}, check_finite=True)
    with pytest.raises(MergeError, match=GU):
        source.fill(GU, full_box((2, 4, 4)), torch.empty(2, 4, 4))


def test_merge_snapshot_detaches_from_live_factors():
    source = _source("qwen3_moe", {GU: torch.zeros(2, 4, 4)})
    snap = source.adapter.snapshot()
    before = snap.terms[GU][0].x.clone()
    source.adapter.terms[GU][0].x.add_(1.0)  # the trainer keeps training
    assert torch.equal(snap.terms[GU][0].x, before)


def test_merge_tile_size_never_changes_a_value():
    """The tile size (``MergeConfig.tile_bytes``) only changes how a box is cut: tiles of 128 rows, one expert,
    two experts and the whole box give bitwise the fp32 merge cast once (r = 16, bf16 base)."""
    base = torch.randn(4, 1024, 256).to(torch.bfloat16)
    outs = []
    for tile_bytes in (128 << 10, 1 << 20, 2 << 20, 64 << 20):
        source = _source("qwen3_moe", {GU: base}, r=16, tile_bytes=tile_bytes)
        outs.append(torch.empty_like(base))
        source.fill(GU, full_box(base.shape), outs[-1])
        assert source.peak_staging_bytes == min(tile_bytes, 4 * 1024 * 256 * 4)
    term = source.adapter.terms[GU][0]
    want = (base.float() + term.scaling * torch.bmm(term.x, term.y)).to(torch.bfloat16)
    assert all(torch.equal(o.view(torch.int16), want.view(torch.int16)) for o in outs)
