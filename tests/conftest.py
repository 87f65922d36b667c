"""Shared pytest fixtures. Tests generate their inputs; nothing is downloaded.

Set-up paid once: ``ray_local`` (one local Ray per module), ``peft_oracle`` (PEFT's merge once per base and
adapter values), ``netns_hosts`` (one set of namespace hosts with a Ray cluster for the session, built on first
use and torn down after its last user: ``tests/shared_hosts.py``); ``tests/vllm/conftest.py``'s
``vllm_server`` (one vLLM server for the session: ``tests/vllm/shared_server.py``).
"""

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


_SHARED_HOSTS: list = []  # the session's SharedHosts once ``netns_hosts`` built it


@pytest.fixture(scope="session")
def netns_hosts():
    """``tests.shared_hosts.SharedHosts``: namespace hosts ``trainers`` / ``engines0`` / ``engines1`` (1 Gbit/s
    uplink) with a Ray node in each, built once for the session; skipped where namespaces are not allowed."""
    from tests.shared_hosts import SharedHosts, available

    why = available()
    if why is not None:
        pytest.skip(why)
    shared = SharedHosts()
    _SHARED_HOSTS.append(shared)
    try:
        yield shared.ensure()
    finally:
        shared.stop()


def pytest_runtest_teardown(item, nextitem):
    """After each test: the shared namespace hosts get their links back up, or are torn down once no later test
    of the session uses them (not held through the rest of the suite)."""
    for shared in _SHARED_HOSTS:
        if shared.cluster is None:
            continue
        items = item.session.items
        if any("netns_hosts" in getattr(later, "fixturenames", ()) for later in items[items.index(item) + 1:]):
            shared.clean()
        else:
            shared.stop()

