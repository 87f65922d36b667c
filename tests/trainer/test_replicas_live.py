"""Replicated training ranks must agree: 2 plain replicated gloo ranks (no DDP) in user-owned Ray actors.

Each plain rank merges its own rows chunk of every replicated tensor from its own factors, so ranks whose
factors differ would make the engine serve a chimera (q_proj's first rows from rank 0's merge, the rest
from rank 1's). ``attach_trainer`` refuses replicas that already differ, and a push whose snapshot holds
differing replicas is refused on every rank, naming the tensors and ranks: nothing applied, the engine keeps
its version and weights; once the ranks agree again the next push commits.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tests.trainer.conftest import ray, setup_ranks

CONFIG_KW = dict(transport="shm", bucket_bytes=16 << 10, timeout_s=120, reset_versions=True)
DRIFT = 0.25
"""Added to rank 1's copies of two factors (a step that ran on rank 1 only)."""
KEYS = (r"layers\.0\.self_attn\.q_proj\.lora_B", r"layers\.1\.mlp\.experts\.lora_A")
"""The drifted factors (an attention factor and a fused expert factor), as PEFT keys name them."""


@pytest.fixture(scope="module")
def engine(ray_local, bases):
    from actors.launch import start_engines

    return start_engines(bases["qwen3_moe"], 1, prefix="replicas")[0]


def _drift(rank) -> list[str]:
    """Runs in a training rank: add ``DRIFT`` to the factors ``KEYS`` name, in place (as an optimizer step
    would), keeping their values for ``_restore``."""
    names = [n for n, _ in rank.peft.named_parameters() if any(re.search(k, n) for k in KEYS)]
    rank.saved_factors = {n: rank.peft.get_parameter(n).detach().clone() for n in names}
    with torch.no_grad():
        for n in names:
            rank.peft.get_parameter(n).add_(DRIFT)
    return names


def _restore(rank) -> None:
    with torch.no_grad():
        for n, t in rank.saved_factors.items():
            rank.peft.get_parameter(n).copy_(t)


def _reattach(rank):
    from sync_service.live import attach_trainer

    return attach_trainer(rank.model)


def _state(engine) -> dict[str, np.ndarray]:
    return ray.get(engine.state.remote(), timeout=120)


def test_attach_refuses_replicas_that_differ(bases, ranks):
    setup_ranks(ranks, bases["qwen3_moe"], "plain")
    assert len(ray.get(ranks[1].__ray_call__.remote(_drift))) == 2
    refs = [r.__ray_call__.remote(_reattach) for r in ranks]
    for ref in refs:
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(ref, timeout=300)
        text = str(info.value)
        assert "AttachError" in text and "replicas disagree at attach: trainer ranks [0, 1]" in text, text[-800:]
        for key in KEYS:
            assert re.search(key + r"\.weight: ranks \[0\] vs \[1\]", text), (key, text[-800:])


def test_push_of_differing_replicas_is_refused_on_every_rank(bases, ranks, engine):
    from sync_service.api import SyncConfig, SyncError, WeightSync

    handles = setup_ranks(ranks, bases["qwen3_moe"], "plain")
    sync = WeightSync(trainers=handles, engines=[engine], config=SyncConfig(**CONFIG_KW))
    try:
        sync.push(0)
        before = _state(engine)
        ray.get(ranks[1].__ray_call__.remote(_drift))
        with pytest.raises(SyncError) as info:
            sync.push(1)
        text = str(info.value)
        assert "replicas disagree at push of version 1: trainer ranks [0, 1]" in text, text
        for key in KEYS:
            assert re.search(key + r"\.weight: ranks \[0\] vs \[1\]", text), (key, text)
        assert sync.engine_versions() == {"replicas0": 0}
        after = _state(engine)
        assert all(np.array_equal(after[n], before[n]) for n in before), "a refused push changed the engine"
        ray.get(ranks[1].__ray_call__.remote(_restore))  # back in step: bit-identical to rank 0 again
        metrics = sync.push(1)
        assert all(e.committed for e in metrics.engines) and sync.engine_versions() == {"replicas0": 1}
    finally:
        sync.close()
