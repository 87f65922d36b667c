"""Trainer-side EP / TP sharding: pieces, ownership, global->local reads, factor all-gather over gloo."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from sync_service.sharding import ShardSpec, gather_factors, local_factors, shard_tensors

E, H, I = 4, 6, 4
L0 = "model.layers.0"


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        f"{L0}.self_attn.q_proj.weight": torch.randn(8, H, generator=g),
        f"{L0}.self_attn.o_proj.weight": torch.randn(H, 8, generator=g),
        f"{L0}.mlp.gate.weight": torch.randn(E, H, generator=g),
        f"{L0}.mlp.experts.gate_up_proj": torch.randn(E, 2 * I, H, generator=g),
        f"{L0}.mlp.experts.down_proj": torch.randn(E, H, I, generator=g),
        "model.norm.weight": torch.randn(H, generator=g),
    }


@pytest.mark.parametrize("ep,tp", [(2, 1), (1, 2), (2, 2), (4, 1)])
def test_owned_boxes_cover_every_element_exactly_once(ep, tp):
    full = full_state()
    count = {n: torch.zeros_like(t) for n, t in full.items()}
    for rank in range(ep * tp):
        base = shard_tensors(full, ShardSpec(rank=rank, ep=ep, tp=tp))
        assert [m.name for m in base.metas()] == list(full)
        for meta in base.owned():
            box = meta.covered_box()
            sl = tuple(slice(a, b) for a, b in box)
            assert torch.equal(base.read(meta.name, box), full[meta.name][sl])
            count[meta.name][sl] += 1
    for name, c in count.items():
        assert torch.all(c == 1), name


def test_tp_rank_holds_gate_and_up_shards_stacked():
    full = full_state()
    gu = full[f"{L0}.mlp.experts.gate_up_proj"]
    for t in range(2):
        base = shard_tensors(full, ShardSpec(rank=t, ep=1, tp=2))
        local = base.local_tensors()[f"{L0}.mlp.experts.gate_up_proj"]
        h = I // 2
        expected = torch.cat([gu[:, t * h:(t + 1) * h], gu[:, I + t * h:I + (t + 1) * h]], dim=1)
        assert torch.equal(local, expected)
        owned = [m.box for m in base.owned() if m.name.endswith("gate_up_proj")]
        assert owned == [((0, E), (t * h, (t + 1) * h), (0, H)), ((0, E), (I + t * h, I + (t + 1) * h), (0, H))]
        down = base.local_tensors()[f"{L0}.mlp.experts.down_proj"]
        assert torch.equal(down, full[f"{L0}.mlp.experts.down_proj"][:, :, t * h:(t + 1) * h])


def test_ep_expert_offset_and_single_producer_for_replicated():
    full = full_state()
    r1 = shard_tensors(full, ShardSpec(rank=1, ep=2, tp=1))
    name = f"{L0}.mlp.experts.down_proj"
    # global expert 3 = ep_rank 1 · 2 local experts + local expert 1
    assert torch.equal(r1.local_tensors()[name][1], full[name][3])
    assert torch.equal(r1.read(name, ((3, 4), (0, H), (0, I)))[0], full[name][3])
    assert {m.name for m in r1.owned()} == {f"{L0}.mlp.experts.gate_up_proj", name}
    with pytest.raises(ValueError, match="not held by this rank"):
        r1.read(name, ((1, 3), (0, H), (0, I)))
    with pytest.raises(ValueError, match="cannot shard"):
        shard_tensors(full, ShardSpec(rank=0, ep=3, tp=1))


def peft_factors(num_experts: int, r: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    p = "base_model.model.model.layers.0"
    return {
        f"{p}.self_attn.q_proj.lora_A.weight": torch.randn(r, H, generator=g),
        f"{p}.self_attn.q_proj.lora_B.weight": torch.randn(8, r, generator=g),
        f"{p}.mlp.experts.base_layer.lora_A.weight": torch.randn(r * num_experts, H, generator=g),
        f"{p}.mlp.experts.base_layer.lora_B.weight": torch.randn(2 * I, r * num_experts, generator=g),
        f"{p}.mlp.experts.lora_A.weight": torch.randn(r * num_experts, I, generator=g),
        f"{p}.mlp.experts.lora_B.weight": torch.randn(H, r * num_experts, generator=g),
        **{f"{p}.mlp.experts.{e}.gate_proj.lora_A.weight": torch.randn(r, H, generator=g) + e for e in range(num_experts)},
    }


def test_local_factors_slice_expert_major_rows_and_rank_major_columns():
    full = peft_factors(E)
    loc = local_factors(full, ShardSpec(rank=1, ep=2), num_experts=E)
    a = "base_model.model.model.layers.0.mlp.experts.lora_A.weight"
    b = "base_model.model.model.layers.0.mlp.experts.lora_B.weight"
    assert torch.equal(loc[a], full[a][4:8])  # experts 2, 3 at r=2
    assert torch.equal(loc[b].reshape(H, 2, 2), full[b].reshape(H, 2, E)[:, :, 2:4])
    assert not any(".experts.0." in k or ".experts.1." in k for k in loc)


def _gather_worker(rank: int, world: int, init_file: str, ep: int, tp: int, result_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        spec = ShardSpec(rank=rank, ep=ep, tp=tp)
        full = peft_factors(E)
        got = gather_factors(local_factors(full, spec, num_experts=E), spec, num_experts=E, group=None, timeout_s=60)
        assert set(got) == set(full), set(full) ^ set(got)
        for k, v in full.items():
            assert torch.equal(got[k], v), k
        open(os.path.join(result_dir, f"ok{rank}"), "w").close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ep,tp", [(2, 2)])
def test_gather_factors_over_gloo_reassembles_full_adapter(ep, tp):
    world = ep * tp
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_gather_worker, args=(world, os.path.join(d, "init"), ep, tp, d), nprocs=world, join=True)
        assert all(os.path.exists(os.path.join(d, f"ok{r}")) for r in range(world))
