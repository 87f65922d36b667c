"""The train/inference mismatch of each way to serve a LoRA-trained policy, measured in one run (docs/benchmarks.md).

    python -m sync_service.bench.mismatch [--sequences 8] [--tokens 128]

One toy model (a bf16 Qwen3-MoE base, H=64, I=32, E=4, vocab 256, and a PEFT adapter on q/v and the fused
experts, fp32 factors), one set of teacher-forced sequences, and per way of serving the mean per-token KL(π_trainer
‖ π_served) (``verify.policy_kl``; π_trainer the unmerged PEFT model in bf16, as the trainer computes it) beside
the floor KL(π_fp32 ‖ π_trainer). Ways of serving (each a real path of this repository or PEFT's):

- ``merged, float64 accumulation, cast once``: PEFT's float64 merge cast once to bf16 (what a sync with
  ``accumulate_dtype="float64"`` serves, bit for bit).
- ``merged, float32 accumulation, cast once``: the merge core's output (``weightsync merge``, float32
  accumulation; a sync's default serves these bytes).
- ``factor mode``: an in-process sync whose engine merges the streamed factors (``factor_stream.LocalSync``,
  ``mode="factors"``), the engine's bytes loaded into the model.
- ``naive bf16 merge``: PEFT's own ``merge_and_unload`` on the bf16 model (the delta rounded to bf16, then added
  in bf16).
- ``block-FP8 engine``: ``weightsync merge --quantize fp8`` (16x16 blocks, float64 accumulation) served by the
  transformers engine (FP8 values and scales, computing with transformers' dequantization).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

__all__ = ["measure"]


def _engine_logprobs(engine, sequences) -> list[torch.Tensor]:
    return engine.token_logprobs(sequences)[1]


def measure(work: Path, *, sequences: int = 8, tokens: int = 128) -> list[tuple[str, float]]:
    """``[(row, KL nats/token)]``: the floor first, then each way of serving (module docstring)."""
    from peft import PeftConfig, PeftModel
    from safetensors.torch import load_file

    from protocols.params import full_box
    from sync_service.engines.hf import HFEngine, load_causal_lm
    from sync_service.factor_stream.choose import FactorPolicy
    from sync_service.factor_stream.local import LocalSync, LocalSyncConfig
    from sync_service.merge.base import SafetensorsBase
    from sync_service.merge.export import merge_checkpoint
    from sync_service.merge.export_fp8 import Fp8Options
    from sync_service.synthetic import make_adapter, make_base
    from sync_service.verify.peft_oracle import peft_merged_model
    from sync_service.verify.policy_kl import (mean_kl, model_logprobs, policy_floor, trainer_policy,
                                               verification_sequences)

    base = Path(make_base("qwen3_moe", work / "base", dtype="bfloat16", hidden=64, intermediate=32, vocab_size=256,
                          scale=0.1))
    lora = Path(make_adapter("qwen3_moe", base, work / "lora", r=4, lora_alpha=16, init_scale=0.3,
                             kind="target_parameters", target_modules=["q_proj", "v_proj"], seed=1))
    seqs = verification_sequences(256, count=sequences, length=tokens)
    trainer = model_logprobs(trainer_policy(base, lora, torch.bfloat16), seqs)
    rows = [("floor: KL(fp32 unmerged || bf16 unmerged)", policy_floor(base, lora, seqs, trainer, torch.bfloat16))]

    def kl_of(model: torch.nn.Module) -> float:
        return mean_kl(trainer, model_logprobs(model, seqs))

    rows.append(("merged, float64 accumulation, cast once", kl_of(peft_merged_model(base, lora, dtype=torch.bfloat16))))
    merge_checkpoint(base, lora, work / "merged32", accumulate_dtype="float32", progress=False)
    rows.append(("merged, float32 accumulation, cast once", kl_of(load_causal_lm(work / "merged32", dtype=torch.bfloat16))))
    ckpt = SafetensorsBase(base)
    tensors = {m.name: ckpt.read(m.name, full_box(m.shape)).clone() for m in ckpt.metas()}
    run = LocalSync(tensors, ckpt.layout, PeftConfig.from_pretrained(str(lora)),
                    config=LocalSyncConfig(policy=FactorPolicy(mode="factors")))
    try:
        state = load_file(str(lora / "adapter_model.safetensors"))
        run.push(0, state)  # the full sync: the pristine base
        run.push(1, state)  # the factor delta: the engine merges
        served = run.engine_state()
    finally:
        run.close()
    model = load_causal_lm(base, dtype=torch.bfloat16)
    model.load_state_dict(served, strict=False)
    rows.append(("factor mode (the engine merges the streamed factors)", kl_of(model)))
    naive = PeftModel.from_pretrained(load_causal_lm(base, dtype=torch.bfloat16), str(lora)).merge_and_unload()
    rows.append(("naive bf16 merge (PEFT merge_and_unload on the bf16 model)", kl_of(naive)))
    merge_checkpoint(base, lora, work / "fp8", accumulate_dtype="float64", quantize="fp8",
                     fp8=Fp8Options(weight_block_size=(16, 16)), progress=False)
    rows.append(("block-FP8 engine (16x16 blocks, float64 accumulation)",
                 mean_kl(trainer, _engine_logprobs(HFEngine.from_pretrained(work / "fp8"), seqs))))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m sync_service.bench.mismatch", description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="wsmismatch") as tmp:
        rows = measure(Path(tmp), sequences=args.sequences, tokens=args.tokens)
    floor = rows[0][1]
    print("| served policy | KL(π_trainer ‖ π_served), nats/token | × floor |")
    print("|---|---|---|")
    for name, kl in rows:
        print(f"| {name} | {kl:.3e} | {kl / floor:.2f} |")


if __name__ == "__main__":
    main()
