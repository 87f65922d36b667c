"""Shared pytest fixtures. Tests generate their inputs; nothing is downloaded."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import shutil
import tempfile

import pytest
import ray


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray per test module: 2 CPUs, its own short temp dir, no dashboard; yields the dir."""
    tmp = tempfile.mkdtemp(prefix="wsray", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tmp, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}})
    try:
        yield tmp
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
