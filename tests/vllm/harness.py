"""Inputs and helpers of the vLLM engine tests: tiny Qwen3-MoE checkpoints, merged versions, pushes.

Versions (per dtype):
- ``base``: the synthetic base checkpoint (H=64, I=32, E=4, 2 layers, vocab 256; H and I multiples
  of 32 so vLLM's CPU grouped-GEMM MoE kernel accepts them).
- ``v_mixed``: LoRA on ``q_proj``/``v_proj`` (not ``k_proj``: a delta that covers only part of vLLM's
  ``qkv_proj``) and on the fused expert tensors (``target_parameters``).
- ``v_experts``: LoRA on the expert tensors only.
Merged checkpoints are PEFT's ``merge_and_unload`` in float64, cast once (``peft_oracle.save_peft_merged``),
never weightsync's merge; the values pushed to the engine are read from those same checkpoints, so the
engine under test and the fresh oracle engines hold the same bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from sync_service.engines.vllm.config import VLLM_ENV

REPO = Path(__file__).resolve().parents[2]
BATCHES = [  # each batch is one generate call, identical in the oracle and the engine under test
    [[1, 5, 6, 7, 8], [1, 9, 10, 11], list(range(3, 50))],
    [list(range(3, 67)) + [200, 201]],  # shares a 64-token prefix (two 32-token blocks) with PREFIX_A
]
PREFIX_A = list(range(3, 67)) + [100]
MAX_NEW_TOKENS = 8
MAX_MODEL_LEN = 128
BLOCK_SIZE = 32
ADAPTERS = {  # version -> make_adapter keyword arguments
    "v_mixed": dict(kind="target_parameters", target_modules=["q_proj", "v_proj"], seed=1),
    "v_experts": dict(kind="target_parameters", target_modules=[], seed=2),
}


@dataclass(frozen=True, slots=True)
class Checkpoints:
    dtype: str
    base: Path
    merged: dict[str, Path]
    adapters: dict[str, Path]


def make_checkpoints(root: Path, dtype: str) -> Checkpoints:
    from sync_service.verify.peft_oracle import save_peft_merged
    from sync_service.synthetic import make_adapter, make_base

    base = make_base("qwen3_moe", root / "base", dtype=dtype, hidden=64, intermediate=32, vocab_size=256, scale=0.1)
    adapters, merged = {}, {}
    for version, kwargs in ADAPTERS.items():
        adapters[version] = make_adapter("qwen3_moe", base, root / f"lora_{version}", r=4, lora_alpha=16, init_scale=0.3, **kwargs)
        merged[version] = save_peft_merged(base, adapters[version], root / version)
    return Checkpoints(dtype=dtype, base=base, merged=merged, adapters=adapters)


def reference_outputs(ckpts: Checkpoints, workdir: Path, timeout_s: float = 600) -> dict:
    """Outputs of fresh plain vLLM engines on each merged checkpoint, from one subprocess."""
    spec = {
        "runs": {v: {"model_dir": str(d), "dtype": ckpts.dtype} for v, d in ckpts.merged.items()},
        "batches": BATCHES, "max_new_tokens": MAX_NEW_TOKENS, "max_model_len": MAX_MODEL_LEN, "block_size": BLOCK_SIZE,
    }
    spec_path, out_path = workdir / "reference_spec.json", workdir / "reference_out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, **VLLM_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.vllm.reference", str(spec_path), str(out_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"reference run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out_path.read_text())


def hf_tensors(ckpts: Checkpoints, version: str) -> dict[str, torch.Tensor]:
    """The tensors of ``version``'s PEFT-merged checkpoint in hf naming (``base``: the base checkpoint's)."""
    return checkpoint_tensors(ckpts.base if version == "base" else ckpts.merged[version])


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def push(engine, version: int, tensors: dict[str, torch.Tensor], names: list[str]) -> dict:
    """One sync of ``names``, each tensor sent as two boxes (dim-0 halves) to exercise box apply."""
    engine.begin_update(version, names)
    for name in names:
        send_halves(engine, name, tensors[name])
    stats = engine.finish_update()
    engine.commit(version)
    return stats


def send_halves(engine, name: str, t: torch.Tensor) -> None:
    rest = tuple((0, n) for n in t.shape[1:])
    h = t.shape[0] // 2
    engine.apply(name, ((0, h),) + rest, t[:h])
    engine.apply(name, ((h, t.shape[0]),) + rest, t[h:])


def outputs(engine) -> list[list[dict]]:
    """The engine's greedy outputs on ``BATCHES`` in the oracle's format."""
    return [
        [{"tokens": g.tokens, "logprobs": g.logprobs} for g in engine.generate_batch(batch, MAX_NEW_TOKENS)]
        for batch in BATCHES
    ]
