"""The product end to end: TrainerShard actors (EP / TP) → WeightSync → RolloutEngine actors.

Real Ray, real processes, real gloo, real transformers models; every value check compares the engines
with PEFT's ``merge_and_unload`` of the version's adapter (float64, cast once; ``tests.oracle``), within
the rounding of weightsync's fp32-accumulated merge (``peft_oracle.values_match``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from protocols.params import DTYPE_BYTES
from sync_service.api import PlanMismatchError, SyncConfig, WeightSync
from actors.launch import start_engines, start_trainers
from sync_service.entrypoints.local import AdapterReplay
from sync_service.synthetic import make_adapter, make_base
from tests.oracle import assert_engines_match

import ray

E = 8
CONFIG = SyncConfig(transport="shm", bucket_bytes=8 << 10, timeout_s=90, reset_versions=True)  # cases share engines, each from 0


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    out = {}
    for family in ("qwen3_moe", "mixtral"):
        base = make_base(family, root / f"{family}-base", num_experts=E, num_layers=2)
        out[family] = (base, make_adapter(family, base, root / f"{family}-lora", kind="target_parameters", r=2))
    return root, out


@pytest.fixture(scope="module")
def engines(ray_local, files):
    _, by_family = files
    return {"qwen3_moe": start_engines(by_family["qwen3_moe"][0], 2, prefix="qwen"),
            "mixtral": start_engines(by_family["mixtral"][0], 1, prefix="mixtral")}


def kill(actors) -> None:
    for a in actors:
        ray.kill(a)


def run_versions(trainers, engines, base, adapter, oracle, versions=3) -> WeightSync:
    sync = WeightSync(trainers=trainers, engines=engines, config=CONFIG)
    replay = AdapterReplay(adapter)
    for v in range(versions):
        if v:
            ray.get([t.train_step.remote(v) for t in trainers])
            replay.step(v)
        metrics = sync.push(v)
        assert metrics.full == (v == 0) and all(e.committed for e in metrics.engines)
        assert metrics.buckets >= 2 and all(e.payload_bytes == metrics.bytes for e in metrics.engines)
        if v == 0:  # a full sync moves every tensor once: its bytes, plus < 64 bytes of alignment per entry
            metas = ray.get(engines[0].param_metas.remote())
            tensor_bytes = sum(math.prod(m.shape) * DTYPE_BYTES[m.dtype] for m in metas)
            entries = len(metas) * len(trainers) + metrics.buckets  # boxes per trainer, plus cuts at bucket ends
            assert tensor_bytes <= metrics.bytes < tensor_bytes + 64 * entries, (metrics.bytes, tensor_bytes)
        assert_engines_match(engines, oracle.state(base, replay), what=f"version {v}")
    assert set(sync.engine_versions().values()) == {versions - 1}
    return sync


@pytest.mark.parametrize("family,ep,tp", [("qwen3_moe", 2, 1), ("qwen3_moe", 1, 2), ("mixtral", 2, 1), ("mixtral", 1, 2)])
def test_sharded_trainers_three_versions_equal_peft(files, engines, trainer_pool, peft_oracle, family, ep, tp):
    """Under EP a rank merges whole experts, under TP a column block (row-parallel) or the gate/up row
    halves; either way every version equals PEFT's merge up to fp32 rounding (the block shape changes
    the GEMM's rounding, not the tolerance)."""
    _, by_family = files
    base, adapter = by_family[family]
    trainers = start_trainers(base, adapter, ep=ep, tp=tp, reuse=trainer_pool)
    sync = run_versions(trainers, engines[family], base, adapter, peft_oracle)
    sync.close()


def test_snapshot_is_taken_before_push_returns(files, engines, trainer_pool, peft_oracle):
    _, by_family = files
    base, adapter = by_family["qwen3_moe"]
    trainers = start_trainers(base, adapter, ep=2, reuse=trainer_pool)
    sync = WeightSync(trainers=trainers, engines=engines["qwen3_moe"], config=CONFIG)
    replay = AdapterReplay(adapter)
    sync.push(0)
    expected = peft_oracle.state(base, replay)
    handle = sync.push_async(1)  # snapshot of the unchanged factors
    ray.get([t.train_step.remote(1, 1.0) for t in trainers])  # large change right after
    handle.result(timeout=120)
    assert_engines_match(engines["qwen3_moe"], expected, what="snapshot of version 1")
    replay.step(1, 1.0)
    sync.push(2)
    assert_engines_match(engines["qwen3_moe"], peft_oracle.state(base, replay), what="version 2")
    sync.close()


@pytest.fixture(scope="module")
def constant_experts_base(files):
    """The qwen3_moe base with every weight of expert e set to the constant e (on disk, per expert)."""
    root, by_family = files
    src = by_family["qwen3_moe"][0]
    dst = root / "qwen3-const"
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    for key, t in tensors.items():
        parts = key.split(".")
        if "experts" in parts:
            tensors[key] = torch.full_like(t, float(parts[parts.index("experts") + 1]))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_expert_offsets_and_multi_bucket_increments(constant_experts_base, engines, trainer_pool):
    trainers = start_trainers(constant_experts_base, None, ep=2, reuse=trainer_pool)
    targets = engines["qwen3_moe"]
    sync = WeightSync(trainers=trainers, engines=targets, config=CONFIG)
    sync.push(10)
    for engine in targets:
        state = ray.get(engine.state.remote())
        for layer in range(2):
            for p in ("gate_up_proj", "down_proj"):
                t = state[f"model.layers.{layer}.mlp.experts.{p}"]
                assert [float(np.unique(t[e])[0]) for e in range(E)] == list(range(E))
                assert all(len(np.unique(t[e])) == 1 for e in range(E))
    # full fine-tuning step: every local tensor + 1, twice; each sync spans several buckets
    for version in (11, 12):
        before = ray.get(targets[0].state.remote())
        for t in trainers:
            ray.get(t.update_base.remote({k: v + 1 for k, v in ray.get(t.local_base.remote()).items()}))
        metrics = sync.push(version)
        assert metrics.full and metrics.buckets >= 2
        for engine in targets:
            after = ray.get(engine.state.remote())
            bad = [n for n in before if not np.array_equal(after[n], before[n] + 1)]
            assert not bad, f"version {version}: not old + 1: {bad[:3]}"
    sync.close()


def test_engine_lacking_a_sent_name_fails_setup_before_any_byte(files, trainer_pool, tmp_path):
    _, by_family = files
    base, adapter = by_family["qwen3_moe"]
    partial = tmp_path / "partial"
    partial.mkdir()
    for f in base.iterdir():
        if f.suffix != ".safetensors":
            (partial / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(base / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    [engine] = start_engines(partial, 1, engine="memory", prefix="partial")
    trainers = start_trainers(base, adapter, ep=2, reuse=trainer_pool)
    try:
        before = ray.get(engine.state.remote())
        with pytest.raises(PlanMismatchError, match=r"model\.norm\.weight") as err:
            WeightSync(trainers=trainers, engines=[engine], config=CONFIG)
        assert err.value.unexpected == ["model.norm.weight"] and not err.value.missing
        assert ray.get(engine.weight_version.remote()) is None
        after = ray.get(engine.state.remote())
        assert all(np.array_equal(after[n], before[n]) for n in before)
    finally:
        kill([engine])
