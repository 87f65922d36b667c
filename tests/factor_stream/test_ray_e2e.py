"""Factor streaming end to end: TrainerShard actors (EP=2) → WeightSync(mode="factors") → RolloutEngine
actors (transformers models), real Ray, real gloo, shm channel. After every version every engine equals
PEFT's ``merge_and_unload`` of the version's adapter (float64, cast once; within fp32-merge rounding) and,
bit for bit, merged mode's result (``tests.oracle.our_merge``: factor streaming is deterministic); deltas
move factor blocks only; a late joiner forces a full sync."""

from __future__ import annotations

import math

from protocols.params import DTYPE_BYTES
from sync_service.api import SyncConfig, WeightSync
from actors.launch import start_engines, start_trainers
from sync_service.entrypoints.local import AdapterReplay
from sync_service.synthetic import make_adapter, make_base
from tests.oracle import assert_engines_bitwise, assert_engines_match, our_merge

import ray


def test_factor_mode_three_versions_exact_then_late_joiner_gets_full_sync(ray_local, tmp_path, peft_oracle):
    base = make_base("qwen3_moe", tmp_path / "base", dtype="bfloat16", num_experts=4)
    adapter = make_adapter("qwen3_moe", base, tmp_path / "lora", kind="target_parameters", r=2)
    trainers = start_trainers(base, adapter, ep=2)
    engines = start_engines(base, 1, prefix="fe")
    config = SyncConfig(transport="shm", bucket_bytes=8 << 10, timeout_s=90, mode="factors", experts_per_recipe=1)
    sync = WeightSync(trainers=trainers, engines=engines, config=config)
    replay = AdapterReplay(adapter)
    try:
        for v in range(3):
            if v:
                ray.get([t.train_step.remote(v) for t in trainers])
                replay.step(v)
            metrics = sync.push(v)
            assert metrics.full == (v == 0) and metrics.mode == "factors" and metrics.factor_tensors
            assert metrics.rx_merge_s > 0 and metrics.stage_seconds()["rx_merge_s"] == metrics.rx_merge_s
            assert_engines_match(engines, peft_oracle.state(base, replay), what=f"version {v}")
            assert_engines_bitwise(engines, our_merge(base, replay), what=f"version {v} vs merged mode")
            if v == 0:
                full_bytes = metrics.bytes
            else:
                assert 0 < metrics.bytes < full_bytes / 2, (metrics.bytes, full_bytes)
        states = ray.get([e.factor_state.remote() for e in engines])
        # every engine holds the same resident set: at least the pristine copy of each factor target
        table = {m.name: m for m in ray.get(engines[0].param_metas.remote())}
        pristine = sum(math.prod(table[n].shape) * DTYPE_BYTES[table[n].dtype] for n in metrics.factor_tensors)
        assert all(s.ready for s in states) and len({s.resident_bytes for s in states}) == 1
        assert states[0].resident_bytes >= pristine > 0, (states, pristine)
        late = start_engines(base, 1, prefix="late")
        sync.add_engine(late[0])
        ray.get([t.train_step.remote(3) for t in trainers])
        replay.step(3)
        metrics = sync.push(3)
        assert metrics.full, "a member without pristine copies must get a full sync"
        assert_engines_match(engines + late, peft_oracle.state(base, replay), what="after join")
        assert_engines_bitwise(engines + late, our_merge(base, replay), what="after join vs merged mode")
        assert ray.get(late[0].factor_state.remote()).ready
    finally:
        sync.close()
