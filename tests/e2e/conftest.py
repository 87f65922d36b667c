"""Fixtures of the end-to-end sync tests: one local Ray and one pair of trainer actors for the whole directory
(each module's set-up used to start both again, ~15 s of a loaded machine per module). Every module kills the
engines it starts; the trainer actors are reloaded per case (``start_trainers(..., reuse=trainer_pool)``)."""

from __future__ import annotations

import pytest

from tests.ray_session import local_ray


@pytest.fixture(scope="package")
def ray_local():
    """One local Ray for the directory (``tests.ray_session.local_ray``); yields its temp dir."""
    with local_ray() as tmp:
        yield tmp


@pytest.fixture(scope="package")
def trainer_pool(ray_local):
    """Two empty ``TrainerShard`` actors the directory's modules reload per case."""
    import ray

    from actors.trainer import TrainerShard

    pool = [TrainerShard.remote(base_dir="", adapter_dir=None) for _ in range(2)]
    yield pool
    for actor in pool:
        ray.kill(actor)
