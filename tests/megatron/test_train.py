"""The Megatron training step (``sync_service/entrypoints/megatron_train.py``): Megatron's schedule, the gradients
reduced over the data-parallel and expert-data-parallel groups as Megatron's DDP does. Oracles: (1) the same model,
adapters and fixed batch on one rank (TP = EP = PP = DP = 1, where no reduction exists): the 4-rank gradients,
assembled from the ranks' placements, equal it, and so do the losses of the AdamW steps that follow; (2) at every
mesh with expert-TP 1 the reduced gradients along random directions over the last layer's experts' ``linear_fc1`` and
``linear_fc2`` adapters (no router downstream: the loss is smooth along them) equal the central difference of the
loss Megatron computes there; at the demo's expert-TP 2 (where Megatron-Bridge's forward differs from one rank's)
they do not, pinned for the Bridge version measured. One 4-process
group for the module (the meshes in turn), one single-rank run."""

from __future__ import annotations

import json

import pytest

from tests.megatron.ranks import run_ranks
from tests.megatron.train_ranks import global_grads, train_meshes

ONE = {"tp": 1, "ep": 1, "etp": 1, "pp": 1}
MESHES = {  # 4 ranks each
    "tp2-dp2-ep2-edp2": {"tp": 2, "ep": 2, "etp": 1, "pp": 1},  # dense dp 2, experts ep 2 x expert-dp 2
    "pp2-dp2-edp2": {"tp": 1, "ep": 1, "etp": 1, "pp": 2},  # Megatron's 1F1B schedule over 2 stages
    "tp2-dp2-ep2-etp2": {"tp": 2, "ep": 2, "etp": 2, "pp": 1},  # the demo's (no one-rank oracle: Bridge's fc2)
}
SEED, STEPS = 5, 3
GRAD_BOUND = 1e-6  # fp32 gradients, another reduction order (measured <= 6e-8)
LOSS_BOUND = 1e-4
DIRECTIONAL_BOUND = 1e-2  # relative: a central difference in fp32 (measured <= 1e-3)


@pytest.fixture(scope="module")
def runs(hf_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    run_ranks(train_meshes, 1, str(hf_model), [ONE], str(root / "one"), SEED, STEPS)
    run_ranks(train_meshes, 4, str(hf_model), list(MESHES.values()), str(root / "four"), SEED, STEPS)
    return root


def _dir(runs, mesh: str):
    return runs / "four" / str(list(MESHES).index(mesh))


@pytest.mark.parametrize("mesh", [m for m in MESHES if MESHES[m]["etp"] == 1])
def test_reduced_gradients_and_losses_equal_one_rank(runs, mesh):
    want, got = global_grads(runs / "one" / "0", 1), global_grads(_dir(runs, mesh), 4)
    assert set(got) == set(want) and len(want) > 0
    assert any("experts" in k for k in want) and any("self_attention" in k for k in want)
    scale = max(t.abs().max().item() for t in want.values())
    off = {k: (got[k] - want[k]).abs().max().item() for k in want}
    print(f"{mesh}: gradients {max(off.values()):.2e} from one rank's (max |g| {scale:.2e})")
    assert scale > 1e-3 and max(off.values()) <= GRAD_BOUND, sorted(off.items(), key=lambda kv: -kv[1])[:4]
    one = json.loads((runs / "one" / "0" / "losses.json").read_text())
    four = json.loads((_dir(runs, mesh) / "losses.json").read_text())
    assert len(one) == len(four) == STEPS + 1
    assert max(abs(a - b) for a, b in zip(one, four)) <= LOSS_BOUND, (one, four)
    assert four[-1] < four[0], four


# Megatron-Bridge 0.6.2 at expert-TP 2 (CPU, no sequence parallelism; measured 2026-12-05): the experts' adapter
# gradients Megatron's backward gives (with the token copies divided out) are not the derivative of the loss its
# forward computes there: along the test's directions linear_fc1 0.0294 vs a central difference of -0.0119,
# linear_fc2 0.0329 vs 0.0657; pinned so a change shows
ETP_GRADIENTS_INCONSISTENT = {"0.6.2"}


@pytest.mark.parametrize("mesh", ["one", *MESHES])
def test_gradients_are_the_derivative_of_the_loss_megatron_computes(runs, mesh):
    from importlib.metadata import version

    checks = json.loads(((runs / "one" / "0") if mesh == "one" else _dir(runs, mesh)).joinpath("directional.json")
                        .read_text())
    consistent = mesh == "one" or MESHES[mesh]["etp"] == 1 or version("megatron-bridge") not in ETP_GRADIENTS_INCONSISTENT
    for kind, (analytic, difference) in checks.items():
        print(f"{mesh} {kind}: grad.u {analytic:.6f}, central difference {difference:.6f}")
        assert abs(difference) > 1e-3, (kind, difference)  # the direction moves the loss
        if consistent:
            assert abs(analytic - difference) <= DIRECTIONAL_BOUND * abs(difference), (kind, analytic, difference)
    if not consistent:
        for kind, (analytic, difference) in checks.items():
            assert abs(analytic - difference) > 0.4 * abs(difference), (kind, analytic, difference)
