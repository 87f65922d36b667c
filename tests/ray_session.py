"""The local Ray every test module starts: one place for its options and its clean-up."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import ray

from sync_service.defaults import RAY_WORKER_ENV

ROOT = str(Path(__file__).resolve().parents[1])
"""The repository root: on the workers' PYTHONPATH when a test's own modules (``tests.*``) run inside actors."""


@contextlib.contextmanager
def local_ray(prefix: str = "wsray", *, importable: bool = False) -> Iterator[str]:
    """A local Ray for the block: 2 CPUs, no dashboard, its own short temp dir under /tmp (removed after), workers
    with the CLIs' ``RAY_WORKER_ENV``; ``importable``: the workers import this repository's ``tests`` too.
    Yields the temp dir; shuts Ray down however the block ends."""
    env = dict(RAY_WORKER_ENV)
    if importable:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    tmp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    try:
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tmp, log_to_driver=False,
                 runtime_env={"env_vars": env})
        yield tmp
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
