"""Factor deltas move only changed blocks; a receiver without the pristine base is never merged into;
``auto`` chooses per tensor within the receiver's memory budget."""

from __future__ import annotations

import pytest

from sync_service.factor_stream.choose import FactorPolicy, TargetCost, choose
from sync_service.factor_stream.local import LocalSync, LocalSyncConfig
from sync_service.factor_stream.receiver import FactorEngine
from tests.factor_stream.conftest import differing, train_step

A_KEY = "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"  # gate_up, [r·E, H] expert-major
B_KEY = "base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight"  # gate_up, [2I, r·E] rank-major
R, E = 2, 4


def pair(model, policy: FactorPolicy, ep: int = 2) -> dict[str, LocalSync]:
    return {mode: LocalSync(model.tensors, model.layout, model.peft_config, config=LocalSyncConfig(
        ep=ep, bucket_bytes=8 << 10, policy=FactorPolicy(mode=mode, experts_per_recipe=1) if mode == "merged" else policy))
        for mode in ("merged", policy.mode)}


def test_delta_of_one_expert_moves_only_its_block(model_factory):
    model = model_factory("qwen3_moe", "float32")
    runs = pair(model, FactorPolicy(mode="factors", experts_per_recipe=1))
    try:
        state = dict(model.state)
        for run in runs.values():
            run.push(0, state)
        state = dict(state)
        state[A_KEY] = state[A_KEY].clone()
        state[A_KEY][1 * R:2 * R] += 0.5                      # expert 1's A rows
        state[B_KEY] = state[B_KEY].clone()
        state[B_KEY][:, [k * E + 1 for k in range(R)]] -= 0.25  # expert 1's B columns
        stats = {mode: run.push(1, state) for mode, run in runs.items()}
        rows, cols = 2 * model.tensors["model.layers.0.mlp.experts.gate_up_proj"].shape[1] // 2, 16
        assert stats["factors"].bytes == (rows * R + R * cols) * 4  # x [1, 2I, r] + y [1, r, H], fp32
        assert stats["merged"].bytes > 20 * stats["factors"].bytes
        assert not differing(runs["merged"].engine_state(), runs["factors"].engine_state())
        # nothing changed: a delta moves nothing, the engine still commits the version
        assert runs["factors"].push(2, state).bytes == 0
        assert runs["factors"].memory.weight_version() == 2
    finally:
        for run in runs.values():
            run.close()


def test_receiver_without_pristine_base_fails_delta_then_full_sync_fixes_it(model_factory):
    model = model_factory("mixtral", "bfloat16")
    runs = pair(model, FactorPolicy(mode="factors", experts_per_recipe=2))
    factors = runs["factors"]
    try:
        state = dict(model.state)
        for v in range(2):
            state = train_step(state, v) if v else state
            for run in runs.values():
                run.push(v, state)
        served = factors.engine_state()
        factors.engine = FactorEngine(factors.memory, factors.plan)  # a restarted receiver: no pristine copies
        assert not factors.engine.factor_ready() and factors.engine.resident_bytes() == 0
        state = train_step(state, 2)
        with pytest.raises(RuntimeError, match="no pristine base copy.*needs a full sync"):
            factors.push(2, state, full=False)
        assert factors.memory.weight_version() == 1 and not differing(factors.engine_state(), served)
        factors.push(2, state, full=True)
        runs["merged"].push(2, state)
        assert factors.engine.factor_ready()
        assert not differing(runs["merged"].engine_state(), factors.engine_state())
    finally:
        for run in runs.values():
            run.close()


def test_auto_stays_within_the_memory_budget_and_stays_equal(model_factory):
    model = model_factory("gpt_oss", "bfloat16")
    probe = pair(model, FactorPolicy(mode="factors"))
    try:
        probe["factors"].push(0, model.state)
        experts = [n for n in probe["factors"].choice.factors if ".experts." in n]
        one = model.tensors[experts[0]].numel() * 2
    finally:
        for run in probe.values():
            run.close()
    runs = pair(model, FactorPolicy(mode="auto", factor_memory_bytes=2 * one, min_saving=1.5, experts_per_recipe=2))
    try:
        state = dict(model.state)
        for v in range(2):
            state = train_step(state, v) if v else state
            for run in runs.values():
                run.push(v, state)
        choice = runs["auto"].choice
        assert 0 < choice.pristine_bytes <= 2 * one and len(choice.factors) >= 1
        assert "merged: receiver memory budget" in choice.reasons.values()
        assert runs["auto"].engine.resident_bytes() >= choice.pristine_bytes
        assert not differing(runs["merged"].engine_state(), runs["auto"].engine_state())
    finally:
        for run in runs.values():
            run.close()
    with pytest.raises(ValueError, match="factor_memory_bytes=10.*mode='auto'"):
        pair(model, FactorPolicy(mode="factors", factor_memory_bytes=10))["factors"].push(0, model.state)


def test_choose_ranks_by_saving_per_resident_byte():
    costs = [TargetCost(name="big", merged_bytes=1000, factor_bytes=10, pristine_bytes=1000),
             TargetCost(name="thin", merged_bytes=100, factor_bytes=80, pristine_bytes=100),
             TargetCost(name="dora", merged_bytes=100, factor_bytes=1, pristine_bytes=100, why_not="DoRA is not additive")]
    auto = choose(costs, FactorPolicy(mode="auto"))
    assert auto.factors == {"big"} and auto.reasons["thin"].startswith("merged: factors save")
    assert auto.factor_bytes_per_version == 10 + 100 + 100 and auto.merged_bytes_per_version == 1200
    assert choose(costs, FactorPolicy(mode="auto", factor_memory_bytes=999)).factors == frozenset()
    assert choose(costs, FactorPolicy(mode="factors")).factors == {"big", "thin"}
    assert choose(costs, FactorPolicy(mode="merged")).factors == frozenset()
    with pytest.raises(ValueError, match="mode='fast'"):
        FactorPolicy(mode="fast")


def test_factor_streaming_row_reports_bytes_and_equality():
    from sync_service.bench.factors import factor_streaming_row

    row = factor_streaming_row("qwen3_moe", dtype="bfloat16", num_experts=4, hidden=32, intermediate=16, r=2, ep=2)
    assert set(row) == {"bytes", "merged_bytes", "seconds", "bitwise_equal", "engine_extra_bytes"}
    assert row["bitwise_equal"] and 0 < row["bytes"] < row["merged_bytes"] and row["seconds"] > 0
    assert row["engine_extra_bytes"] >= row["merged_bytes"]  # the resident pristine copies of every target
