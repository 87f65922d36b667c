"""``ShardGather`` on 3 gloo processes: uneven and empty ``Shard(0)`` chunks (r=2 over 3 ranks, as
FSDP2 leaves a LoRA rank dim smaller than the world), ``Shard(1)`` (B's rank dim) and ``Replicate``,
whole factors back, the same buffers reused."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.multiprocessing as mp

SHAPES = {"a.lora_A.weight": (2, 5), "a.lora_B.weight": (7, 2), "e.lora_A.weight": (8, 3),
          "h.lora_B.weight": (4, 2), "c.lora_B.weight": (5, 2), "r.lora_A.weight": (2, 3)}
PLACEMENTS = {"c.lora_B.weight": "shard1", "r.lora_A.weight": "replicate"}  # the others: Shard(0)


def _full(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    out = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    out["h.lora_B.weight"] = out["h.lora_B.weight"].to(torch.bfloat16)  # a second dtype: its own flat buffer
    return out


def _worker(rank: int, world: int, init: str, result: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from sync_service.live.gather import ShardGather
    from sync_service.live.model import LiveParam

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        group = dist.new_group(backend="gloo")
        place = {"shard1": [Shard(1)], "replicate": [Replicate()]}
        at = {k: place.get(PLACEMENTS.get(k, ""), [Shard(0)]) for k in SHAPES}
        params = {k: LiveParam(k, distribute_tensor(t, mesh, at[k]), tuple(t.shape)) for k, t in _full(0).items()}
        gather = ShardGather(params, group=group, rank=rank, world=world, timeout_s=60)
        gather.exchange()
        ptrs, ok = {k: t.data_ptr() for k, t in gather.full.items()}, []
        for step in range(2):
            local = {k: distribute_tensor(t, mesh, at[k]).to_local() for k, t in _full(step).items()}
            out = gather.gather(local)
            ok.append(all(torch.equal(out[k], t) for k, t in _full(step).items()))
            ok.append({k: t.data_ptr() for k, t in out.items()} == ptrs)
        torch.save({"ok": ok, "rows": {k: tuple(p.local().shape) for k, p in params.items()}},
                   os.path.join(result, f"r{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_uneven_and_empty_chunks_gather_into_reused_buffers():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(3, os.path.join(d, "init"), d), nprocs=3, join=True)
        results = [torch.load(os.path.join(d, f"r{r}.pt")) for r in range(3)]
    assert [r["rows"]["a.lora_A.weight"] for r in results] == [(1, 5), (1, 5), (0, 5)]  # rank 2 holds none
    assert [r["rows"]["a.lora_B.weight"] for r in results] == [(3, 2), (3, 2), (1, 2)]
    assert [r["rows"]["c.lora_B.weight"] for r in results] == [(5, 1), (5, 1), (5, 0)]  # Shard(1): columns
    for r in results:
        assert r["ok"] == [True, True, True, True], r["ok"]
