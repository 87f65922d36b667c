"""Block-FP8 engines per family (the README families table's "FP8 engine" column): one family per distinct
layout row (``cli_families``: fused and per-expert disk forms, both orientations, renamed experts), each synced
by two EP trainers (bf16 base, float64 accumulation) into an HF engine loaded from a block-FP8 checkpoint
(``weightsync merge --quantize fp8`` of another adapter, 16×16 blocks). The engine's FP8 bytes, scales and bf16
tensors must equal, bit for bit, transformers' own ``Fp8Quantize`` of PEFT's float64 merge (the rest cast once):
``verify.fp8_oracle``. qwen3_moe runs in ``test_fp8_engine.py`` (full + delta, both base dtypes). One Ray session.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sync_service.api import SyncConfig, WeightSync
from sync_service.merge.export import merge_checkpoint
from sync_service.merge.export_fp8 import Fp8Options
from sync_service.synthetic import make_adapter, make_base
from sync_service.verify.fp8_oracle import quantized_state
from sync_service.verify.peft_oracle import model_state, peft_merged_model
from tests.merge.test_sync_families import cli_families

ray = pytest.importorskip("ray")

FP8_FAMILIES = tuple(cli_families())
"""The families this module syncs into block-FP8 engines (with qwen3_moe: the README column)."""
BLOCK = Fp8Options(weight_block_size=(16, 16))
SIZES = dict(hidden=32, intermediate=16, num_experts=4)


def fp8_engine_families() -> tuple[str, ...]:
    """Every family a test syncs into a block-FP8 engine (the README's "FP8 engine" column)."""
    return (*FP8_FAMILIES, "qwen3_moe")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-families")
    out = {}
    for family in FP8_FAMILIES:
        base = make_base(family, root / family / "base", dtype="bfloat16", **SIZES)
        adapter = make_adapter(family, base, root / family / "lora", kind="target_parameters", r=2, lora_alpha=6,
                               init_scale=0.3, seed=3)
        other = make_adapter(family, base, root / family / "other", kind="target_parameters", r=2, init_scale=0.3,
                             seed=9)
        merge_checkpoint(base, other, root / family / "fp8", quantize="fp8", fp8=BLOCK, progress=False)
        out[family] = (base, adapter, root / family / "fp8")
    return out


@pytest.mark.parametrize("family", FP8_FAMILIES)
def test_ep2_trainers_sync_into_a_block_fp8_engine(ray_local, trainer_pool, files, family):
    from actors.launch import start_trainers
    from actors.rollout import RolloutEngine

    base, adapter, fp8_dir = files[family]
    engine = RolloutEngine.remote(model_dir=str(fp8_dir), engine="hf", name=f"fp8-{family}")
    trainers = start_trainers(base, adapter, ep=2, reuse=trainer_pool)
    sync = WeightSync(trainers=trainers, engines=[engine], config=SyncConfig(
        transport="shm", bucket_bytes=16 << 10, timeout_s=120, accumulate_dtype="float64"))
    try:
        table = ray.get(engine.param_metas.remote(), timeout=120)
        assert sync.dtype_conversions.get(("bfloat16", "float8_e4m3fn"), 0) >= 2, sync.dtype_conversions
        assert sync.push(0).full
        oracle = quantized_state(model_state(peft_merged_model(base, adapter, dtype=torch.float64)), table)
        state = ray.get(engine.state.remote(), timeout=120)
        assert state.keys() == oracle.keys(), sorted(set(state) ^ set(oracle))[:4]
        bad = [n for n, want in oracle.items() if not np.array_equal(state[n], want.float().numpy())]
        assert not bad, f"{family}: not transformers' quantizer of PEFT's float64 merge: {bad[:4]}"
    finally:
        sync.close()
        ray.kill(engine)
