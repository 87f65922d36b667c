"""An EP / TP rank merges its owned boxes from its own factors only (``LocalAdapter``): every box equals,
bit for bit, the same box merged by the same rank from the whole adapter (every expert's factors, as
PEFT saved them), on the first sync (normalised) and after a factor update (refreshed in place, not
normalised again). The whole-adapter merge itself is checked against PEFT in tests/merge. (Same boxes
on purpose: a TP sub-box of an fp32 base can differ from the whole-tensor merge by 1 ulp, as the GEMM
takes another kernel path for other widths.)"""

from __future__ import annotations

import pytest
import torch
from peft import PeftConfig
from safetensors.torch import load_file

from protocols.params import box_shape
from sync_service.dtypes import TORCH_DTYPES
from sync_service.merge.adapter import adapter_from_state_dict
from sync_service.merge.base import SafetensorsBase
from sync_service.merge.errors import MergeError
from sync_service.live.checkpoint import load_rank, set_factors
from sync_service.merge.source import MergeConfig, MergedSource
from sync_service.sharding.rules import ShardSpec
from sync_service.synthetic import make_adapter, make_base

E = 4


OPTIONS = {"plain": {}, "dora+modules_to_save": {"use_dora": True, "modules_to_save": ["lm_head"]},
           "patterns+rslora": {"use_rslora": True, "rank_pattern": {"down_proj": 3}, "alpha_pattern": {"q_proj": 5}},
           # a pattern naming an expert of the second EP block: must match under its global id
           "expert_alpha_pattern": {"alpha_pattern": {"experts.3.gate_proj": 40}},
           # modules_to_save copies of the fused expert tensors: each rank takes its block
           "experts_modules_to_save": {"target_modules": ["q_proj"], "modules_to_save": ["experts"]}}


@pytest.fixture(scope="module", params=[("qwen3_moe", "target_parameters", "plain"), ("qwen3_moe", "legacy", "plain"),
                                        ("mixtral", "legacy", "plain"), ("gpt_oss", "target_parameters", "plain"),
                                        ("qwen3_moe", "dense", "dora+modules_to_save"),
                                        ("qwen3_moe", "target_parameters", "patterns+rslora"),
                                        ("qwen3_moe", "legacy", "expert_alpha_pattern"),
                                        ("qwen3_moe", "dense", "experts_modules_to_save")])
def checkpoint(request, tmp_path_factory):
    family, kind, options = request.param
    root = tmp_path_factory.mktemp(f"{family}-{kind}-{options}")
    make_base(family, root / "base", num_experts=E)
    make_adapter(family, root / "base", root / "lora", kind=kind, r=2, lora_alpha=6, seed=3, **OPTIONS[options])
    return root / "base", root / "lora"


def whole_adapter(base: SafetensorsBase, adapter_dir, scale: float):
    """The whole adapter with every factor multiplied by ``scale``."""
    factors = {k: v * scale for k, v in load_file(str(adapter_dir / "adapter_model.safetensors")).items()}
    return adapter_from_state_dict(PeftConfig.from_pretrained(str(adapter_dir)), factors, base.layout,
                                   base.metas(), tied_aliases=base.tied_aliases)


@pytest.mark.parametrize("ep,tp", [(2, 1), (4, 1), (2, 2)])
def test_rank_boxes_equal_the_whole_merge_before_and_after_a_refresh(checkpoint, ep, tp):
    base_dir, adapter_dir = checkpoint
    if tp > 1 and "dora" in base_dir.parent.name:
        with pytest.raises(MergeError, match=r"use_dora=true: .*o_proj.weight is split by columns on trainer rank 0 .*tp=1"):
            load_rank(base_dir, adapter_dir, ShardSpec(rank=0, ep=ep, tp=tp))
        return
    wholes = {scale: whole_adapter(SafetensorsBase(base_dir), adapter_dir, scale) for scale in (1.0, -2.5)}
    for rank in range(ep * tp):
        state = load_rank(base_dir, adapter_dir, ShardSpec(rank=rank, ep=ep, tp=tp))
        for version, scale in enumerate((1.0, -2.5)):
            if scale != 1.0:
                set_factors(state, {k: p.param * scale for k, p in state.factors.items()})
            state.snapshot(version)
            source = state.source(version)
            ref = MergedSource(state.base, wholes[scale], config=MergeConfig(), owned=state.owned(),
                               layout=state.base.layout)
            assert source.changed_names() == ref.changed_names()
            for m in state.owned():
                out, want = (torch.empty(box_shape(m.box), dtype=TORCH_DTYPES[m.dtype]) for _ in range(2))
                source.fill(m.name, m.box, out)
                ref.fill(m.name, m.box, want)
                assert torch.equal(out, want), f"rank {rank} of ep={ep} tp={tp}, v{version}: {m.name} {m.box}"


def test_non_finite_factor_refused_naming_the_key(checkpoint):
    base_dir, adapter_dir = checkpoint
    state = load_rank(base_dir, adapter_dir, ShardSpec(rank=1, ep=2, tp=1))
    state.snapshot(0)
    state.source(0)
    key = sorted(state.factors)[0]
    bad = state.factors[key].param.clone()
    bad.view(-1)[0] = float("inf")
    set_factors(state, {key: bad})
    state.snapshot(1)
    with pytest.raises(MergeError, match=rf"adapter key {key.replace('.', '[.]')}: holds NaN or Inf values on trainer rank 1"):
        state.source(1)
