"""Fixtures of the live-trainer tests: checkpoints, engines, two user-owned training ranks, the oracle."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import ray
import torch


FAMILIES = ("qwen3_moe", "mixtral")


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    from sync_service.synthetic import make_base

    root = tmp_path_factory.mktemp("live")
    return {f: make_base(f, root / f, num_experts=4, num_layers=2, hidden=32) for f in FAMILIES}


@pytest.fixture(scope="module")
def ranks(ray_local):
    from tests.trainer.harness import TrainingRank

    actors = [TrainingRank.remote(r, 2) for r in range(2)]
    yield actors
    for a in actors:
        ray.kill(a)


def setup_ranks(ranks, base_dir, mode: str, **attach_kw) -> list:
    """(Re)build the training job on every rank; the endpoint handles in rank order."""
    host, port = ray.get(ranks[0].rendezvous.remote())
    return ray.get([r.setup.remote(host, port, str(base_dir), mode, **attach_kw) for r in ranks], timeout=300)


def adapter_of(ranks) -> dict[str, torch.Tensor]:
    """The trained adapter, gathered from the ranks (a collective on them)."""
    states = ray.get([r.adapter_state.remote() for r in ranks], timeout=120)
    return {k: torch.from_numpy(v.copy()) for k, v in states[0].items()}


def peft_merged(base_dir: Path, adapter: dict[str, torch.Tensor], tmp: Path) -> dict[str, torch.Tensor]:
    """Oracle: PEFT ``merge_and_unload`` in float64 of base + ``adapter``, cast once to the base dtype;
    in-memory (hf-fused) names, as the engines hold them."""
    from sync_service.entrypoints.demo_live import save_adapter
    from tests.merge.conftest import base_dtype, peft_merged_model
    from tests.trainer.harness import lora_config

    save_adapter(adapter, lora_config(), tmp)
    merged = peft_merged_model(base_dir, tmp).to(base_dtype(base_dir))
    return {k: v.detach() for k, v in merged.state_dict().items()}


def assert_engines_hold(engines, oracle: dict[str, torch.Tensor], *, what: str) -> None:
    """Every engine parameter is within fp32 rounding of the oracle (fp32 accumulate vs float64, cast once)."""
    for engine in engines:
        state = ray.get(engine.state.remote(), timeout=120)
        missing = set(state) ^ set(oracle)
        assert not missing, f"{what}: names differ {sorted(missing)[:4]}"
        for name, ref in oracle.items():
            got = torch.from_numpy(state[name])
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{what}: {n}: {m}")


def differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


def max_diff(engine, oracle) -> float:
    state = ray.get(engine.state.remote(), timeout=120)
    return max(float(np.abs(state[n] - oracle[n].numpy()).max()) for n in oracle)


DRIFT_KEYS = (r"layers\.0\.self_attn\.q_proj\.lora_B", r"layers\.1\.mlp\.experts\.lora_A")
"""Two factors a replica drifts in (an attention factor, a fused expert factor), as PEFT keys name them."""


def drift_factors(rank) -> list[str]:
    """Runs in a training rank: add 0.25 to the factors ``DRIFT_KEYS`` name, in place (a step that ran on this
    rank only), keeping their values for ``restore_factors``; their parameter names."""
    import re

    names = [n for n, _ in rank.peft.named_parameters() if any(re.search(k, n) for k in DRIFT_KEYS)]
    rank.saved_factors = {n: rank.peft.get_parameter(n).detach().clone() for n in names}
    with torch.no_grad():
        for n in names:
            rank.peft.get_parameter(n).add_(0.25)
    return names


def restore_factors(rank) -> None:
    """Runs in a training rank: the values ``drift_factors`` kept, bit for bit."""
    with torch.no_grad():
        for n, t in rank.saved_factors.items():
            rank.peft.get_parameter(n).copy_(t)
