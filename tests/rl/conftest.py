"""Fixtures of the live-refresh tests: one local Ray for the directory (own temp dir, 2 CPUs; every module kills
the actors it starts), generated files, and an apply-delay injector for a deliberately slow engine."""

from __future__ import annotations

import shutil
import tempfile
import time

import pytest

import ray

from tests.ray_session import local_ray


@pytest.fixture(scope="package")
def ray_local():
    """One local Ray for the directory's modules (``tests.ray_session.local_ray``; was one per module); yields its
    temp dir."""
    with local_ray() as tmp:
        yield tmp


class DelayedApply:
    """An EngineAdapter wrapper whose ``apply`` sleeps ``delay_s`` first (a slow engine)."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    def apply(self, name, box, data):
        time.sleep(self.delay_s)
        self.inner.apply(name, box, data)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


def _set_apply_delay(actor, delay_s: float) -> None:
    inner = actor.engine.inner if isinstance(actor.engine, DelayedApply) else actor.engine
    actor.engine = DelayedApply(inner, delay_s) if delay_s else inner
    for _, receiver, _ in actor._channels.values():
        receiver.adapter = actor.engine


def set_apply_delay(engine, delay_s: float) -> None:
    """Make a RolloutEngine actor sleep ``delay_s`` before every apply (0: back to normal)."""
    ray.get(engine.__ray_call__.remote(_set_apply_delay, delay_s), timeout=60)
