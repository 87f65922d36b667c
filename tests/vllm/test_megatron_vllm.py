"""``attach_megatron`` into the session's shared vLLM server (``vllm_server``, ``tests/vllm/shared_server.py``): 2
Megatron-Core Ray-actor ranks at EP=2 (TP=1: the shared checkpoint has one key/value head) with Megatron-Bridge LoRA
push a full version and a delta (a seeded adapter change); the server's teacher-forced next-token log-probabilities
equal Megatron's own forward of the unmerged LoRA model within ``BOUND`` (fp32), argmax tokens equal."""

from __future__ import annotations

import importlib.util

import pytest
import ray
import torch

if importlib.util.find_spec("megatron.bridge") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("Megatron-Core / Megatron-Bridge not installed (scripts/setup-megatron.sh)", allow_module_level=True)

BOUND = 1e-5  # fp32 log-probabilities, vLLM's CPU kernels vs Megatron's local spec (measured 1.7e-6 - 2.0e-6, 2026-12-05)


def test_megatron_ranks_push_into_the_shared_vllm_server(ray_local, vllm_server):
    from actors.vllm_server import VLLMServer
    from sync_service.api import SyncConfig, WeightSync
    from sync_service.entrypoints.megatron_rank import TOKENS, start_megatron_ranks

    ranks, mesh = start_megatron_ranks(str(vllm_server.base), world=2, ep=2, seed=5, timeout_s=600)
    engine = None
    try:
        assert mesh == {"tp": 1, "ep": 2, "etp": 1, "pp": 1, "dp": 2}
        handles = ray.get([r.attach.remote() for r in ranks], timeout=300)
        engine = VLLMServer(vllm_server.url, name="megatron-server")
        first = vllm_server.next_version()
        sync = WeightSync(trainers=handles, engines=[engine], config=SyncConfig(transport="shm", timeout_s=120))
        try:
            for v, seed in ((first, None), (first + 1, 6)):
                if seed is not None:
                    ray.get([r.randomize_adapters.remote(seed) for r in ranks], timeout=120)
                m = sync.push(v)
                assert m.full == (seed is None) and m.engines[0].committed
                logits = [x for x in ray.get([r.logits.remote() for r in ranks], timeout=300) if x is not None][0][0]
                want = torch.log_softmax(torch.from_numpy(logits).double(), -1)[:-1]
                (lp,), served = ray.get(engine.token_logprobs.remote([TOKENS[0].tolist()]), timeout=120)
                got = torch.from_numpy(lp).double()
                worst = (got - want).abs().max().item()
                print(f"vLLM server v{v} vs Megatron's forward", worst)
                assert served == v and worst <= BOUND
                assert torch.equal(got.argmax(-1), want.argmax(-1))
        finally:
            sync.close()
    finally:
        for a in (*ranks, *([engine] if engine is not None else [])):
            ray.kill(a)
