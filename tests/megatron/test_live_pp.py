"""``attach_megatron`` over pipeline stages: 2 Ray-actor ranks at PP=2 (each stage owns its layers, layer numbers
global; the embedding on the first stage, the output layer on the last), pushed into a transformers engine full then
delta and judged by Megatron's own forward across the stages (``test_live.py``'s oracle and bound)."""

from __future__ import annotations

import pytest
import ray

from tests.megatron.test_live import assert_serves_megatron, engine_logprobs, megatron_logprobs, reseed


@pytest.fixture(scope="module")
def stages(ray_local, hf_model):
    from sync_service.entrypoints.megatron_rank import start_megatron_ranks

    ranks, mesh = start_megatron_ranks(str(hf_model), world=2, pp=2, seed=3, timeout_s=600)
    handles = ray.get([r.attach.remote() for r in ranks], timeout=300)
    yield {"ranks": ranks, "handles": handles, "mesh": mesh, "hf": hf_model}
    for r in ranks:
        ray.kill(r)


def test_each_stage_sends_its_own_layers_full_then_delta(stages):
    from actors.launch import start_engines
    from sync_service.api import SyncConfig, WeightSync

    ranks, handles = stages["ranks"], stages["handles"]
    assert stages["mesh"] == {"tp": 1, "ep": 1, "etp": 1, "pp": 2, "dp": 1}
    first, last = (ray.get(h.owned_metas.remote(), timeout=60) for h in handles)
    names = [{m.name for m in metas} for metas in (first, last)]
    assert "model.embed_tokens.weight" in names[0] and "lm_head.weight" in names[1] and "model.norm.weight" in names[1]
    assert all(".layers.0." in n for n in names[0] if ".layers." in n)
    assert all(".layers.1." in n for n in names[1] if ".layers." in n)
    (engine,) = start_engines(stages["hf"], 1, prefix="mpp")
    base_lp, _ = engine_logprobs(engine)
    sync = WeightSync(trainers=handles, engines=[engine], config=SyncConfig(transport="shm", timeout_s=120))
    try:
        assert sync.push(0).full
        print("pp v0 full", assert_serves_megatron(engine, ranks, 0))
        assert (megatron_logprobs(ranks) - base_lp).abs().max() > 0.05
        reseed(ranks, 4)
        assert not sync.push(1).full
        print("pp v1 delta", assert_serves_megatron(engine, ranks, 1))
    finally:
        sync.close()
        ray.kill(engine)
