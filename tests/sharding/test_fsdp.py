"""FSDP2-style DTensor dim-0 shards on a CPU DeviceMesh (gloo, 2 real processes), read as a live base."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.multiprocessing as mp


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"model.layers.0.mlp.experts.gate_up_proj": torch.randn(5, 6, 4, generator=g),  # uneven: 3 + 2 rows
            "model.norm.weight": torch.randn(4, generator=g),
            "model.layers.0.mlp.gate.weight": torch.randn(1, 4, generator=g)}               # rank 1 holds nothing


def _worker(rank: int, world: int, init_file: str, result_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from sync_service.live.base import live_base
    from sync_service.live.model import LiveParam

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = full_tensors()
        params = {n: LiveParam(n, distribute_tensor(t, mesh, [Shard(0)]), tuple(t.shape)) for n, t in full.items()}
        base = live_base(params, layout=None, tied_aliases={}, rank=rank, world=world, experts=None)
        covered = {n: torch.zeros(t.shape) for n, t in full.items()}
        for meta in base.owned():
            box = meta.covered_box()
            sl = tuple(slice(a, b) for a, b in box)
            assert torch.equal(base.read(meta.name, box), full[meta.name][sl]), meta
            covered[meta.name][sl] += 1
        torch.save(covered, os.path.join(result_dir, f"cov{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_dtensor_shards_cover_every_element_once():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, os.path.join(d, "init"), d), nprocs=2, join=True)
        cov = [torch.load(os.path.join(d, f"cov{r}.pt")) for r in range(2)]
    for name, t in full_tensors().items():
        total = cov[0][name] + cov[1][name]
        assert torch.all(total == 1), name
    assert cov[0]["model.layers.0.mlp.experts.gate_up_proj"][:3].eq(1).all()
    assert cov[1]["model.layers.0.mlp.experts.gate_up_proj"][3:].eq(1).all()
