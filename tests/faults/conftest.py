"""Fixtures of the fault suite: one local Ray for the whole package (own temp dir, 2 CPUs), a tiny
real Qwen3-MoE checkpoint + PEFT adapter, a pool of real actors (2 trainer shards, 3 transformers
engines) shared by the tests — a test that kills an actor puts a fresh one in its place — and
checks of the engines' weights: against PEFT's ``merge_and_unload`` of the replayed adapter (float64, cast
once; ``tests.oracle``), and bitwise against an engine's own earlier state where a failure must change nothing."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray
import torch

from tests.oracle import assert_engines_bitwise, assert_engines_match
from tests.ray_session import local_ray

E = 4
TIMEOUT_S = 10.0


def kill_and_wait(actor, timeout_s: float = 60.0) -> None:
    """``ray.kill`` and wait until Ray reports the actor dead (the kill is asynchronous: a call made
    right after it may still be answered). Raises AssertionError if it still answers after ``timeout_s``."""
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            break
        time.sleep(0.05)
    raise AssertionError(f"actor {actor} still answers {timeout_s} s after ray.kill")


@pytest.fixture(scope="package")
def ray_local():
    with local_ray("wsf", importable=True) as tmp:
        yield tmp


@pytest.fixture(scope="package")
def model_files(tmp_path_factory):
    """(base_dir, adapter_dir): a 2-layer Qwen3-MoE (E=4, H=16, I=8, fp32) and a rank-2 LoRA on
    attention + experts (PEFT ``target_parameters``)."""
    from sync_service.synthetic import make_adapter, make_base

    root = tmp_path_factory.mktemp("faults")
    base = make_base("qwen3_moe", root / "base", num_experts=E, num_layers=2)
    return base, make_adapter("qwen3_moe", base, root / "lora", kind="target_parameters", r=2)


class Replay:
    """The driver side of a test: the adapter after the same ``train_step``s as the trainers."""

    def __init__(self, base, adapter, oracles):
        from sync_service.entrypoints.local import AdapterReplay

        self.base, self.replay, self.oracles = base, AdapterReplay(adapter), oracles

    def step(self, trainers, step: int) -> None:
        ray.get([t.train_step.remote(step) for t in trainers], timeout=60)
        self.replay.step(step)

    def oracle(self) -> dict[str, torch.Tensor]:
        """PEFT's merge of the replayed adapter (``tests.oracle.OracleCache``): what the engines must serve."""
        return self.oracles.state(self.base, self.replay)


def engine_state(engine) -> dict[str, np.ndarray]:
    return ray.get(engine.state.remote(), timeout=60)


def assert_oracle_state(engine, oracle: dict[str, torch.Tensor], what: str) -> None:
    """The engine serves ``oracle`` (``Replay.oracle()``) up to fp32-merge rounding (``values_match``)."""
    assert_engines_match([engine], oracle, what=what, timeout_s=60)


def assert_equal_state(engine, expected: dict, what: str) -> None:
    """Bitwise equality of every served parameter with ``expected`` (numpy arrays or torch tensors)."""
    assert_engines_bitwise([engine], expected, what=what, timeout_s=60)


class Pool:
    """Actors shared by the fault tests. ``trainers(ep)`` reloads the first ``ep`` trainer actors
    (fresh factors from the adapter); ``replace(actor)`` kills ``actor`` if needed and puts a new
    one of its kind in its place. Weight versions keep increasing across tests (``next_version``):
    every WeightSync starts its versions above any an engine has served."""

    def __init__(self, base, adapter, oracles):
        from actors.trainer import TrainerShard
        from actors.launch import start_engines

        self.base, self.adapter, self.oracles = base, adapter, oracles
        self.trainer_actors = [TrainerShard.remote(base_dir=str(base), adapter_dir=str(adapter)) for _ in range(2)]
        self.engines = start_engines(base, 3, prefix="e", timeout_s=600)
        self._version = 0

    def trainers(self, ep: int) -> list:
        from actors.launch import start_trainers

        return start_trainers(self.base, self.adapter, ep=ep, reuse=self.trainer_actors[:ep], timeout_s=600)

    def replay(self) -> Replay:
        """A replay of the adapter from its initial state (the trainers' state after ``trainers(ep)``)."""
        return Replay(self.base, self.adapter, self.oracles)

    def next_version(self) -> int:
        self._version += 1
        return self._version

    def replace(self, actor) -> object:
        from actors.trainer import TrainerShard
        from actors.launch import start_engines

        ray.kill(actor, no_restart=True)
        if actor in self.trainer_actors:
            i = self.trainer_actors.index(actor)
            self.trainer_actors[i] = TrainerShard.remote(base_dir=str(self.base), adapter_dir=str(self.adapter))
            return self.trainer_actors[i]
        i = self.engines.index(actor)
        [self.engines[i]] = start_engines(self.base, 1, prefix=f"e{i}r", timeout_s=600)
        return self.engines[i]

    def close(self) -> None:
        for a in self.trainer_actors + self.engines:
            ray.kill(a)


@pytest.fixture(scope="package")
def pool(ray_local, model_files, peft_oracle):
    p = Pool(*model_files, peft_oracle)
    yield p
    p.close()
