"""An FP8 base on the trainers: EP=2 trainers start from a block-FP8 checkpoint (QLoRA-style, a bf16 LoRA over it)
and sync into (a) an HF engine holding that same FP8 checkpoint and (b) a bf16 HF engine, full then delta.

The trainers read the base dequantized (``merge.fp8_base``: fp8 × scale_inv in float32, transformers'
``Fp8Dequantize``), merge in float64 and quantize (a) or cast (b) once. Oracle per version: transformers loads
the FP8 checkpoint with ``FineGrainedFP8Config(dequantize=True)`` in float64, PEFT merges that version's adapter
(``merge_and_unload``), then transformers' ``Fp8Quantize`` of each tensor the engine holds in FP8 and one cast
into bf16 of the rest (``verify.fp8_oracle.quantized_state``): the engines' served bytes equal it bit for bit.
One Ray session; the two trainer ranks of ``trainer_pool`` serve both engines.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from sync_service.api import SyncConfig, WeightSync
from sync_service.entrypoints.local import AdapterReplay
from sync_service.merge.export import merge_checkpoint
from sync_service.merge.export_fp8 import Fp8Options
from sync_service.synthetic import make_adapter, make_base
from sync_service.verify.fp8_oracle import quantized_state
from sync_service.verify.peft_oracle import model_state, plain_float64

BLOCK = (16, 16)
SIZES = dict(hidden=32, intermediate=32, num_experts=4, vocab_size=64, num_layers=1)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8_base_sync")
    bf16 = make_base("qwen3_moe", root / "bf16", dtype="bfloat16", **SIZES)
    other = make_adapter("qwen3_moe", bf16, root / "other", kind="target_parameters", r=4, init_scale=0.3, seed=7)
    fp8 = root / "fp8"  # the trainers' base and the FP8 engine's checkpoint
    merge_checkpoint(bf16, other, fp8, quantize="fp8", fp8=Fp8Options(weight_block_size=BLOCK), progress=False)
    lora = make_adapter("qwen3_moe", bf16, root / "lora", kind="target_parameters", r=4, lora_alpha=16,
                        init_scale=0.3, seed=1)
    engine_bf16 = root / "engine-bf16"  # another model of the same shapes: a full sync must replace all of it
    merge_checkpoint(fp8, other, engine_bf16, progress=False)
    return {"fp8": fp8, "lora": lora, "engine-bf16": engine_bf16}


def oracle(fp8_dir: Path, adapter: Path, table) -> dict[str, torch.Tensor]:
    """transformers' dequantized load as a plain float64 model + PEFT's float64 merge, quantized / cast per ``table``."""
    from peft import PeftModel
    from transformers import FineGrainedFP8Config

    from sync_service.engines.hf import load_causal_lm

    config = FineGrainedFP8Config(weight_block_size=list(BLOCK), dequantize=True)
    model = plain_float64(load_causal_lm(fp8_dir, dtype=torch.float64, quantization_config=config))
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return quantized_state(model_state(merged), table)


def served(engine) -> dict[str, torch.Tensor]:
    from sync_service.dtypes import TORCH_DTYPES

    sw = ray.get(engine.served_weights.remote(None, True))
    return {t.name: torch.frombuffer(bytearray(t.values), dtype=TORCH_DTYPES[t.dtype]).reshape(t.shape) for t in sw.tensors}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("engine_dir, to", [("fp8", "float8_e4m3fn"), ("engine-bf16", "bfloat16")])
def test_ep2_trainers_on_an_fp8_base_sync_full_then_delta(files, trainer_pool, tmp_path, engine_dir, to):
    from actors.launch import start_engines, start_trainers

    trainers = start_trainers(files["fp8"], files["lora"], ep=2, reuse=trainer_pool)
    (engine,) = start_engines(files[engine_dir], 1, prefix=f"fp8base-{to}-")
    replay = AdapterReplay(files["lora"])
    sync = WeightSync(trainers=trainers, engines=[engine], config=SyncConfig(
        transport="shm", bucket_bytes=4 << 10, timeout_s=90, reset_versions=True, accumulate_dtype="float64"))
    try:
        assert sync.dtype_conversions == {("float32", to): 6}  # q/k/v/o + fused experts, read dequantized
        table = ray.get(engine.param_metas.remote())
        for v, full in enumerate((True, False)):
            if not full:
                ray.get([t.train_step.remote(v) for t in trainers])
                replay.step(v)
            m = sync.push(v)
            assert m.full == full and all(e.committed for e in m.engines)
            want, got = oracle(files["fp8"], replay.save(tmp_path / f"a{v}"), table), served(engine)
            assert got.keys() == want.keys()
            for name, w in want.items():
                assert got[name].dtype == w.dtype and torch.equal(_bytes(got[name]), _bytes(w)), (to, v, name)
    finally:
        sync.close()
        ray.kill(engine)
