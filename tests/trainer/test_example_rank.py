"""The example training rank's expert-parallel adapter join (``adapter_state`` under ``ep``): the ranks' local
fused expert factors, laid out as PEFT lays them for a module of E_local experts, join to the whole factor."""

from __future__ import annotations

import pytest
import torch

from sync_service.live.example import _join_experts


@pytest.mark.parametrize("r", [2, 4])
def test_ep_ranks_factors_join_to_the_whole_factor(r):
    num_experts, world, out_dim, in_dim = 4, 2, 6, 5
    g = torch.Generator().manual_seed(r)
    whole_a = torch.randn(r * num_experts, in_dim, generator=g)  # rows expert-major: e·r + k
    whole_b = torch.randn(out_dim, r * num_experts, generator=g)  # columns rank-major: k·E + e
    e_local = num_experts // world
    blocks = [(k * e_local, (k + 1) * e_local) for k in range(world)]
    parts_a = [whole_a.reshape(num_experts, r, in_dim)[e0:e1].reshape(-1, in_dim) for e0, e1 in blocks]
    parts_b = [whole_b.reshape(out_dim, r, num_experts)[:, :, e0:e1].reshape(out_dim, -1) for e0, e1 in blocks]
    key = "base_model.model.model.layers.0.mlp.experts.base_layer.lora_{}.weight"
    assert torch.equal(_join_experts(key.format("A"), parts_a, r), whole_a)
    assert torch.equal(_join_experts(key.format("B"), parts_b, r), whole_b)
