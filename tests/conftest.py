"""Shared pytest fixtures. Tests generate their inputs; nothing is downloaded."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

from tests.ray_session import local_ray  # noqa: E402


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray per test module: 2 CPUs, its own short temp dir, no dashboard; yields the dir."""
    with local_ray() as tmp:
        yield tmp


@pytest.fixture(scope="session")
def peft_oracle():
    """``tests.oracle.OracleCache``: PEFT's float64 merge, cast once, computed once per base + adapter values."""
    from tests.oracle import OracleCache

    return OracleCache()


@pytest.fixture(scope="module")
def trainer_pool(ray_local):
    """Two empty ``TrainerShard`` actors a module reloads per case (``start_trainers(..., reuse=pool)``)."""
    import ray

    from actors.trainer import TrainerShard

    pool = [TrainerShard.remote(base_dir="", adapter_dir=None) for _ in range(2)]
    yield pool
    for actor in pool:
        ray.kill(actor)
