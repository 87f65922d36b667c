"""``MergeConfig.accumulate_dtype``: an fp32-accumulated bf16 merge may round a few elements one ulp away
from PEFT's float64 ``merge_and_unload`` cast once; accumulating in float64 serves its values bitwise."""

from __future__ import annotations

import pytest
import torch

from sync_service.merge.adapter import load_adapter
from sync_service.merge.base import SafetensorsBase
from sync_service.merge.errors import MergeError
from sync_service.verify.peft_oracle import peft_merged_state
from sync_service.merge.source import MergeConfig, MergedSource
from sync_service.synthetic import make_adapter, make_base


def _merged(base_dir, adapter_dir, accumulate_dtype: str) -> dict[str, torch.Tensor]:
    base = SafetensorsBase(base_dir)
    adapter = load_adapter(adapter_dir, base.layout, base.metas(), tied_aliases=base.tied_aliases)
    config = MergeConfig(accumulate_dtype=accumulate_dtype)
    return dict(MergedSource(base, adapter, config=config).iter_tensors("hf-fused"))


def _ulps_off(got: dict[str, torch.Tensor], oracle: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(elements not bitwise equal, largest distance in bf16 ulps) over every tensor."""
    assert got.keys() == oracle.keys()
    bits = [(got[n].view(torch.int16).int() - oracle[n].view(torch.int16).int()).abs() for n in got]
    return sum(int((b != 0).sum()) for b in bits), max(int(b.max()) for b in bits)


def test_float64_accumulation_serves_peft_float64_merge_bitwise(tmp_path):
    base = make_base("qwen3_moe", tmp_path / "base", dtype="bfloat16", hidden=64, intermediate=32, num_experts=4,
                     vocab_size=128, scale=0.1)
    adapter = make_adapter("qwen3_moe", base, tmp_path / "lora", kind="target_parameters", r=4, lora_alpha=16,
                           init_scale=0.3, seed=1)
    oracle = peft_merged_state(base, adapter)
    fp32_off, fp32_ulps = _ulps_off(_merged(base, adapter, "float32"), oracle)
    assert fp32_ulps <= 1, f"fp32 accumulation is {fp32_ulps} bf16 ulps from PEFT's float64 merge"
    assert _ulps_off(_merged(base, adapter, "float64"), oracle) == (0, 0), f"(fp32 accumulation: {fp32_off} off)"


def test_unknown_accumulate_dtype_is_refused(tmp_path):
    from sync_service.api import SyncConfig

    base = make_base("qwen3_moe", tmp_path / "base", dtype="bfloat16", hidden=64, intermediate=32, num_experts=4)
    with pytest.raises(MergeError, match="accumulate_dtype 'float16'"):
        MergedSource(SafetensorsBase(base), None, config=MergeConfig(accumulate_dtype="float16"))
    with pytest.raises(ValueError, match="SyncConfig.accumulate_dtype='bfloat16'; use 'float32' or 'float64'"):
        SyncConfig(accumulate_dtype="bfloat16")
