"""A real training loop syncs its live PEFT model: 2 gloo ranks in user-owned Ray actors, FSDP2 /
DDP / expert parallel, AdamW on an LM loss, ``push`` after every step to 2 transformers engines.

Oracle: PEFT ``merge_and_unload`` in float64 (cast once) of the adapter gathered from the ranks.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tests.trainer.conftest import adapter_of, assert_engines_hold, differs, peft_merged, ray, setup_ranks

CONFIG_KW = dict(transport="shm", bucket_bytes=16 << 10, timeout_s=120, reset_versions=True)  # cases share engines, each from 0


@pytest.fixture(scope="module")
def engines(ray_local, bases):
    from actors.launch import start_engines

    return {f: start_engines(b, 2, prefix=f) for f, b in bases.items()}


def _greedy_equal(engine, oracle, base_dir) -> None:
    """The engine's greedy tokens equal those of a transformers model holding the oracle weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model.load_state_dict(oracle)
    prompt = [5, 9, 14, 3]
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    tokens, _ = ray.get(engine.generate.remote(prompt, 8), timeout=120)
    assert tokens == ref


def _grad_abs_sum(rank) -> float:
    """Runs in a training rank: the sum of |grad| over its LoRA factors (local shards)."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in rank.peft.parameters()
             if p.grad is not None]
    return float(sum(g.abs().sum() for g in grads))


@pytest.mark.parametrize("family,mode", [("qwen3_moe", "fsdp2"), ("mixtral", "fsdp2"), ("qwen3_moe", "ddp"),
                                         ("qwen3_moe", "ep")])
def test_training_loop_pushes_exact_versions(bases, engines, ranks, tmp_path, family, mode):
    from sync_service.api import SyncConfig, WeightSync

    handles = setup_ranks(ranks, bases[family], mode)
    sync = WeightSync(trainers=handles, engines=engines[family], config=SyncConfig(**CONFIG_KW))
    try:
        before = None
        for step in range(3):
            losses = ray.get([r.train_step.remote() for r in ranks], timeout=120)
            assert all(loss == loss for loss in losses)
            digests = ray.get([r.digest.remote() for r in ranks])
            assert all(ray.get([r.__ray_call__.remote(_grad_abs_sum) for r in ranks])), "no grads for the digest to see"
            metrics = sync.push(step)
            assert ray.get([r.digest.remote() for r in ranks]) == digests, "a push changed trainer state"
            assert metrics.full == (step == 0) and all(e.committed for e in metrics.engines)
            adapter = adapter_of(ranks)
            assert before is None or differs(adapter, before), "the optimizer step changed no factor"
            before = adapter
            oracle = peft_merged(bases[family], adapter, tmp_path / f"v{step}")
            assert_engines_hold(engines[family], oracle, what=f"{family}/{mode} version {step}")
        assert set(sync.engine_versions().values()) == {2}
        _greedy_equal(engines[family][0], oracle, bases[family])
    finally:
        sync.close()


def test_step_during_a_held_send_leaves_the_snapshot(bases, engines, ranks, tmp_path):
    """push_async returns after the snapshot; the send is held until the next step changed the
    factors; the engines then hold the snapshot, not the newer factors."""
    from sync_service.api import SyncConfig, WeightSync

    family = "qwen3_moe"
    handles = setup_ranks(ranks, bases[family], "fsdp2")
    sync = WeightSync(trainers=handles, engines=engines[family], config=SyncConfig(**CONFIG_KW))
    try:
        ray.get([r.train_step.remote() for r in ranks], timeout=120)
        sync.push(0)
        ray.get([r.train_step.remote() for r in ranks], timeout=120)
        snapshot = adapter_of(ranks)
        ray.get([r.hold_sends.remote() for r in ranks])
        handle = sync.push_async(1)
        ray.get([r.train_step.remote() for r in ranks], timeout=120)  # runs while both sends are held
        assert ray.get([h.__ray_ready__.remote() for h in handles], timeout=60) == [True, True]  # still answering
        newer = adapter_of(ranks)
        assert differs(newer, snapshot)
        ray.get([r.release_sends.remote() for r in ranks])
        metrics = handle.result(timeout=120)
        assert all(e.committed for e in metrics.engines)
        assert_engines_hold(engines[family], peft_merged(bases[family], snapshot, tmp_path / "snap"), what="held push")
    finally:
        ray.get([r.release_sends.remote() for r in ranks])
        sync.close()


def test_push_of_replicas_that_differ_is_refused_on_every_rank(bases, engines, ranks):
    """Two plain replicated ranks (no DDP) agree at attach, then rank 1's factors drift: each rank would merge its
    own rows chunk from its own factors (a chimera); the push is refused on every rank naming the tensors and
    ranks, nothing is applied (the engines keep their version and weights), and once the ranks agree again the
    next push commits."""
    from sync_service.api import SyncConfig, SyncError, WeightSync
    from tests.trainer.conftest import DRIFT_KEYS, drift_factors, restore_factors

    fleet = engines["qwen3_moe"]
    sync = WeightSync(trainers=setup_ranks(ranks, bases["qwen3_moe"], "plain"), engines=fleet,
                      config=SyncConfig(**CONFIG_KW))
    try:
        sync.push(0)
        before = ray.get([e.state.remote() for e in fleet], timeout=120)
        ray.get(ranks[1].__ray_call__.remote(drift_factors))
        with pytest.raises(SyncError) as info:
            sync.push(1)
        text = str(info.value)
        assert "replicas disagree at push of version 1: trainer ranks [0, 1]" in text, text
        for key in DRIFT_KEYS:
            assert re.search(key + r"\.weight: ranks \[0\] vs \[1\]", text), (key, text)
        assert set(sync.engine_versions().values()) == {0}
        for old, new in zip(before, ray.get([e.state.remote() for e in fleet], timeout=120)):
            assert all(np.array_equal(new[n], old[n]) for n in old), "a refused push changed an engine"
        ray.get(ranks[1].__ray_call__.remote(restore_factors))  # bit-identical to rank 0 again
        assert all(e.committed for e in sync.push(1).engines) and set(sync.engine_versions().values()) == {1}
    finally:
        sync.close()


def _adapter_from_dcp(path) -> dict:
    """The adapter of an FSDP2 trainer's DCP checkpoint, PEFT keys → numpy (the model's names minus the adapter name)."""
    from sync_service.merge.dcp import read_dcp_state

    return {k.replace(".default.", "."): v.numpy() for k, v in read_dcp_state(path).items() if ".lora_" in k}


def test_restored_trainer_reattaches_and_continues_the_versions(bases, engines, tmp_path):
    """Both training ranks save their FSDP2 checkpoint (``dcp.save``) and are killed; the engines keep serving
    the last commit; new ranks restored from that checkpoint attach again and a new WeightSync over the same
    engines continues the versions: the next push is exact."""
    from sync_service.api import SyncConfig, WeightSync
    from tests.trainer.harness import TrainingRank

    family = "qwen3_moe"
    ranks = [TrainingRank.remote(k, 2) for k in range(2)]
    sync = WeightSync(trainers=setup_ranks(ranks, bases[family], "fsdp2"), engines=engines[family],
                      config=SyncConfig(**CONFIG_KW))
    ray.get([r.train_step.remote() for r in ranks], timeout=120)
    sync.push(40)
    trained = adapter_of(ranks)
    ray.get([r.save_checkpoint.remote(str(tmp_path / "ckpt")) for r in ranks], timeout=120)
    for r in ranks:
        ray.kill(r)
    checkpoint = _adapter_from_dcp(tmp_path / "ckpt")
    assert sorted(checkpoint) == sorted(trained) and not differs({k: torch.from_numpy(v) for k, v in checkpoint.items()},
                                                                 trained)
    for engine in engines[family]:  # still serving the last committed version without a trainer
        assert ray.get(engine.generate.remote([5, 9, 14], 2), timeout=120)[1] == 40
    restored = [TrainingRank.remote(k, 2) for k in range(2)]
    try:
        handles = setup_ranks(restored, bases[family], "fsdp2", restore=checkpoint)
        resumed = WeightSync(trainers=handles, engines=engines[family], config=SyncConfig(**CONFIG_KW))
        assert set(resumed.engine_versions().values()) == {40}  # engines kept serving the last commit
        ray.get([r.train_step.remote() for r in restored], timeout=120)
        metrics = resumed.push(max(resumed.engine_versions().values()) + 1)
        assert metrics.full and all(e.committed for e in metrics.engines)
        adapter = adapter_of(restored)
        assert differs(adapter, trained), "the restored ranks' step changed no factor"
        assert_engines_hold(engines[family], peft_merged(bases[family], adapter, tmp_path / "resumed"), what="resumed")
        assert set(resumed.engine_versions().values()) == {41}
        resumed.close()
    finally:
        for r in restored:
            ray.kill(r)


def test_fsdp2_dcp_checkpoint_is_a_merge_and_trainer_input(bases, engines, ranks, tmp_path):
    """A torch.distributed.checkpoint directory as an FSDP2 trainer saves it (2 gloo ranks, ``fully_shard``
    PEFT model after an AdamW step, ``get_model_state_dict`` + ``dcp.save``, config.json + adapter_config.json)
    is both ``--base`` and ``--adapter`` of ``weightsync merge`` and of the trainer shards (EP=2): the merge
    output and the engines equal PEFT's ``merge_and_unload`` (float64, cast once) of the same weights.
    Mixtral: its on-disk per-expert ``w1``/``w3``/``w2`` keys come back from the fused in-memory state."""
    from actors.launch import start_trainers
    from sync_service.api import SyncConfig, WeightSync
    from sync_service.entrypoints.cli import main
    from sync_service.verify.peft_oracle import checkpoint_state
    from tests.merge.conftest import assert_matches

    family, dcp_dir = "mixtral", tmp_path / "step-1"
    setup_ranks(ranks, bases[family], "fsdp2")
    ray.get([r.train_step.remote() for r in ranks], timeout=120)
    ray.get([r.save_checkpoint.remote(str(dcp_dir)) for r in ranks], timeout=120)
    assert sorted(p.name for p in dcp_dir.glob("__*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    oracle = peft_merged(bases[family], adapter_of(ranks), tmp_path / "oracle")

    assert main(["merge", "--base", str(dcp_dir), "--adapter", str(dcp_dir), "--out", str(tmp_path / "merged")]) == 0
    assert_matches(checkpoint_state(tmp_path / "merged"), oracle)

    trainers = start_trainers(dcp_dir, dcp_dir, ep=2)
    sync = WeightSync(trainers=trainers, engines=engines[family], config=SyncConfig(**CONFIG_KW))
    try:
        assert sync.push(100).full
        assert_engines_hold(engines[family], oracle, what="trainers on a DCP checkpoint")
    finally:
        sync.close()
        for t in trainers:
            ray.kill(t)
