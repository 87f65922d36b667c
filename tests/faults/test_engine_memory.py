"""An engine's memory after its ``WeightSync`` is closed: the staging buffers it keeps between syncs (a copy
of every tensor a sync writes) are freed when its last channel closes, and a later ``WeightSync`` on the same
engine reserves them again and stays exact. Real actors of the fault pool (transformers engines)."""

from __future__ import annotations

import pytest

from sync_service.api import SyncConfig, WeightSync
from tests.faults.conftest import TIMEOUT_S, assert_oracle_state

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.faults


def _staging_bytes(actor) -> int:
    """Inside an engine: bytes of the staging buffers it holds for the next sync."""
    return sum(t.nbytes for t in actor.engine._staging._spare.values())


def test_close_frees_the_engines_staging(pool):
    trainers, engine = pool.trainers(ep=1), pool.engines[0]
    replay = pool.replay()
    held = lambda: ray.get(engine.__ray_call__.remote(_staging_bytes), timeout=TIMEOUT_S)  # noqa: E731
    config = SyncConfig(transport="shm", bucket_bytes=1 << 10, timeout_s=TIMEOUT_S)
    sync = WeightSync(trainers=trainers, engines=[engine], config=config)
    try:
        sync.push(pool.next_version())
        total = sum(a.nbytes for a in ray.get(engine.state.remote(), timeout=TIMEOUT_S).values())
        assert held() == total, "a full sync leaves the replaced tensors as the next sync's staging"
    finally:
        sync.close()
    assert held() == 0, "WeightSync.close() left the engine's staging buffers allocated"
    sync = WeightSync(trainers=trainers, engines=[engine], config=config)
    try:
        replay.step(trainers, 1)
        v = pool.next_version()
        sync.push(v)
        assert_oracle_state(engine, replay.oracle(), f"push({v}) after a close and a new WeightSync")
    finally:
        sync.close()
