"""The live-trainer rows: a user's training job (AdamW) -> 1 engine, delta sync.

``live_fsdp2``: 2 ranks, FSDP2; on 4 ranks, 2-D meshes: ``live_hsdp`` (replicate 2, shard 2), ``live_fsdp2_tp``
(shard 2, tp 2: attention TP, then FSDP2), ``live_fsdp2_ep`` (dp 2, ep 2: experts on the ep axis) — ``LIVE_KINDS``:
the ``weightsync demo --trainer`` kinds, ``entrypoints/demo_live.TRAINERS``. Per size: ``ExampleTrainingRank``
actors (``sync_service/live/example.py``: the same training rank the demo runs) load the bench base in bf16
(a kind with ``tp_base``: ``ModelShape.tp_variant``, 2 key/value heads, its own cached base, which its engine
loads too), add PEFT LoRA of the bench adapter's rank on attention + experts, shard it on the kind's mesh and
``attach_trainer``; one transformers engine. One untimed first (full) push, then ``repeats`` times: an AdamW step on every
rank, then a timed delta push. Trainer extra memory (allocated) is sampled per push from right
after its training step (the step's activations and optimizer state are training memory, not sync
memory); ``Row.trainer_gathered_bytes`` is the endpoint's factor gather buffers (``ShardGather``), the
"gathered factors" of the memory goal ``<= 2 x bucket + gathered factors`` (``live_goal``).
"""

from __future__ import annotations

import ray

from sync_service.bench.model import BenchModel, ensure_model
from sync_service.bench.rows import BenchConfig, Row, median_index
from sync_service.bench.rss import RssSampler, actor_pid
from sync_service.entrypoints.demo_live import TRAINERS, TrainerKind

__all__ = ["LIVE_GOALS", "LIVE_KINDS", "live_goal", "live_goals", "run_live"]

LIVE_KINDS = {"live_fsdp2": "fsdp2", "live_hsdp": "hsdp", "live_fsdp2_tp": "fsdp2-tp", "live_fsdp2_ep": "fsdp2-ep"}
"""Row kind -> its ``weightsync demo --trainer`` kind (mesh, ranks)."""
LIVE_GOALS = {"live_fsdp2": "live_trainer_memory", "live_hsdp": "live_hsdp_trainer_memory",
              "live_fsdp2_tp": "live_fsdp2_tp_trainer_memory", "live_fsdp2_ep": "live_fsdp2_ep_trainer_memory"}
"""Row kind -> the name of its memory goal in the report (``live_goal``)."""


def _gathered_bytes(_actor, endpoint_id: str) -> int:
    """Runs in a training rank: bytes of its endpoint's reused factor gather buffers."""
    from sync_service.live.handle import lookup

    return lookup(endpoint_id).state.gathered_bytes


def _start_ranks(model: BenchModel, timeout_s: float, trainer: TrainerKind) -> tuple[list, list]:
    from sync_service.live.example import ExampleTrainingRank

    actor = ray.remote(num_cpus=0, max_concurrency=2)(ExampleTrainingRank)
    ranks = [actor.remote(k, trainer.world) for k in range(trainer.world)]
    host, port = ray.get(ranks[0].rendezvous.remote(), timeout=timeout_s)
    handles = ray.get([r.setup.remote(host, port, str(model.base_dir), trainer.mode, lora_r=model.shape.r,
                                      dtype="bfloat16", **trainer.setup) for r in ranks], timeout=timeout_s)
    return ranks, handles


def run_live(model: BenchModel, cfg: BenchConfig, size: int, launcher, say=print, kind: str = "live_fsdp2") -> Row:
    """The ``kind`` row (a key of ``LIVE_KINDS``) at ``size`` (see the module docstring); engines from
    ``launcher``. Blocks; kills its actors (also when it fails)."""
    from sync_service.api import SyncConfig, WeightSync

    trainer = TRAINERS[LIVE_KINDS[kind]]
    if trainer.tp_base:
        model = ensure_model(model.shape.tp_variant(), cfg.cache_dir)
    say(f"  {size}x live {LIVE_KINDS[kind]} trainer ({trainer.world} ranks, mesh {trainer.mesh}) -> 1 engine, delta")
    ranks, engines = [], []
    try:
        ranks, handles = _start_ranks(model, cfg.timeout_s, trainer)
        engines = launcher.start_engines(model.base_dir, 1, timeout_s=cfg.timeout_s, prefix="live")
        groups = {"trainer": [actor_pid(r) for r in ranks], "engine": [actor_pid(e) for e in engines]}
        gathered = max(ray.get([r.__ray_call__.remote(_gathered_bytes, h.endpoint_id) for r, h in zip(ranks, handles)],
                               timeout=cfg.timeout_s))
        metrics, windows = [], []
        with RssSampler(groups) as rss:
            sync = WeightSync(trainers=handles, engines=engines, config=SyncConfig(
                transport="shm", bucket_bytes=cfg.bucket_bytes, timeout_s=cfg.timeout_s))
            try:
                sync.push(0)  # the first sync of a WeightSync is full
                for version in range(1, cfg.repeats + 1):
                    ray.get([r.train_step.remote() for r in ranks], timeout=cfg.timeout_s)
                    with RssSampler(groups) as window:
                        metrics.append(sync.push(version))
                    windows.append(window)
                    if metrics[-1].full:
                        raise RuntimeError(f"{kind}: push {version} was full, expected a delta")
            finally:
                sync.close()
    finally:
        for actor in [*ranks, *engines]:
            ray.kill(actor)
    best = metrics[median_index([m.seconds for m in metrics])]
    return Row(kind=kind, size=size, model_bytes=model.shape.bf16_bytes(), bytes=best.bytes, engines=1,
               seconds=[m.seconds for m in metrics], stages=best.stage_seconds(),
               trainer_peak_rss_bytes=rss.peak_bytes("trainer"),
               trainer_peak_extra_bytes=max(w.max_extra_bytes("trainer") for w in windows),
               trainer_peak_extra_rss_bytes=max(w.max_extra_rss_bytes("trainer") for w in windows),
               engine_peak_rss_bytes=rss.peak_bytes("engine"), trainer_gathered_bytes=gathered)


def live_goal(rows: list[Row], bucket_bytes: int, kind: str = "live_fsdp2") -> dict:
    """A live row's memory goal: per size, trainer peak extra (allocated) <= 2 x bucket + gathered factors."""
    live = {str(r.size): r for r in rows if r.kind == kind}
    value = {s: r.trainer_peak_extra_bytes for s, r in live.items()}
    budget = {s: 2 * bucket_bytes + r.trainer_gathered_bytes for s, r in live.items()}
    return {"goal": "live trainer peak extra <= 2 x bucket + gathered factors, flat in model size", "value": value,
            "budget": budget, "met": all(value[s] <= budget[s] for s in value) if value else None}


def live_goals(rows: list[Row], bucket_bytes: int) -> dict[str, dict]:
    """``live_goal`` of every live row kind, by its ``LIVE_GOALS`` name."""
    return {name: live_goal(rows, bucket_bytes, kind) for kind, name in LIVE_GOALS.items()}
