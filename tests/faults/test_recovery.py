"""Recoverable after every fault, and told at once: real actors killed or failing, each case with the
small input that once left the fleet stuck. Each test asserts the error the caller sees (type, text,
time well before ``timeout_s``) and the engines' weights afterwards (exactly a committed version: PEFT's
merge of the replayed adapter, or bit for bit the state an engine served before a failed push)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import ray

from protocols.endpoints import EndpointDiedError, EndpointTimeoutError
from sync_service.api import SyncConfig, SyncError, WeightSync
from tests.faults import inject
from tests.faults.conftest import assert_equal_state, assert_oracle_state, engine_state, kill_and_wait

pytestmark = pytest.mark.faults

TIMEOUT_S = 40.0
"""The push bound of these tests; every failure here must be reported well before it."""
PROMPT_S = 15.0
"""'At once' on a loaded 2-core machine: a fraction of ``TIMEOUT_S``, whatever the load."""


def config(**kw) -> SyncConfig:
    return SyncConfig(**{"transport": "shm", "bucket_bytes": 1 << 10, "timeout_s": TIMEOUT_S, **kw})


def names_of(engines) -> list[str]:
    return ray.get([e.engine_name.remote() for e in engines], timeout=30)


def versions(engines) -> list:
    return ray.get([e.weight_version.remote() for e in engines], timeout=30)


def test_dead_engine_at_reopen_is_dropped_and_never_blocks_the_others(pool):
    """push(v0), remove_engine(e0), kill e2, push(v1..v4): every push commits on e1; e2 is reported
    dead once and can still be removed; engine_versions() answers; e0 keeps v0."""
    trainers, (e0, e1, e2) = pool.trainers(ep=2), list(pool.engines)
    _, n1, n2 = names_of([e0, e1, e2])
    replay = pool.replay()
    sync = WeightSync(trainers=trainers, engines=[e0, e1, e2], config=config())
    try:
        v0 = pool.next_version()
        sync.push(v0)
        served_v0 = engine_state(e0)
        sync.remove_engine(e0)  # the channel must open again for the next push
        kill_and_wait(e2)
        pushed = []
        for step in range(1, 5):
            replay.step(trainers, step)
            v = pool.next_version()
            t0 = time.monotonic()
            metrics = sync.push(v)
            assert time.monotonic() - t0 < PROMPT_S, "a dead engine must not stall the push"
            pushed.append(metrics)
            assert [r.engine for r in metrics.engines if r.committed] == [n1], metrics.engines
        dead = [r for r in pushed[0].engines if not r.committed]
        assert len(dead) == 1 and dead[0].engine == n2 and "died" in dead[0].error, pushed[0].engines
        assert all(len(m.engines) == 1 for m in pushed[1:]), "e2 left the membership after the first push"
        assert sync.engine_versions() == {n1: v}
        sync.remove_engine(e2)  # already gone: no error
        assert versions([e0, e1]) == [v0, v]
        assert_oracle_state(e1, replay.oracle(), "e1 after four pushes past a dead engine")
        assert_equal_state(e0, served_v0, "the removed engine keeps serving v0")
    finally:
        sync.close()
        pool.replace(e2)


def test_remove_engine_on_a_dead_member_and_engine_versions_survive(pool):
    trainers, engines = pool.trainers(ep=1), pool.engines[:2]
    names = names_of(engines)
    sync = WeightSync(trainers=trainers, engines=engines, config=config())
    try:
        v = pool.next_version()
        sync.push(v)
        kill_and_wait(engines[1])
        assert sync.engine_versions() == {names[0]: v}
        sync.remove_engine(engines[1])  # a dead member: removed without a call reaching it
        with pytest.raises(ValueError, match="not a member"):
            sync.remove_engine(pool.engines[2])
        v2 = pool.next_version()
        assert [r.engine for r in sync.push(v2).engines if r.committed] == [names[0]]
    finally:
        sync.close()
        pool.replace(engines[1])


def test_failed_or_second_weightsync_never_breaks_the_first(pool):
    """A second WeightSync on the same actors that fails to construct (timeout_s=0.001), and one that
    works and closes, leave the first one pushing; the failure is the project's error, one line."""
    trainers, engines = pool.trainers(ep=2), pool.engines[:2]
    replay = pool.replay()
    first = WeightSync(trainers=trainers, engines=engines, config=config())
    try:
        first.push(pool.next_version())
        ray.get([e.__ray_call__.remote(inject.delay_receiver_open, 2.0) for e in engines], timeout=30)
        try:
            with pytest.raises(EndpointTimeoutError) as err:  # the engines attach after the 1 ms connect window
                WeightSync(trainers=trainers, engines=engines, config=config(timeout_s=0.001))
        finally:
            ray.get([e.__ray_call__.remote(inject.delay_receiver_open, 0) for e in engines], timeout=30)
        text = str(err.value)
        assert text.startswith("engine ") and "open_transport failed: TimeoutError: shm segment" in text, text
        dead = pool.engines[2]
        kill_and_wait(dead)
        with pytest.raises(EndpointDiedError, match="param_metas failed: ActorDiedError"):
            WeightSync(trainers=trainers, engines=[*engines, dead], config=config())
        assert "\x1b[" not in text and "Traceback" not in text and "\n" not in text, text
        second = WeightSync(trainers=trainers, engines=engines, config=config())
        second.push(pool.next_version())
        second.close()
        replay.step(trainers, 1)
        v = pool.next_version()
        assert all(r.committed for r in first.push(v).engines)
        assert versions(engines) == [v, v]
        for e in engines:
            assert_oracle_state(e, replay.oracle(), "first WeightSync after a failed and a closed second one")
    finally:
        first.close()
        pool.replace(pool.engines[2])


def test_nan_in_one_rank_aborts_every_participant_at_once_and_the_version_is_not_used_up(pool):
    """NaN in rank 1's factors: the push fails within seconds, not after timeout_s, naming rank 1 and
    the key; nothing is applied. push(v) again (factors repaired) commits v: the failed push did not
    use up its version."""
    trainers, engines = pool.trainers(ep=2), pool.engines[:2]
    replay = pool.replay()
    sync = WeightSync(trainers=trainers, engines=engines, config=config())
    try:
        v1 = pool.next_version()
        sync.push(v1)
        before = [engine_state(e) for e in engines]
        factors = ray.get(trainers[1].local_factors.remote(), timeout=30)
        key = sorted(k for k in factors if "layers.1" in k and "lora_B" in k)[0]
        poisoned = factors[key].copy()
        poisoned.flat[0] = np.nan
        ray.get(trainers[1].set_factors.remote({key: poisoned}), timeout=30)
        v2 = pool.next_version()
        t0 = time.monotonic()
        with pytest.raises(SyncError) as err:
            sync.push(v2)
        elapsed = time.monotonic() - t0
        assert elapsed < PROMPT_S, f"known at once, reported after {elapsed:.1f} s (timeout_s={TIMEOUT_S})"
        assert "trainer rank 1: send failed: MergeError" in str(err.value) and key in str(err.value), str(err.value)
        assert "\x1b[" not in str(err.value)
        assert versions(engines) == [v1, v1]
        for e, state in zip(engines, before):
            assert_equal_state(e, state, "after the NaN push")
        ray.get(trainers[1].set_factors.remote({key: factors[key]}), timeout=30)
        replay.step(trainers, 1)
        assert sync.latest_version == v1
        assert all(r.committed for r in sync.push(v2).engines)  # the same version again
        assert versions(engines) == [v2, v2]
        for e in engines:
            assert_oracle_state(e, replay.oracle(), f"after push({v2}) retried")
    finally:
        sync.close()


def test_engine_killed_50ms_into_a_push_ends_it_at_once(pool):
    """An engine dies 50 ms into a push: the others commit the version well before timeout_s."""
    trainers, engines = pool.trainers(ep=2), list(pool.engines)
    names = names_of(engines)
    replay = pool.replay()
    sync = WeightSync(trainers=trainers, engines=engines, config=config())
    try:
        sync.push(pool.next_version())
        replay.step(trainers, 1)
        ray.get(engines[2].__ray_call__.remote(inject.slow_apply, 0.05), timeout=30)
        v = pool.next_version()
        t0 = time.monotonic()
        handle = sync.push_async(v)
        threading.Timer(0.05, lambda: ray.kill(engines[2], no_restart=True)).start()
        metrics = handle.result(timeout=3 * TIMEOUT_S + 60)
        elapsed = time.monotonic() - t0
        assert elapsed < PROMPT_S, f"the death is known at once; the push took {elapsed:.1f} s"
        by_name = {r.engine: r for r in metrics.engines}
        assert by_name[names[0]].committed and by_name[names[1]].committed, metrics.engines
        assert not by_name[names[2]].committed and "died" in by_name[names[2]].error, by_name[names[2]]
        assert versions(engines[:2]) == [v, v]
        for e in engines[:2]:
            assert_oracle_state(e, replay.oracle(), "survivor of a death 50 ms into the push")
    finally:
        sync.close()
        pool.replace(engines[2])


def test_dead_trainer_is_named_not_a_bare_actor_died_error(pool):
    trainers, engines = pool.trainers(ep=2), pool.engines[:2]
    sync = WeightSync(trainers=trainers, engines=engines, config=config())
    try:
        v = pool.next_version()
        sync.push(v)
        before = [engine_state(e) for e in engines]
        ray.kill(trainers[1], no_restart=True)
        t0 = time.monotonic()
        with pytest.raises(EndpointDiedError, match=r"^trainer rank 1: snapshot failed: ActorDiedError: the actor died"):
            sync.push(pool.next_version())
        assert time.monotonic() - t0 < PROMPT_S
        assert versions(engines) == [v, v]
        for e, state in zip(engines, before):
            assert_equal_state(e, state, "after a push with a dead trainer")
    finally:
        sync.close()
        pool.replace(trainers[1])
