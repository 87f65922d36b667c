"""The train/inference mismatch the verification reports (``verify.policy_kl``): ``versions[].engines[].policy_kl``
(KL(π_trainer ‖ π_engine), π_trainer the unmerged PEFT model in the trainer's dtype) beside
``versions[].policy_kl_floor`` (KL(π_fp32 ‖ π_trainer)), on a bf16 trainer and engine through the console script;
the KL itself against closed forms."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from sync_service.synthetic import make_adapter, make_base
from sync_service.verify.policy_kl import (mean_kl, model_logprobs, policy_floor, trainer_policy,
                                           verification_sequences)
from tests.cli.test_cli_subprocess import weightsync


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("policy_kl")
    base = make_base("qwen3_moe", root / "base", dtype="bfloat16", hidden=64, intermediate=32, vocab_size=256, scale=0.1)
    lora = make_adapter("qwen3_moe", base, root / "lora", r=4, lora_alpha=16, init_scale=0.3, kind="target_parameters",
                        target_modules=["q_proj", "v_proj"], seed=1)
    return {"base": Path(base), "lora": Path(lora)}


def test_mean_kl_is_the_closed_form():
    p = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]]), -1)
    q = torch.log_softmax(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 3.0]]), -1)
    want = sum(float((a.exp() * (a - b)).sum()) for a, b in zip(p, q)) / 2
    assert mean_kl([p], [q]) == pytest.approx(want, rel=1e-6) and want > 0.1
    assert mean_kl([p, p], [p, p]) == 0.0
    zero = torch.tensor([[0.0, float("-inf")]])  # p puts no mass on token 1: that term is 0, not nan
    assert mean_kl([zero], [torch.log(torch.tensor([[0.5, 0.5]]))]) == pytest.approx(math.log(2))
    with pytest.raises(ValueError, match="shapes differ"):
        mean_kl([p], [q[:1]])
    # an engine's float32 log-softmax normalized 1e-6 off (every log q shifted up): the same distribution, KL 0, never
    # negative (measured -4.7e-9 on a vLLM engine before the inputs were renormalized)
    assert 0.0 <= mean_kl([p], [p + 1e-6]) < 1e-12 and 0.0 <= mean_kl([p + 1e-6], [p]) < 1e-12


def test_floor_is_zero_for_fp32_and_positive_for_bf16(bf16):
    seqs = verification_sequences(256, count=2, length=16)
    assert seqs == verification_sequences(256, count=2, length=16) and len(seqs[0]) == 16
    trainer = model_logprobs(trainer_policy(bf16["base"], bf16["lora"]), seqs)  # the checkpoint's dtype: bf16
    assert trainer[0].shape == (15, 256) and trainer[0].dtype == torch.float32
    assert policy_floor(bf16["base"], bf16["lora"], seqs, trainer, torch.float32) == 0.0
    floor = policy_floor(bf16["base"], bf16["lora"], seqs, trainer, torch.bfloat16)
    assert 0.0 < floor < 0.1, floor


def test_bf16_sync_reports_policy_kl_beside_the_floor(bf16, tmp_path):
    """A bf16 trainer into a bf16 HF engine with float64 accumulation: the engine serves PEFT's float64 merge cast
    once, so its policy_kl is that model's KL from the unmerged bf16 policy, recomputed here; the floor is the
    fp32 policy's KL to the bf16 one."""
    from sync_service.verify.peft_oracle import peft_merged_model
    from sync_service.verify.policy_kl import SEQUENCES, SEQUENCE_TOKENS

    out = tmp_path / "run.json"
    rc, err, _ = weightsync(["sync", "--base", str(bf16["base"]), "--adapter", str(bf16["lora"]), "--ep", "1",
                             "--engines", "1", "--versions", "1", "--accumulate-dtype", "float64", "--json", str(out)],
                            ray_allowed=True)
    assert rc == 0, err[-3000:]
    (row,) = json.loads(out.read_text())["versions"]
    (engine,) = row["engines"]
    seqs = verification_sequences(256, count=SEQUENCES, length=SEQUENCE_TOKENS)
    trainer = model_logprobs(trainer_policy(bf16["base"], bf16["lora"]), seqs)
    served = model_logprobs(peft_merged_model(bf16["base"], bf16["lora"], dtype=torch.bfloat16), seqs)
    assert row["policy_kl_floor"] == pytest.approx(policy_floor(bf16["base"], bf16["lora"], seqs, trainer,
                                                                torch.bfloat16), rel=1e-6)
    assert row["policy_kl_floor"] > 0.0
    assert engine["verified"] and engine["weights_bitwise"], engine
    assert engine["policy_kl"] == pytest.approx(mean_kl(trainer, served), rel=0.05) and engine["policy_kl"] > 0.0
