"""Our rows: delta and full syncs through ``WeightSync`` (shm), 2 trainer shards -> 1 and -> 4 engines.

Per size: start the trainer shards (EP) and one transformers engine, then
  1. ``delta``: one untimed first full sync, then ``repeats`` delta syncs, each after a training step;
  2. ``full`` (sizes the plan allows): a second ``WeightSync`` with ``delta=False`` on the same actors,
     ``repeats`` full syncs;
  3. ``delta_fanout4`` (sizes the plan allows): ``fanout - 1`` more engines, a third ``WeightSync``
     over all of them, one untimed full sync, ``repeats`` delta syncs.
Every actor is killed at the end. Seconds are ``SyncMetrics.seconds`` (transfer after the snapshot,
through commit); stages are the median run's ``SyncMetrics`` stage seconds. Trainer extra memory is
measured per sync (setup + first sync, then each push from right after its training step), so the
bench's simulated optimizer step — which allocates full-size factor deltas — is not counted as sync memory.
"""

from __future__ import annotations

import ray

from sync_service.bench.model import BenchModel
from sync_service.bench.rows import BenchConfig, Row, median_index
from sync_service.bench.rss import RssSampler, actor_pid

__all__ = ["run_ours"]


def run_ours(model: BenchModel, cfg: BenchConfig, size: int, rows: list[Row], launcher, say=print) -> None:
    """Append the ours rows at ``size`` to ``rows`` as each finishes (see the module docstring); actors
    from ``launcher``. Blocks; kills its actors (also when a row fails)."""
    model_bytes = model.shape.bf16_bytes()
    trainers = launcher.start_trainers(model.base_dir, model.adapter_dir, ep=cfg.ep, timeout_s=cfg.timeout_s)
    engines = launcher.start_engines(model.base_dir, 1, timeout_s=cfg.timeout_s)
    version = [0]
    try:
        tpids = [actor_pid(t) for t in trainers]
        say(f"  {size}x delta (1 engine)")
        rows.append(_row("delta", trainers, engines, tpids, cfg, version, model_bytes, size, delta=True))
        if cfg.runs("full", size):
            say(f"  {size}x full (1 engine)")
            rows.append(_row("full", trainers, engines, tpids, cfg, version, model_bytes, size, delta=False))
        if cfg.runs("delta_fanout4", size) and cfg.fanout > 1:
            say(f"  {size}x delta ({cfg.fanout} engines)")
            engines += launcher.start_engines(model.base_dir, cfg.fanout - 1, timeout_s=cfg.timeout_s, prefix="fanout")
            rows.append(_row("delta_fanout4", trainers, engines, tpids, cfg, version, model_bytes, size, delta=True))
    finally:
        for actor in [*trainers, *engines]:
            ray.kill(actor)


def _row(kind: str, trainers: list, engines: list, tpids: list[int], cfg: BenchConfig, version: list[int],
         model_bytes: int, size: int, *, delta: bool) -> Row:
    from sync_service.api import SyncConfig, WeightSync

    epids = [actor_pid(e) for e in engines]
    groups = {"trainer": tpids, "engine": epids}
    metrics, windows = [], []  # windows: one sampler per sync, so the simulated training step is not counted
    with RssSampler(groups) as rss:
        with RssSampler(groups) as window:  # setup (transport, plan) and the first sync
            sync = WeightSync(trainers=trainers, engines=engines, config=SyncConfig(
                transport="shm", bucket_bytes=cfg.bucket_bytes, timeout_s=cfg.timeout_s, delta=delta))
            try:
                if delta:
                    sync.push(_next(version))  # the first sync of a WeightSync is full
            except BaseException:
                sync.close()
                raise
        windows.append(window)
        try:
            for _ in range(cfg.repeats):
                ray.get([t.train_step.remote(version[0] + 1) for t in trainers], timeout=cfg.timeout_s)
                with RssSampler(groups) as window:
                    m = sync.push(_next(version))
                windows.append(window)
                if m.full == delta:
                    raise RuntimeError(f"{kind}: push {m.version} was {'full' if m.full else 'delta'}, expected the other")
                metrics.append(m)
        finally:
            sync.close()
    best = metrics[median_index([m.seconds for m in metrics])]
    return Row(kind=kind, size=size, model_bytes=model_bytes, bytes=best.bytes, engines=len(engines),
               seconds=[m.seconds for m in metrics], stages=best.stage_seconds(),
               trainer_peak_rss_bytes=rss.peak_bytes("trainer"),
               trainer_peak_extra_bytes=max(w.max_extra_bytes("trainer") for w in windows),
               trainer_peak_extra_rss_bytes=max(w.max_extra_rss_bytes("trainer") for w in windows),
               engine_peak_rss_bytes=rss.peak_bytes("engine"))


def _next(version: list[int]) -> int:
    version[0] += 1
    return version[0]
