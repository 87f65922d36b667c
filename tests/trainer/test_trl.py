"""TRL ``GRPOTrainer`` (CPU, one rank in a Ray actor) with PEFT LoRA on attention + experts and the
``WeightSyncCallback``: after each of 3 optimizer steps every engine equals PEFT's float64 merge of
the trainer's adapter at that step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.trainer.conftest import peft_merged, ray

pytest.importorskip("trl")


@ray.remote(num_cpus=0, max_concurrency=2)
class TRLRank:
    """A user's TRL training process."""

    def run(self, base_dir: str, engines: list, out_dir: str) -> list:
        from datasets import Dataset
        from peft import get_peft_model_state_dict
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer

        from sync_service.api import SyncConfig
        from sync_service.integrations.trl import WeightSyncCallback
        from tests.trainer.harness import lora_config

        torch.set_num_threads(1)
        records = []

        def on_push(version, metrics, model):
            adapter = {k: v.detach().numpy().copy() for k, v in get_peft_model_state_dict(model).items()}
            records.append((version, metrics.full, adapter, ray.get(engines[0].state.remote(), timeout=120)))

        args = GRPOConfig(output_dir=out_dir, use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=6, max_steps=3, learning_rate=5e-2, report_to=[], save_strategy="no",
                          logging_steps=1, bf16=False, gradient_checkpointing=False, seed=0)
        prompts = Dataset.from_dict({"prompt": ["the red cat", "a big dog", "one two three", "up down left"] * 4})
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
            reward_funcs=lambda completions, **kw: [float(len(set(c.split()))) for c in completions],
            args=args, train_dataset=prompts, processing_class=AutoTokenizer.from_pretrained(base_dir),
            peft_config=lora_config(),
            callbacks=[WeightSyncCallback(engines=engines, config=SyncConfig(transport="shm", bucket_bytes=16 << 10,
                                                                              timeout_s=120), on_push=on_push)])
        trainer.train()
        return records


def test_grpo_trainer_pushes_every_optimizer_step(ray_local, bases, tmp_path):
    from actors.launch import start_engines

    family = "qwen3_moe"
    engines = start_engines(bases[family], 1, prefix="trl")
    rank = TRLRank.remote()
    try:
        records = ray.get(rank.run.remote(str(bases[family]), engines, str(tmp_path / "out")), timeout=600)
    finally:
        ray.kill(rank)
    assert [v for v, *_ in records] == [0, 1, 2, 3]
    assert [full for _, full, *_ in records] == [True, False, False, False]
    first, last = records[0][2], records[-1][2]
    assert any(not np.array_equal(first[k], last[k]) for k in first), "GRPO steps changed no LoRA factor"
    assert any(".experts." in k for k in first)
    for version, _, adapter, engine_state in records:
        oracle = peft_merged(bases[family], {k: torch.from_numpy(v) for k, v in adapter.items()}, tmp_path / f"v{version}")
        for name, ref in oracle.items():
            torch.testing.assert_close(torch.from_numpy(engine_state[name]), ref, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"version {version}: {n}: {m}")
    for e in engines:
        ray.kill(e)
