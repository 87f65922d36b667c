"""Expert parallelism given by DTensors: 2 gloo processes hold the PEFT model with every fused expert tensor
and expert LoRA factor a ``DTensor`` placed ``(Shard(0),)`` on a 1-D expert-parallel mesh (rank k: expert
block k), attention replicated; no ``expert_range=``. Each rank's merged boxes tile the model and equal PEFT's
``merge_and_unload`` in float64 (cast once)."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.multiprocessing as mp

from tests.trainer.conftest import peft_merged


def _distribute_experts(peft, mesh) -> int:
    """Every parameter under ``.experts.`` (base and LoRA factors) → a DTensor ``(Shard(0),)`` on ``mesh``."""
    from torch.distributed.tensor import Shard, distribute_tensor

    moved = 0
    for name, p in list(peft.named_parameters()):
        if ".experts." in name:
            owner, leaf = name.rsplit(".", 1)
            dt = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]), requires_grad=p.requires_grad)
            setattr(peft.get_submodule(owner), leaf, dt)
            moved += 1
    return moved


def _worker(rank: int, world: int, init: str, base_dir: str, out: str) -> None:
    import torch.distributed as dist
    from peft import get_peft_model, get_peft_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from sync_service.live import build_endpoint
    from sync_service.live.example import _randomize_lora, lora_config

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), lora_config())
        _randomize_lora(peft, 0, ep=False)  # the same whole adapter on every rank
        if rank == 0:
            torch.save({k: v.detach().clone() for k, v in get_peft_model_state_dict(peft).items()},
                       os.path.join(out, "adapter.pt"))
        moved = _distribute_experts(peft, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
        endpoint = build_endpoint(peft, group=dist.new_group(backend="gloo"), rank=rank, world=world, timeout_s=120)
        endpoint.state.snapshot(1)
        source = endpoint.state.source(1)
        boxes = []
        for meta in endpoint.state.owned():
            buf = torch.empty([b - a for a, b in meta.box], dtype=source.out_dtype(meta.name))
            source.fill(meta.name, meta.box, buf)
            boxes.append((meta.name, meta.box, buf))
        torch.save({"moved": moved, "boxes": boxes}, os.path.join(out, f"r{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_expert_dtensors_on_an_ep_mesh_merge_their_expert_blocks(bases, tmp_path):
    base = bases["qwen3_moe"]
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, os.path.join(d, "init"), str(base), d), nprocs=2, join=True)
        results = [torch.load(os.path.join(d, f"r{k}.pt")) for k in range(2)]
        adapter = torch.load(os.path.join(d, "adapter.pt"))
    oracle = peft_merged(base, adapter, tmp_path / "oracle")
    assert all(r["moved"] == 2 * 2 * 3 for r in results)  # 2 layers x (gate_up, down) x (base, A, B)
    covered = {name: torch.zeros(t.shape, dtype=torch.int32) for name, t in oracle.items()}
    for k, r in enumerate(results):
        for name, box, got in r["boxes"]:
            index = tuple(slice(a, b) for a, b in box)
            if ".experts." in name:  # rank k merges exactly its expert block
                assert box[0] == (k * 2, k * 2 + 2), (name, box)
            torch.testing.assert_close(got, oracle[name][index], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
            covered[name][index] += 1
    assert all(bool((c == 1).all()) for c in covered.values()), "the ranks' boxes do not tile every tensor once"
