"""Our rows: delta and full syncs through ``WeightSync`` (shm), 2 trainer shards -> 1 and -> 4 engines.

Per size: start the trainer shards (EP) and one transformers engine, then
  1. ``delta`` and ``full`` side by side: one ``WeightSync`` with ``delta=True`` and (sizes the plan
     allows) one with ``delta=False`` on the same actors, each with one untimed first sync (a delta
     ``WeightSync``'s first push is full; the first push of a channel maps its ring), then
     ``repeats`` rounds of (training step, delta push, training step, full push; every other round
     full first): the two rows share every minute of the machine's load, so their ratio
     (``delta_vs_full``) compares work, not noise;
  2. ``delta_fanout4`` (sizes the plan allows): ``fanout - 1`` more engines, a third ``WeightSync``
     over all of them, one untimed full sync, ``repeats`` delta syncs;
  3. ``delta_fp8`` (sizes the plan allows): one engine loaded from a block-FP8 checkpoint of the model
     (``model.ensure_fp8_engine``), the same trainers, one untimed full sync, ``repeats`` delta syncs: the trainers
     quantize each merged box into the bucket (FP8 values + float32 scales, about half the delta's bytes).
Every actor is killed at the end. Seconds are ``SyncMetrics.seconds`` (transfer after the snapshot,
through commit); stages are the median run's ``SyncMetrics`` stage seconds. Trainer extra memory is
measured per sync (setup + first sync, then each push from right after its training step), so the
bench's simulated optimizer step — which allocates full-size factor deltas — is not counted as sync memory.
"""

from __future__ import annotations

import ray

from sync_service.bench.model import BenchModel, ensure_fp8_engine
from sync_service.bench.rows import BenchConfig, Row, median_index
from sync_service.bench.rss import RssSampler, actor_pid
from sync_service.bench.wire import WireMeter

__all__ = ["PushRuns", "run_ours"]


def run_ours(model: BenchModel, cfg: BenchConfig, size: int, rows: list[Row], launcher, say=print) -> None:
    """Append the ours rows at ``size`` to ``rows`` as each finishes (see the module docstring); actors
    from ``launcher``. Blocks; kills its actors (also when a row fails)."""
    trainers = launcher.start_trainers(model.base_dir, model.adapter_dir, ep=cfg.ep, timeout_s=cfg.timeout_s)
    engines = launcher.start_engines(model.base_dir, 1, timeout_s=cfg.timeout_s)
    run = PushRuns(trainers, cfg, size, model.shape.bf16_bytes())
    try:
        kinds = {"delta": True, **({"full": False} if cfg.runs("full", size) else {})}
        say(f"  {size}x {' and '.join(kinds)} (1 engine, pushes interleaved)")
        rows.extend(run.rows(kinds, engines))
        if cfg.runs("delta_fanout4", size) and cfg.fanout > 1:
            say(f"  {size}x delta ({cfg.fanout} engines)")
            engines += launcher.start_engines(model.base_dir, cfg.fanout - 1, timeout_s=cfg.timeout_s, prefix="fanout")
            rows.extend(run.rows({"delta_fanout4": True}, engines))
        if cfg.runs("delta_fp8", size):
            say(f"  {size}x delta into a block-FP8 engine")
            fp8 = launcher.start_engines(ensure_fp8_engine(model), 1, timeout_s=cfg.timeout_s, prefix="fp8")
            engines += fp8
            rows.extend(run.rows({"delta_fp8": True}, fp8))
    finally:
        for actor in [*trainers, *engines]:
            ray.kill(actor)


class PushRuns:
    """Timed pushes of one size on one set of trainer actors; versions count up across rows.

    ``sync_kw``: ``SyncConfig`` fields of every sync over the defaults (shm, ``cfg``'s bucket and
    timeout), e.g. ``{"transport": "ray", "bind_host": ...}`` across hosts; ``meter`` counts each timed
    push's bytes at the hosts' interfaces (``Row.wire_bytes`` of the median push).
    """

    def __init__(self, trainers: list, cfg: BenchConfig, size: int, model_bytes: int, *, sync_kw: dict | None = None,
                 meter: WireMeter | None = None) -> None:
        self.trainers, self.cfg, self.size, self.model_bytes = trainers, cfg, size, model_bytes
        self.sync_kw, self.meter = dict(sync_kw or {}), meter
        self.tpids = [actor_pid(t) for t in trainers]
        self.version = 0

    def rows(self, kinds: dict[str, bool | dict], engines: list, engine_pids: list[int] | None = None) -> list[Row]:
        """One row per ``kind -> delta`` (or ``kind -> SyncConfig fields``, e.g. ``{"mode": "factors"}``;
        ``delta`` defaults to True): a ``WeightSync`` each over ``engines``, one untimed first push
        each, then ``repeats`` rounds with one push of every kind, in turn (reversed every other round).
        ``engine_pids``: the processes whose RSS is the engines' (default: the engine actors')."""
        groups = {"trainer": self.tpids, "engine": engine_pids or [actor_pid(e) for e in engines]}
        fields = {k: {"delta": v} if isinstance(v, bool) else {"delta": True, **v} for k, v in kinds.items()}
        syncs: dict = {}
        metrics: dict[str, list] = {k: [] for k in kinds}
        wire: dict[str, list] = {k: [] for k in kinds}
        windows: dict[str, list[RssSampler]] = {k: [] for k in kinds}  # one per sync: training steps not counted
        try:
            with RssSampler(groups) as rss:
                for kind, kw in fields.items():
                    with RssSampler(groups) as window:  # setup (transport, plan) and the first sync
                        syncs[kind] = self._open(engines, kw)
                        syncs[kind].push(self._next())
                    windows[kind].append(window)
                order = list(fields.items())
                for i in range(self.cfg.repeats):  # ABBA: neither kind always runs first after a training step
                    for kind, kw in order if i % 2 == 0 else order[::-1]:
                        metrics[kind].append(self._push(kind, syncs[kind], kw["delta"], groups, windows[kind], wire[kind]))
        finally:
            for sync in syncs.values():
                sync.close()
        return [self._row(kind, metrics[kind], windows[kind], rss, len(engines), wire[kind]) for kind in kinds]

    def _open(self, engines: list, kw: dict):
        from sync_service.api import SyncConfig, WeightSync

        return WeightSync(trainers=self.trainers, engines=engines, config=SyncConfig(**{
            "transport": "shm", "bucket_bytes": self.cfg.bucket_bytes, "timeout_s": self.cfg.timeout_s, **self.sync_kw, **kw}))

    def _push(self, kind: str, sync, delta: bool, groups: dict, windows: list, wire: list):
        """A training step, then one timed push (its memory window appended to ``windows``, its bytes at
        the interfaces to ``wire`` when metered)."""
        ray.get([t.train_step.remote(self.version + 1) for t in self.trainers], timeout=self.cfg.timeout_s)
        with RssSampler(groups) as window:
            if self.meter is not None:
                self.meter.start()
            m = sync.push(self._next())
            if self.meter is not None:
                wire.append(self.meter.stop())
        windows.append(window)
        if m.full == delta:
            raise RuntimeError(f"{kind}: push {m.version} was {'full' if m.full else 'delta'}, expected the other")
        return m

    def _row(self, kind: str, metrics: list, windows: list[RssSampler], rss: RssSampler, engines: int,
             wire: list) -> Row:
        k = median_index([m.seconds for m in metrics])
        best = metrics[k]
        return Row(kind=kind, size=self.size, model_bytes=self.model_bytes, bytes=best.bytes, engines=engines,
                   seconds=[m.seconds for m in metrics], stages=best.stage_seconds(),
                   trainer_peak_rss_bytes=rss.peak_bytes("trainer"),
                   trainer_peak_extra_bytes=max(w.max_extra_bytes("trainer") for w in windows),
                   trainer_peak_extra_rss_bytes=max(w.max_extra_rss_bytes("trainer") for w in windows),
                   engine_peak_rss_bytes=rss.peak_bytes("engine"), engine_peak_extra_bytes=rss.max_extra_bytes("engine"),
                   **(wire[k].row_fields() if wire else {}))

    def _next(self) -> int:
        self.version += 1
        return self.version
