"""A live PEFT model pushed from its own device: the same code on CPU (here) and CUDA (``gpu``-marked, skipped
without CUDA). One process, no group: ``build_endpoint`` over the model on ``device``, a real shm channel (host
buckets) into an ``HFEngine`` on ``device``, a full sync then a delta after an AdamW step, each served state
checked by the shared verifier against PEFT's float64 merge cast once. On CUDA the merge runs on the GPU into a
staging bucket there and each bucket crosses to the host slot in one copy (``transports.devices.stage_device``)."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from protocols.endpoints import OpenChannel, SendRequest
from protocols.wire import encode

DEVICES = ["cpu", "cpu-staged", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the CUDA push runs where one is lent (scripts/gpu-check.sh)")])]
"""``cpu-staged``: the CPU run of the staging path CUDA parameters take into host buckets (a staging bucket on the
merge's device, one copy per bucket), set on the sender as ``open_transport`` sets it for CUDA."""


def _sync(endpoint, engine, transport, plan, version: int, names) -> int:
    """Receive (thread) + send of ``version``, then commit; the payload bytes."""
    from sync_service.streaming.receiver import BucketReceiver

    receiver = BucketReceiver(engine, plan, receiver=0, secret=b"k" * 32)
    got = {}
    th = threading.Thread(target=lambda: got.update(r=receiver.receive_sync(transport, timeout_s=120, commit=False)))
    th.start()
    endpoint.send(SendRequest(owner="t", session=f"s{version}", version=version, names=names, timeout_s=120,
                              accumulate_dtype="float64"))
    th.join(120)
    engine.commit(version)
    return got["r"].payload_bytes


@pytest.mark.parametrize("device", DEVICES)
def test_live_model_on_its_device_pushes_what_peft_merges(device, tmp_path):
    device, staged = device.removesuffix("-staged"), device.endswith("-staged")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from sync_service.coordinator import build_sync_plan
    from sync_service.engines.hf import HFEngine
    from sync_service.live import build_endpoint
    from sync_service.synthetic import make_base
    from sync_service.transports import TransportSpec, open_receiver
    from sync_service.verify.peft_oracle import compare_state, peft_merged_state

    base_dir = make_base("qwen3_moe", tmp_path / "base", num_experts=4, num_layers=1, hidden=32)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32),
                          LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft.to(device)
    endpoint = build_endpoint(peft, group=None, rank=0, world=1)
    assert endpoint.state.device.type == device
    engine = HFEngine.from_pretrained(base_dir, device=device)
    plan = build_sync_plan([list(endpoint.owned_metas())], bucket_bytes=1 << 16)
    spec = TransportSpec(kind="shm", name="dev" + uuid.uuid4().hex[:8], bucket_bytes=plan.bucket_bytes)
    endpoint.open_transport(OpenChannel(owner="t", spec=spec.to_bytes(), plan=encode(plan), index=0, secret=b"k" * 32))
    transport = open_receiver(spec, receiver=0)
    sender = endpoint.channels["t"][0]
    assert (sender.stage_device is None) == (device == "cpu")  # CUDA: merge on the GPU, one copy per host bucket
    if staged:
        sender.stage_device = torch.device(device)
    optimizer = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.arange(8, device=device).view(1, 8)
    sizes = []
    try:
        for version in range(2):
            changed = endpoint.snapshot(version).changed
            sizes.append(_sync(endpoint, engine, transport, plan, version, None if changed is None else sorted(changed)))
            peft.save_pretrained(str(tmp_path / f"lora{version}"))
            oracle = peft_merged_state(base_dir, tmp_path / f"lora{version}",
                                       dtypes={m.name: m.dtype for m in engine.param_metas()})
            served = {n: t.detach().cpu() for n, t in engine.state_dict().items()}
            assert {t.device.type for t in engine.state_dict().values()} == {device}
            check = compare_state(served, oracle)
            assert check.ok, (version, check)
            peft(input_ids=ids, labels=ids).loss.backward()  # one training step on the device
            optimizer.step()
            optimizer.zero_grad()
    finally:
        endpoint.close_transport()
        transport.close()
    assert sizes[1] < sizes[0]  # the delta sends the LoRA-touched tensors only
    assert sender.stage_bytes == (plan.bucket_bytes if sender.stage_device is not None else 0)
