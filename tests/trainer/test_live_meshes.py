"""Any DTensor mesh, read in place: 4 gloo ranks (one Ray session, one rank group) train a tiny PEFT
Qwen3-MoE with AdamW under HSDP (2, 2), FSDP2 ``Shard(1)``, FSDP2 × TP (``parallelize_module``
Colwise q/k/v, Rowwise o), HSDP × TP on a 3-D mesh (2, 1, 2), FSDP2 × EP on ("dp", "ep") = (2, 2) and
TP × EP on ("ep", "tp") = (2, 2) (``live/example_ep.py``: the experts and their LoRA factors DTensors on
the ep axis, an EP forward over each rank's local experts); every version on every engine equals
PEFT's float64 merge (cast once) of the gathered factors, and the pushes leave params, grads and
optimizer state bitwise unchanged. Under EP the first loss of every rank equals the plain PEFT model's
on its batch (the placements mean what the forward computes), the loss falls over the 3 steps, and
each rank merges only the experts it holds. Factor streaming from the same live HSDP ranks (``mode="factors"``: the
engine merges the LoRA factors) serves bitwise what merged mode serves, version after version.

The base has 2 key/value heads (``make_base`` writes 1), so attention's heads split over tp=2.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.conftest import assert_engines_hold, differs, peft_merged, ray, setup_ranks

CONFIG_KW = dict(transport="shm", bucket_bytes=16 << 10, timeout_s=120, reset_versions=True)
WORLD = 4

CASES = {  # the ``setup`` keywords (mode "fsdp2" unless given); the TP cases on fresh ranks (``_ranks_for``)
    "hsdp": dict(mesh_shape=(2, 2)),
    "shard1": dict(shard_dim=1),
    "fsdp2_tp": dict(mesh_shape=(2, 2), tp=True),
    "hsdp_tp_3d": dict(mesh_shape=(2, 1, 2), tp=True),
    "fsdp2_ep": dict(mode="ep", mesh_shape=(2, 2)),
    "tp_ep": dict(mode="ep", mesh_shape=(2, 2), tp=True),
}
EXPECT = {  # placements each case must produce (so it tests what it says)
    "hsdp": ("(Replicate(), Shard(dim=0))",),
    "shard1": ("(Shard(dim=1),)",),
    "fsdp2_tp": ("(_StridedShard(dim=0, sf=2), Shard(dim=0))",),
    "hsdp_tp_3d": ("(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))",),
    # experts (base, lora_A) on ep then FSDP2 on dp; lora_B [out, r·E] rank-major: r strided runs per ep rank
    "fsdp2_ep": ("(_StridedShard(dim=0, sf=2), Shard(dim=0))", "(Shard(dim=0), _StridedShard(dim=1, sf=2))"),
    "tp_ep": ("(Shard(dim=0),)", "(_StridedShard(dim=1, sf=2),)"),
}
EP_EXPERTS = {  # the global experts each rank merges (4 experts; ranks row-major on the mesh)
    "fsdp2_ep": [(0, 1), (2, 3), (1, 2), (3, 4)],  # (dp, ep): ep block, then its dp half
    "tp_ep": [(0, 2), None, (2, 4), None],  # (ep, tp): the tp copy holding the lowest rank sends
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Qwen3-MoE with 2 key/value heads (TP-splittable attention), seeded weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sync_service.synthetic import make_base
    from sync_service.synthetic.base import randomize_

    out = make_base("qwen3_moe", tmp_path_factory.mktemp("mesh") / "qwen3_moe", num_experts=4, num_layers=2, hidden=32)
    config = AutoConfig.from_pretrained(out)
    config.num_key_value_heads = 2
    model = AutoModelForCausalLM.from_config(config)
    randomize_(model, seed=0, scale=0.1)
    model.save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2
    return out


@pytest.fixture(scope="module")
def ranks4(ray_local):
    from tests.trainer.harness import TrainingRank

    actors = [TrainingRank.remote(r, WORLD) for r in range(WORLD)]
    yield actors
    for a in actors:
        ray.kill(a)


@pytest.fixture(scope="module")
def engines(ray_local, base):
    from actors.launch import start_engines

    return start_engines(base, 2, prefix="mesh")


def _placements(rank) -> list[str]:
    """Runs in a training rank: the distinct placements of its parameters."""
    return sorted({repr(tuple(p.placements)) for p in rank.peft.parameters() if hasattr(p, "placements")})


def _plain_losses(base, data_ranks) -> list[float]:
    """The LM loss of the plain (unsharded) PEFT model with the example's seeded factors on each batch."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from sync_service.live.example import _randomize_lora, lora_config

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), lora_config())
    _randomize_lora(model, 0, ep=False)
    out = []
    with torch.no_grad():
        for k in data_ranks:
            tokens = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(k))
            out.append(float(model(input_ids=tokens, labels=tokens).loss))
    return out


def _adapter(ranks) -> dict[str, torch.Tensor]:
    """The trained adapter; every rank's view of it is the same (TP and HSDP replicas agree)."""
    states = ray.get([r.adapter_state.remote() for r in ranks], timeout=120)
    for k, state in enumerate(states[1:], 1):
        assert all((state[n] == states[0][n]).all() for n in states[0]), f"rank {k}'s adapter differs from rank 0's"
    return {k: torch.from_numpy(v.copy()) for k, v in states[0].items()}


def _ranks_for(case: str, shared: list) -> list:
    """The module's ranks, or fresh ones for a TP case: a rank process whose training group was destroyed
    and made again cannot run TP's collectives on a new device mesh (torch names a process group that no
    longer resolves: 'Could not resolve the process group registered under the name N')."""
    if not CASES[case].get("tp"):
        return shared
    from tests.trainer.harness import TrainingRank

    return [TrainingRank.remote(r, WORLD) for r in range(WORLD)]


@pytest.mark.parametrize("case", list(CASES))
def test_any_mesh_trains_and_pushes_exact_versions(base, engines, ranks4, tmp_path, case):
    ranks = _ranks_for(case, ranks4)
    try:
        _train_and_push(base, engines, ranks, tmp_path, case)
    finally:
        if ranks is not ranks4:
            for a in ranks:
                ray.kill(a)


def _train_and_push(base, engines, ranks4, tmp_path, case) -> None:
    from sync_service.api import SyncConfig, WeightSync

    kw = dict(CASES[case])
    handles = setup_ranks(ranks4, base, kw.pop("mode", "fsdp2"), **kw)
    placements = ray.get(ranks4[0].__ray_call__.remote(_placements))
    assert all(want in placements for want in EXPECT[case]), (case, placements)
    if case in EP_EXPERTS:
        _assert_own_experts(handles, EP_EXPERTS[case])
    sync = WeightSync(trainers=handles, engines=engines, config=SyncConfig(**CONFIG_KW))
    try:
        before, history = None, []
        for step in range(3):
            losses = ray.get([r.train_step.remote() for r in ranks4], timeout=300)
            assert all(loss == loss for loss in losses)
            history.append(losses)
            digests = ray.get([r.digest.remote() for r in ranks4])
            metrics = sync.push(step)
            assert ray.get([r.digest.remote() for r in ranks4]) == digests, "a push changed trainer state"
            assert metrics.full == (step == 0) and all(e.committed for e in metrics.engines)
            adapter = _adapter(ranks4)
            assert before is None or differs(adapter, before), "the optimizer step changed no factor"
            before = adapter
            oracle = peft_merged(base, adapter, tmp_path / f"v{step}")
            assert_engines_hold(engines, oracle, what=f"{case} version {step}")
        assert set(sync.engine_versions().values()) == {2}
    finally:
        sync.close()
    if case in EP_EXPERTS:  # the EP forward computes the plain model's loss, and training lowers it
        tp = CASES[case].get("tp", False)
        plain = _plain_losses(base, [k // 2 if tp else k for k in range(WORLD)])
        torch.testing.assert_close(history[0], plain, rtol=1e-5, atol=0)
        assert all(last < first for first, last in zip(history[0], history[-1])), history


def _assert_own_experts(handles, expected) -> None:
    """Each rank produces exactly the expert rows it holds (no rank merges another's expert)."""
    name = "model.layers.0.mlp.experts.gate_up_proj"
    for k, metas in enumerate(ray.get([h.owned_metas.remote() for h in handles], timeout=120)):
        rows = [m.box[0] for m in metas if m.name == name]
        assert rows == ([] if expected[k] is None else [expected[k]]), (k, rows)


def test_factor_streaming_from_live_ranks_serves_what_merged_mode_serves(base, engines, ranks4, tmp_path):
    """Two coordinators on the same HSDP ranks: merged mode into engine 0, factor mode into engine 1."""
    import numpy as np

    from sync_service.api import SyncConfig, WeightSync

    handles = setup_ranks(ranks4, base, "fsdp2", mesh_shape=(2, 2))
    merged = WeightSync(trainers=handles, engines=engines[:1], config=SyncConfig(**CONFIG_KW))
    factors = WeightSync(trainers=handles, engines=engines[1:], config=SyncConfig(**CONFIG_KW, mode="factors"))
    try:
        for step in range(3):
            ray.get([r.train_step.remote() for r in ranks4], timeout=300)
            digests = ray.get([r.digest.remote() for r in ranks4])
            m, f = merged.push(step), factors.push(step)
            assert ray.get([r.digest.remote() for r in ranks4]) == digests, "a push changed trainer state"
            assert f.mode == "factors" and f.factor_tensors and all(e.committed for e in f.engines), f
            if step:
                assert f.bytes < m.bytes, (f.bytes, m.bytes)
            a, b = (ray.get(e.state.remote(), timeout=120) for e in engines)
            assert a.keys() == b.keys()
            bad = [n for n in a if not np.array_equal(a[n].view(np.uint8), b[n].view(np.uint8))]
            assert not bad, f"version {step}: factor mode differs from merged mode on {bad[:4]}"
            assert_engines_hold(engines[1:], peft_merged(base, _adapter(ranks4), tmp_path / f"f{step}"),
                                what=f"factors version {step}")
    finally:
        merged.close()
        factors.close()


def _pieces(shape, mesh_shape, coord, placements):
    from sync_service.live.placement import dim_indices, index_pieces

    return index_pieces(dim_indices(shape, mesh_shape, coord, placements))


def test_strided_indices_become_boxes():
    """A ``_StridedShard`` rank's indices as boxes: one box when contiguous (FSDP2 over TP), several when
    strided; PEFT's expert ``lora_B`` [out, r·E] (columns k·E + e) on an ep axis: ep rank j's local
    tensor is ``B.view(out, r, E)[:, :, block j]``, r runs of E_local columns."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    fsdp_over_tp = (_StridedShard(0, split_factor=2), Shard(0))
    assert [p.global_box for p in _pieces((8, 4), (2, 2), (1, 0), fsdp_over_tp)] == [((2, 4), (0, 4))]
    strided = _pieces((8, 4), (2, 2), (0, 1), (Shard(0), _StridedShard(0, split_factor=2)))
    assert [(p.global_box[0], p.local_box[0]) for p in strided] == [((1, 2), (0, 1)), ((3, 4), (1, 2))]
    out, r, experts = 3, 2, 4
    b = torch.arange(out * r * experts).reshape(out, r * experts)
    for j in range(2):
        local = b.view(out, r, experts)[:, :, 2 * j:2 * j + 2].reshape(out, r * 2)
        pieces = _pieces(tuple(b.shape), (2,), (j,), (_StridedShard(1, split_factor=r),))
        assert len(pieces) == r
        for p in pieces:
            got = local[tuple(slice(a, z) for a, z in p.local_box)]
            assert torch.equal(got, b[tuple(slice(a, z) for a, z in p.global_box)]), (j, p)
