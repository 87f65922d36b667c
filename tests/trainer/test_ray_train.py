"""A real Ray Train run syncs its live PEFT model: ``TorchTrainer`` (Ray Train V2, the default of ray 2.60),
``ScalingConfig(num_workers=2, use_gpu=False)``, gloo. Each worker builds the example PEFT Qwen3-MoE
(``ExampleTrainingRank.build``: LoRA r=2 on q/v and the fused experts, FSDP2 ``fully_shard`` per decoder layer
over Ray Train's process group, AdamW) and calls ``attach_trainer(model)`` in its train loop; the driver gets
the 2 endpoint handles from the workers through a ``ray.util.queue.Queue``, builds ``WeightSync`` over 2
transformers engines and pushes version ``step`` after each of 3 AdamW steps, while ``trainer.fit()`` blocks
on a thread of the test.

Checked per version: every engine parameter equals PEFT's float64 ``merge_and_unload`` (cast once to float32)
of the adapter the workers hold (both workers' gathered adapters equal); the factors changed since the last
version; the push left each worker's params, grads and AdamW state bitwise unchanged (sha256 digest taken in
the worker before the push and after it). The run ends with the engines at version 2 and ``fit()`` clean.

Ray Train's worker actor (``RayTrainWorker``) is a plain actor (``max_concurrency`` 1) whose ``run_train_fn``
starts the train loop on a thread and returns; the actor's own thread then serves the controller's
``poll_status`` and weightsync's ``__ray_call__``s, so the endpoint is reached while the loop runs, with no
Ray Train option. A send queues the controller's status polls behind it (bounded by
``RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S``, 600 s). Every wait here is bounded: the workers wait for the
driver's "pushed" signal at most ``WAIT_S``, and the driver stops them (``None``) whatever happens.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.trainer.conftest import assert_engines_hold, differs, peft_merged, ray

CONFIG_KW = dict(transport="shm", bucket_bytes=16 << 10, timeout_s=120, reset_versions=True)
WORLD = 2
STEPS = 3
WAIT_S = 90.0
"""Bound of every wait: a worker for the driver's signal, the driver for the workers' reports."""


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from sync_service.synthetic import make_base

    return make_base("qwen3_moe", tmp_path_factory.mktemp("raytrain") / "qwen3_moe", num_experts=4, num_layers=2,
                     hidden=32)


@pytest.fixture(scope="module")
def engines(ray_local, base):
    from actors.launch import start_engines

    return start_engines(base, 2, prefix="raytrain")


def _train_loop(config: dict) -> None:
    """``train_loop_per_worker``: build, wrap (FSDP2), attach; then per step: AdamW step, report the adapter and
    the state digest, wait for the driver's push, report the digest again. Runs on Ray Train's training thread."""
    import torch.distributed as dist
    from ray import train

    from sync_service.live import attach_trainer
    from sync_service.live.example import ExampleTrainingRank

    ctx = train.get_context()
    rank = ExampleTrainingRank(ctx.get_world_rank(), ctx.get_world_size())
    model = rank.build(config["base"], "fsdp2")  # over the default group Ray Train made
    handle = attach_trainer(model)
    reports, go = config["reports"], config["go"][rank.rank]
    placements = sorted({repr(tuple(p.placements)) for p in rank.peft.parameters() if hasattr(p, "placements")})
    reports.put(dict(kind="attached", rank=rank.rank, handle=handle, backend=dist.get_backend(),
                     world=dist.get_world_size(), placements=placements,
                     main_thread=threading.current_thread() is threading.main_thread()), timeout=WAIT_S)
    for step in range(STEPS):
        loss = rank.train_step()
        adapter = rank.adapter_state()  # collective over Ray Train's group
        reports.put(dict(kind="stepped", rank=rank.rank, step=step, loss=loss, digest=rank.digest(), adapter=adapter),
                    timeout=WAIT_S)
        if go.get(timeout=WAIT_S) != step:  # None: the driver stopped the run
            return
        reports.put(dict(kind="pushed", rank=rank.rank, step=step, digest=rank.digest()), timeout=WAIT_S)


class _Fit:
    """``trainer.fit()`` on a daemon thread (it blocks until the workers return); its result or error."""

    def __init__(self, trainer) -> None:
        self.result, self.error = None, None
        self._thread = threading.Thread(target=self._run, args=(trainer,), daemon=True, name="ray-train-fit")
        self._thread.start()

    def _run(self, trainer) -> None:
        try:
            self.result = trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test
            self.error = exc

    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self, timeout_s: float) -> None:
        """Wait for ``fit()`` to end, at most ``timeout_s``; raises nothing."""
        self._thread.join(timeout_s)

    def join(self, timeout_s: float):
        """``fit()``'s result, waited for at most ``timeout_s``; raises its error."""
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"trainer.fit() still running after {timeout_s} s"
        if self.error is not None:
            raise self.error
        return self.result


class _Inbox:
    """The workers' reports, by kind and step (a worker may report its next step before its peer reports this one)."""

    def __init__(self, queue, run: _Fit) -> None:
        self.queue, self.run, self.held = queue, run, []

    def take(self, kind: str, step: int | None = None) -> list[dict]:
        """The ``WORLD`` reports ``kind`` (of ``step``), in rank order; waits at most ``WAIT_S``.

        Raises:
            AssertionError: ``fit()`` ended first (with its error), or the reports did not come in time.
        """
        from ray.util.queue import Empty

        end = time.monotonic() + WAIT_S
        while True:
            mine = [m for m in self.held if m["kind"] == kind and m.get("step") == step]
            if len(mine) == WORLD:
                self.held = [m for m in self.held if all(m is not x for x in mine)]
                return sorted(mine, key=lambda m: m["rank"])
            assert time.monotonic() < end, f"{kind} {step}: {len(mine)} of {WORLD} reports in {WAIT_S} s"
            try:
                self.held.append(self.queue.get(timeout=1.0))
            except Empty:
                if not self.run.running():
                    self.run.join(0)
                    raise AssertionError(f"trainer.fit() returned before reporting {kind} {step}")


def test_ray_train_workers_attach_and_every_push_serves_the_peft_merge(base, engines, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.util.queue import Queue

    from sync_service.api import SyncConfig, WeightSync

    assert TorchTrainer.__module__.startswith("ray.train.v2."), TorchTrainer.__module__  # RAY_TRAIN_V2_ENABLED
    reports = Queue(actor_options={"num_cpus": 0})
    go = [Queue(actor_options={"num_cpus": 0}) for _ in range(WORLD)]
    trainer = TorchTrainer(_train_loop, train_loop_config=dict(base=str(base), reports=reports, go=go),
                           scaling_config=ScalingConfig(num_workers=WORLD, use_gpu=False),
                           torch_config=TorchConfig(backend="gloo", timeout_s=120),
                           run_config=RunConfig(name="weightsync", storage_path=str(tmp_path / "ray_train")))
    run = _Fit(trainer)
    inbox, sync = _Inbox(reports, run), None
    try:
        attached = inbox.take("attached")
        assert [(m["backend"], m["world"]) for m in attached] == [("gloo", WORLD)] * WORLD
        assert not any(m["main_thread"] for m in attached), "the train loop runs on the actor's own thread"
        assert all("(Shard(dim=0),)" in m["placements"] for m in attached), attached[0]["placements"]  # FSDP2
        handles = [m["handle"] for m in attached]
        assert [(h.rank, h.world) for h in handles] == [(k, WORLD) for k in range(WORLD)]
        sync = WeightSync(trainers=handles, engines=engines, config=SyncConfig(**CONFIG_KW))
        before = None
        for step in range(STEPS):
            stepped = inbox.take("stepped", step)
            assert all(m["loss"] == m["loss"] for m in stepped)
            states = [m["adapter"] for m in stepped]
            assert all((states[1][n] == states[0][n]).all() for n in states[0]), "the workers' adapters differ"
            adapter = {k: torch.from_numpy(v.copy()) for k, v in states[0].items()}
            assert before is None or differs(adapter, before), "the optimizer step changed no factor"
            before = adapter
            metrics = sync.push(step)  # the train loops wait on their threads; the workers' actors serve the push
            assert metrics.full == (step == 0) and all(e.committed for e in metrics.engines)
            for q in go:
                q.put(step, timeout=WAIT_S)
            assert_engines_hold(engines, peft_merged(base, adapter, tmp_path / f"v{step}"), what=f"version {step}")
            pushed = inbox.take("pushed", step)
            assert [m["digest"] for m in pushed] == [m["digest"] for m in stepped], "a push changed trainer state"
        assert set(sync.engine_versions().values()) == {STEPS - 1}
        run.join(WAIT_S)
    finally:
        if run.running():
            for q in go:
                q.put(None, timeout=10)
        if sync is not None:
            sync.close()
        run.wait(WAIT_S)
