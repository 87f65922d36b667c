"""Live refresh on real Ray actors: async push vs a training step, back-pressure, the staleness bound
with a slow engine, and a late joiner brought up by a peer copy while the others keep getting deltas.

Every value check compares engine weights with PEFT's ``merge_and_unload`` of the version's replayed
adapter (float64, cast once; ``tests.oracle``), within the rounding of weightsync's fp32-accumulated merge.
"""

from __future__ import annotations

import time

import pytest
import ray

from sync_service.api import SyncConfig, WeightSync
from actors.launch import start_engines, start_trainers
from sync_service.entrypoints.local import AdapterReplay
from sync_service.synthetic import make_adapter, make_base
from tests.oracle import assert_engines_bitwise, assert_engines_match
from tests.rl.conftest import set_apply_delay


CONFIG = dict(transport="shm", bucket_bytes=8 << 10, timeout_s=90, reset_versions=True)  # each case numbers from 0 on the module's engines
SLOW_APPLY_S = 0.04


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    base = make_base("qwen3_moe", root / "base", num_experts=4, num_layers=2)
    return base, make_adapter("qwen3_moe", base, root / "lora", kind="target_parameters", r=2)


@pytest.fixture(scope="module")
def engines(ray_local, files):
    engines = start_engines(files[0], 2, prefix="live")
    yield engines
    for e in engines:
        ray.kill(e)


@pytest.fixture
def trainers(files, engines, trainer_pool):
    """EP=2 trainer shards reloaded with the adapter's initial factors for each test."""
    yield start_trainers(files[0], files[1], ep=2, reuse=trainer_pool)
    for e in engines:
        set_apply_delay(e, 0)


def test_push_async_streams_the_snapshot_while_training_mutates_the_factors(files, engines, trainers, peft_oracle):
    sync = WeightSync(trainers=trainers, engines=engines, config=SyncConfig(**CONFIG))
    replay = AdapterReplay(files[1])
    try:
        sync.push(0)
        ray.get([t.train_step.remote(1) for t in trainers])
        replay.step(1)
        expected = peft_oracle.state(files[0], replay)
        set_apply_delay(engines[1], SLOW_APPLY_S)  # keeps the transfer in flight for a while
        handle = sync.push_async(1)
        in_flight_on_return = not handle.done()
        steps_during_transfer = 0
        for step in range(100, 104):  # large optimizer-like steps, right while version 1 streams
            ray.get([t.train_step.remote(step, 1.0) for t in trainers])
            replay.step(step, 1.0)
            steps_during_transfer += not handle.done()
        metrics = handle.result(timeout=120)
        assert in_flight_on_return and steps_during_transfer >= 1, "the training steps did not overlap the transfer"
        assert handle.snapshot_s < metrics.seconds and not metrics.full
        assert_engines_match(engines, expected, what="version 1 = the snapshot, none of the later steps")
        set_apply_delay(engines[1], 0)
        sync.push(2)
        assert_engines_match(engines, peft_oracle.state(files[0], replay), what="version 2 = every step taken meanwhile")
    finally:
        sync.close()


def test_back_pressure_blocks_push_async_until_the_previous_push_committed(files, engines, trainers):
    sync = WeightSync(trainers=trainers, engines=engines, config=SyncConfig(**CONFIG, max_in_flight=1))
    try:
        sync.push(0)
        set_apply_delay(engines[0], SLOW_APPLY_S)
        first = sync.push_async(1)
        with pytest.raises(TimeoutError, match="back-pressure"):
            sync.push_async(2, timeout_s=0.05)
        assert sync.latest_version == 1  # the refused push took no snapshot
        second = sync.push_async(2)
        assert first.done() and first.result().version == 1 and second.backpressure_s > 0.1
        with pytest.raises(ValueError, match="versions must increase"):
            sync.push_async(2)
        assert second.result(timeout=120).version == 2
        assert set(sync.engine_versions().values()) == {2} and sync.committed_version == 2
    finally:
        sync.close()


@pytest.mark.parametrize("max_staleness", [1, 0])
def test_staleness_bound_holds_with_a_slow_engine(files, engines, trainers, max_staleness):
    """Two pushes may be in flight (max_in_flight=2 > k), so only ``wait_for_fresh`` keeps rollouts
    within k versions of the trainers' policy — on the slow engine too."""
    sync = WeightSync(trainers=trainers, engines=engines,
                      config=SyncConfig(**CONFIG, max_in_flight=2, max_staleness=max_staleness))
    lags, waited_s, handles = [], [], []
    try:
        sync.push(0)
        set_apply_delay(engines[1], SLOW_APPLY_S)
        for step in range(6):  # the trainers hold policy version `step`
            t0 = time.perf_counter()
            sync.wait_for_fresh(timeout_s=60)
            waited_s.append(time.perf_counter() - t0)
            for engine in engines:
                _, version = ray.get(engine.generate.remote([1, 2, 3], 2), timeout=60)
                lags.append(step - version)
                assert not sync.is_stale(version)
            ray.get([t.train_step.remote(step + 1) for t in trainers])
            handles.append(sync.push_async(step + 1))
        assert all(h.result(timeout=120).version == i + 1 for i, h in enumerate(handles))
    finally:
        sync.close()
    assert max(lags) <= max_staleness, lags
    assert max(waited_s) > 0.05, f"wait_for_fresh never had to wait: {waited_s}"
    if max_staleness:
        assert max(lags) == 1, f"no rollout overlapped a transfer: {lags}"
    assert set(sync.engine_versions().values()) == {6}


def test_late_joiner_is_exact_at_version_5_then_follows_deltas_and_the_others_get_only_deltas(
        files, engines, trainers, peft_oracle):
    sync = WeightSync(trainers=trainers, engines=engines, config=SyncConfig(**CONFIG))
    replay = AdapterReplay(files[1])
    [joiner] = start_engines(files[0], 1, prefix="joiner")
    try:
        pushes = {}
        for v in range(1, 6):
            if v > 1:
                ray.get([t.train_step.remote(v) for t in trainers])
                replay.step(v)
            pushes[v] = sync.push(v)
        full_bytes, delta_bytes = pushes[1].engines[0].payload_bytes, pushes[5].engines[0].payload_bytes
        assert pushes[1].full and not pushes[5].full and delta_bytes < full_bytes
        at_5 = peft_oracle.state(files[0], replay)

        training = [t.train_step.remote(6) for t in trainers]  # training goes on during the join
        name = sync.add_engine(joiner)
        ray.get(training)
        replay.step(6)
        join = sync.joins[-1]
        assert (join.engine, join.version, join.source) == (name, 5, "peer:live0")
        model_bytes = sum(t.numel() * t.element_size() for t in at_5.values())
        for nbytes in (join.bytes, full_bytes):  # every parameter once (+ < 64 B alignment per entry)
            assert model_bytes <= nbytes < model_bytes + 64 * len(at_5)
        assert_engines_match([joiner], at_5, what="late joiner at version 5")
        assert_engines_bitwise([joiner], ray.get(engines[0].state.remote(), timeout=120), what="peer copy of live0")
        assert sync.committed_version == 5

        for v in (6, 7):
            if v == 7:
                ray.get([t.train_step.remote(7) for t in trainers])
                replay.step(7)
            m = sync.push(v)
            assert not m.full and len(m.engines) == 3
            assert {e.engine: e.payload_bytes for e in m.engines} == {"live0": delta_bytes, "live1": delta_bytes,
                                                                      name: delta_bytes}
            assert_engines_match(engines + [joiner], peft_oracle.state(files[0], replay), what=f"version {v}")
        assert sync.engine_versions() == {"live0": 7, "live1": 7, name: 7}
    finally:
        sync.close()
        ray.kill(joiner)
