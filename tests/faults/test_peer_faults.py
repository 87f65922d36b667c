"""A peer dies or raises mid-stream: real Ray actors killed (``ray.kill``) or failing inside the
transfer; asserts the error the caller sees and every engine's weights afterwards."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from sync_service.api import SyncConfig, SyncError, WeightSync
from tests.faults import inject
from tests.faults.conftest import TIMEOUT_S, assert_oracle_state

pytestmark = pytest.mark.faults

BUCKET_BYTES = 1 << 10  # ~30 buckets per full sync of the tiny model: a sync stays in flight while a peer dies


def config(transport: str = "shm") -> SyncConfig:
    return SyncConfig(transport=transport, bucket_bytes=BUCKET_BYTES, timeout_s=TIMEOUT_S)


def kill_after(actor, after_s: float) -> None:
    timer = threading.Timer(after_s, lambda: ray.kill(actor, no_restart=True))
    timer.start()
    timer.join()


def test_receiver_raises_inside_torch_dist_transfer(pool):
    """torch.distributed: an engine raises while the trainer is mid-stream in its broadcasts; the
    trainer fails within 5 s with the engine's message, and the next push works on the same channel."""
    trainers, engines = pool.trainers(ep=1), pool.engines[:2]  # torch_dist carries one sender
    replay = pool.replay()
    sync = WeightSync(trainers=trainers, engines=engines, config=config("torch"))
    try:
        v = pool.next_version()
        sync.push(v)
        before = replay.oracle()
        replay.step(trainers, 1)
        name = "model.layers.1.mlp.experts.down_proj"
        ray.get(engines[1].__ray_call__.remote(inject.fail_apply, name, "injected: staging buffer poisoned"), timeout=30)
        t0 = time.monotonic()
        with pytest.raises(SyncError, match="injected: staging buffer poisoned") as err:
            sync.push(pool.next_version())
        assert time.monotonic() - t0 < TIMEOUT_S, "the engine's error must end the push, not the sync timeout"
        assert "receiver 1" in str(err.value)
        assert not any(e.committed for e in err.value.metrics.engines)
        for e in engines:
            assert ray.get(e.weight_version.remote(), timeout=30) == v
            assert_oracle_state(e, before, "engine after the failed push")
        replay.step(trainers, 2)
        sync.push(pool.next_version())
        for e in engines:
            assert_oracle_state(e, replay.oracle(), "engine after the next push")
    finally:
        sync.close()


def test_trainer_killed_mid_stream_aborts_within_timeout_no_engine_changes(pool):
    trainers, engines = pool.trainers(ep=2), pool.engines[:2]
    replay = pool.replay()
    sync = WeightSync(trainers=trainers, engines=engines, config=config())
    try:
        v = pool.next_version()
        sync.push(v)
        before = replay.oracle()
        ray.get([t.train_step.remote(1) for t in trainers], timeout=30)
        ray.get(trainers[1].__ray_call__.remote(inject.slow_fill, 0.3), timeout=30)
        handle = sync.push_async(pool.next_version())
        kill_after(trainers[1], 1.0)
        t0 = time.monotonic()
        with pytest.raises(SyncError, match=r"aborted") as err:
            handle.result(timeout=3 * TIMEOUT_S + 60)
        assert time.monotonic() - t0 < TIMEOUT_S + 30, "the abort must come within the sync timeout"
        assert "died" in str(err.value), err.value
        assert not any(e.committed for e in err.value.metrics.engines)
        for e in engines:
            assert ray.get(e.weight_version.remote(), timeout=30) == v
            assert_oracle_state(e, before, "engine after the aborted push")
    finally:
        sync.close()
        pool.replace(trainers[1])


def test_engine_killed_mid_stream_others_commit_and_a_restarted_engine_catches_up(pool):
    trainers, engines = pool.trainers(ep=2), list(pool.engines)
    names = ray.get([e.engine_name.remote() for e in engines], timeout=30)
    replay = pool.replay()
    sync = WeightSync(trainers=trainers, engines=engines, config=config())
    try:
        sync.push(pool.next_version())
        replay.step(trainers, 1)
        ray.get(engines[1].__ray_call__.remote(inject.slow_apply, 0.2), timeout=30)
        v = pool.next_version()
        handle = sync.push_async(v)
        kill_after(engines[1], 1.0)
        metrics = handle.result(timeout=3 * TIMEOUT_S + 60)
        by_name = {e.engine: e for e in metrics.engines}
        lost = by_name[names[1]]
        assert not lost.committed and names[1] in lost.error and "died" in lost.error, lost
        assert by_name[names[0]].committed and by_name[names[2]].committed, by_name
        expected = replay.oracle()
        for e in (engines[0], engines[2]):
            assert ray.get(e.weight_version.remote(), timeout=30) == v
            assert_oracle_state(e, expected, "survivor")
        assert sync.engine_versions() == {names[0]: v, names[2]: v}  # the dead engine left the membership

        restarted = pool.replace(engines[1])
        sync.add_engine(restarted)  # brought to the latest version before its first push
        assert ray.get(restarted.weight_version.remote(), timeout=30) == v
        assert_oracle_state(restarted, expected, "restarted engine after add_engine")
        replay.step(trainers, 2)
        sync.push(pool.next_version())
        for e in (engines[0], engines[2], restarted):
            assert_oracle_state(e, replay.oracle(), "every member after the next push")
    finally:
        sync.close()
