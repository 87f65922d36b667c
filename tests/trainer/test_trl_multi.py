"""TRL ``GRPOTrainer`` (CPU) with the ``WeightSyncCallback`` over several processes, and GRPO's rollouts made
by the weightsync-updated engines (``engine_rollout_func``).

(a) Two training processes, each a Ray actor (``max_concurrency=2``) that joins a gloo group itself
    (accelerate's env: RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT): rank 0 gathers both endpoints and
    pushes; after each of 3 optimizer steps every engine equals PEFT's float64 merge of the adapter both
    ranks hold (bitwise equal on the two ranks: DDP), and both ranks trained on completions sampled by the
    engines at the version just pushed. A second run refused by rank 0's coordinator fails on both ranks.
(b) GRPO whose completions come from the engines: reward 1 when a completion's first word is a number
    word. With weight sync the engines serve each step's policy and the reward rises; the control run is
    the same without the callback (the engines keep the base model) and its reward does not rise. Every
    completion TRL trained on came from the version pushed after the previous optimizer step (the
    ``weight_version`` TRL hands the reward function); a rollout from an engine at another version is
    refused.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from tests.trainer.conftest import assert_engines_hold, peft_merged, ray

pytest.importorskip("trl")

FAMILY = "qwen3_moe"
NUMBER_WORDS = frozenset("one two three four five six seven eight nine ten".split())
PROMPTS = ["the red cat", "a big dog", "the sun and", "up down left"]


def number_reward(completions, **kwargs) -> list[float]:
    """1.0 when the completion's first word is a number word (10 of the 64-token vocabulary), else 0.0."""
    return [1.0 if c.split() and c.split()[0] in NUMBER_WORDS else 0.0 for c in completions]


@ray.remote(num_cpus=0, max_concurrency=2)
class TRLProcess:
    """One process of a user's (possibly multi-process) TRL run."""

    def __init__(self, rank: int, world: int, port: int) -> None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                          TRL_EXPERIMENTAL_SILENCE="1")
        torch.set_num_threads(1)
        self.rank, self.world = rank, world

    def run(self, base_dir: str, engines: list, out_dir: str, *, steps: int, sync: bool, lr: float = 5e-2,
            completion_len: int = 6, batch: int = 4, generations: int = 4, check_version: bool | None = None) -> dict:
        """Train ``steps`` GRPO steps on completions sampled by ``engines`` (``engine_rollout_func``), with the
        ``WeightSyncCallback`` if ``sync``. Returns what was recorded: ``pushes`` (rank 0: version, full, every
        engine's state right after the push), ``adapters`` (step -> this rank's adapter), ``trained``
        (step, the weight version of every completion the rewards scored), ``rewards`` (per step).
        ``check_version``: the rollout's version check (default: ``sync``)."""
        from datetime import timedelta

        import torch.distributed as dist
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer

        from sync_service.integrations.trl import engine_rollout_func
        from tests.trainer.harness import lora_config

        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("gloo", rank=self.rank, world_size=self.world, timeout=timedelta(seconds=120))
        out = {"pushes": [], "adapters": {}, "trained": [], "rewards": []}

        def reward(completions, weight_version, trainer_state, **kw):
            values = number_reward(completions)
            out["rewards"].append(values)
            out["trained"].append((trainer_state.global_step, list(weight_version)))
            return values

        args = GRPOConfig(output_dir=out_dir, use_cpu=True, per_device_train_batch_size=batch,
                          num_generations=generations, max_completion_length=completion_len, max_steps=steps,
                          learning_rate=lr, report_to=[], save_strategy="no", logging_steps=1, bf16=False,
                          gradient_checkpointing=False, seed=0, disable_tqdm=True,
                          lr_scheduler_type="constant")
        check = sync if check_version is None else check_version
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), reward_funcs=reward,
            args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
            processing_class=AutoTokenizer.from_pretrained(base_dir), peft_config=lora_config(),
            rollout_func=engine_rollout_func(engines, max_new_tokens=completion_len, check_version=check),
            callbacks=_callbacks(engines, out, sync))
        trainer.train()
        out["processes"] = trainer.accelerator.num_processes
        return out


def _callbacks(engines: list, out: dict, sync: bool) -> list:
    """[the sync callback (if ``sync``; rank 0 records every engine's state at each push), a recorder of the
    adapter this rank holds at each step (after the push)]."""
    from peft import get_peft_model_state_dict
    from transformers import TrainerCallback

    from sync_service.api import SyncConfig
    from sync_service.integrations.trl import WeightSyncCallback

    def adapter(model) -> dict:
        return {k: v.detach().numpy().copy() for k, v in get_peft_model_state_dict(model).items()}

    class Recorder(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            out["adapters"][state.global_step] = adapter(model)

        def on_step_end(self, args, state, control, model=None, **kw):
            out["adapters"][state.global_step] = adapter(model)

    def on_push(version, metrics, model):
        out["pushes"].append((version, metrics.full, ray.get([e.state.remote() for e in engines], timeout=120)))

    config = SyncConfig(transport="shm", bucket_bytes=16 << 10, timeout_s=120)
    return ([WeightSyncCallback(engines=engines, config=config, on_push=on_push)] if sync else []) + [Recorder()]


def _start(world: int) -> list:
    from sync_service.transports.store import free_port

    port = free_port()
    return [TRLProcess.remote(r, world, port) for r in range(world)]


def test_two_process_grpo_pushes_every_step(ray_local, bases, tmp_path):
    from actors.launch import start_engines
    from sync_service.integrations.trl import RankZeroFailed

    engines = start_engines(bases[FAMILY], 2, prefix="trlmulti")
    procs = _start(2)
    t0 = time.perf_counter()
    try:
        results = ray.get([p.run.remote(str(bases[FAMILY]), engines, str(tmp_path / f"out{r}"), steps=3, sync=True)
                           for r, p in enumerate(procs)], timeout=600)
        print(f"two-process GRPO, 3 steps: {time.perf_counter() - t0:.1f} s")
        # a second run on the same engines numbers from 0 again without SyncConfig(reset_versions=True): rank 0's
        # push of version 0 is refused, and both ranks fail at once (rank 1 learns it from rank 0's broadcast)
        refs = [p.run.remote(str(bases[FAMILY]), engines, str(tmp_path / f"again{r}"), steps=1, sync=True)
                for r, p in enumerate(procs)]
        with pytest.raises(ValueError, match="already serves version 3"):
            ray.get(refs[0], timeout=300)
        with pytest.raises(RankZeroFailed, match="rank 0's start \\+ push 0 failed"):
            ray.get(refs[1], timeout=300)
    finally:
        for actor in procs:
            ray.kill(actor)
    rank0, rank1 = results
    assert rank0["processes"] == rank1["processes"] == 2
    assert [(v, full) for v, full, _ in rank0["pushes"]] == [(0, True), (1, False), (2, False), (3, False)]
    assert rank1["pushes"] == [], "only rank 0 pushes"
    for out in results:  # each rank trained on 4 completions per step, all sampled at the version just pushed
        assert out["trained"] == [(step, [step] * 4) for step in range(3)]
    assert sorted(rank0["adapters"]) == sorted(rank1["adapters"]) == [0, 1, 2, 3]
    for version in range(4):  # DDP: both ranks hold the same adapter
        a0, a1 = rank0["adapters"][version], rank1["adapters"][version]
        assert all(np.array_equal(a0[k], a1[k]) for k in a0), f"ranks' adapters differ at step {version}"
    first, last = rank0["adapters"][0], rank0["adapters"][3]
    assert any(not np.array_equal(first[k], last[k]) for k in first), "GRPO steps changed no LoRA factor"
    assert any(".experts." in k for k in first)
    for version, _, states in rank0["pushes"]:  # what each engine served right after push `version`
        adapter = {k: torch.from_numpy(v.copy()) for k, v in rank0["adapters"][version].items()}
        oracle = peft_merged(bases[FAMILY], adapter, tmp_path / f"v{version}")
        for e, state in enumerate(states):
            assert set(state) == set(oracle), f"version {version}: engine {e} names differ"
            for name, ref in oracle.items():
                torch.testing.assert_close(torch.from_numpy(np.array(state[name])), ref, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name: f"version {version}: engine {e}: {n}: {m}")
    assert_engines_hold(engines, oracle, what="after training")  # still version 3: the refused run changed nothing
    for e in engines:
        ray.kill(e)


STEPS, WINDOW = 12, 4
"""GRPO steps of each run of (b); reward windows averaged at its start and end. Measured: the synced run's
reward goes 0.22 (base) -> plateau near 0.45 (windows 0.31 -> 0.46); the control's windows 0.19 -> 0.14 (its
curve is deterministic: fixed base, seeded sampling)."""


def test_grpo_rollouts_from_synced_engines_learn(ray_local, bases, tmp_path):
    from actors.launch import start_engines

    engines = start_engines(bases[FAMILY], 1, prefix="trlrl")
    proc, runs = _start(1)[0], {}
    try:
        for sync in (False, True):  # the control first: the engine keeps the base model
            t0 = time.perf_counter()
            runs[sync] = ray.get(proc.run.remote(str(bases[FAMILY]), engines, str(tmp_path / f"rl{sync}"), steps=STEPS,
                                                 sync=sync, lr=0.1, completion_len=1, batch=32, generations=8),
                                 timeout=600)
            print(f"sync={sync}: {time.perf_counter() - t0:.1f} s, reward per step "
                  f"{[round(float(np.mean(r)), 3) for r in runs[sync]['rewards']]}")
        with pytest.raises(RuntimeError, match=r"engines served versions \[12\] at step 0; expected 0"):
            ray.get(proc.run.remote(str(bases[FAMILY]), engines, str(tmp_path / "stale"), steps=1, sync=False,
                                    check_version=True, completion_len=1, batch=8, generations=8), timeout=300)
    finally:
        for actor in [proc, *engines]:
            ray.kill(actor)
    synced, control = (_windows([float(np.mean(r)) for r in runs[k]["rewards"]]) for k in (True, False))
    assert runs[True]["trained"] == [(step, [step] * 32) for step in range(STEPS)], "a rollout from another version"
    assert runs[False]["trained"] == [(step, [None] * 32) for step in range(STEPS)], "the control's engine was synced"
    assert [v for v, *_ in runs[True]["pushes"]] == list(range(STEPS + 1))
    assert synced[1] - synced[0] >= 0.1, f"reward with weight sync did not rise: {synced}"
    assert control[1] - control[0] <= 0.05, f"the control's reward rose without weight sync: {control}"
    assert synced[1] >= control[1] + 0.2, f"synced {synced} vs control {control}"


def _windows(curve: list[float]) -> tuple[float, float]:
    """Mean reward of the first and of the last ``WINDOW`` steps."""
    return float(np.mean(curve[:WINDOW])), float(np.mean(curve[-WINDOW:]))
