"""What people use today, on the same model, adapter and engine actor (``actors.rollout.RolloutEngine``).

``disk``: a PEFT trainer process (``PeftModel`` over the whole bf16 base) runs ``merge_and_unload``
and ``save_pretrained`` (safetensors); the engine then reloads from that directory with
``from_pretrained``. Before every run the PEFT model is loaded again, untimed (``merge_and_unload``
consumes it).

``gather``: the trainer shards (``actors.trainer.TrainerShard``, EP) all-gather the factors and merge
their boxes (the merge core, as ours); every rank sends its merged boxes over gloo to rank 0, which
holds the whole merged state dict, ``ray.put``s it (numpy), and the engine ``ray.get``s it and
copies every tensor into its parameters.

Stage seconds map onto ``coordinator.metrics.STAGES``: disk merge -> ``merge_s``, save -> ``pack_s``, reload ->
``apply_s``; gather factors -> ``gather_s``, merge -> ``merge_s``, gloo gather to rank 0 + ray.put
-> ``transfer_s``, ray.get + copy -> ``apply_s``. ``detail`` keeps the unmapped steps.
"""

from __future__ import annotations

import gc
import shutil
import time
from pathlib import Path

import ray
import torch

from protocols.params import box_shape
from sync_service.bench.model import BenchModel
from sync_service.bench.rows import BenchConfig, Placement, Row, median_index
from sync_service.bench.rss import RssSampler, actor_pid
from sync_service.bench.wire import WireMeter
from sync_service.dtypes import TORCH_DTYPES

__all__ = ["run_disk", "run_gather", "PeftDiskTrainer"]


@ray.remote(num_cpus=0)
class PeftDiskTrainer:
    """One process holding the whole PEFT model (bf16 base + LoRA adapter)."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.model = None

    def load(self, base_dir: str, adapter_dir: str) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        self.model = None
        gc.collect()
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
        self.model = PeftModel.from_pretrained(base, adapter_dir)

    def merge_and_save(self, out_dir: str) -> dict:
        """``merge_and_unload`` + ``save_pretrained(out_dir)``; returns seconds of each."""
        t0 = time.perf_counter()
        merged = self.model.merge_and_unload()
        t1 = time.perf_counter()
        merged.save_pretrained(out_dir, safe_serialization=True)
        t2 = time.perf_counter()
        self.model = None
        del merged
        gc.collect()
        return {"merge_s": t1 - t0, "save_s": t2 - t1}


def _reload(engine_actor, path: str) -> float:
    """Runs on a RolloutEngine: replace its HFEngine by one loaded from ``path``; returns seconds."""
    from sync_service.engines.hf import HFEngine

    t0 = time.perf_counter()
    engine_actor.engine = None
    gc.collect()
    engine_actor.engine = HFEngine.from_pretrained(path)
    return time.perf_counter() - t0


def run_disk(model: BenchModel, cfg: BenchConfig, size: int, work_dir: Path, launcher, say=print, *,
             placement: Placement | None = None, copy_over=None, meter: WireMeter | None = None) -> Row:
    """The disk row at ``size`` (actors from ``launcher``, placed by ``placement``); blocks; kills its
    actors and removes its checkpoints. ``copy_over(out_dir) -> (dir the engine reads, seconds)``
    moves the checkpoint to the engine's host (across hosts; ``transfer_s``); ``meter`` counts each
    run's bytes at the network interfaces."""
    placement = placement or Placement()
    trainer = PeftDiskTrainer.options(**placement.trainer_options).remote()
    engines = launcher.start_engines(model.base_dir, 1, timeout_s=cfg.timeout_s, actor_options=placement.engines(1))
    seconds, stages, wire = [], [], []
    try:
        groups = {"trainer": [actor_pid(trainer)], "engine": [actor_pid(engines[0])]}
        with RssSampler(groups) as rss:
            for i in range(cfg.repeats):
                say(f"  {size}x disk run {i + 1}/{cfg.repeats}")
                ray.get(trainer.load.remote(str(model.base_dir), str(model.adapter_dir)), timeout=cfg.timeout_s)
                out = work_dir / f"merged-{size}x-{i}"
                if meter is not None:
                    meter.start()
                t0 = time.perf_counter()
                steps = ray.get(trainer.merge_and_save.remote(str(out)), timeout=cfg.timeout_s)
                read_dir, copy_s = copy_over(out) if copy_over else (out, None)
                load_s = ray.get(engines[0].__ray_call__.remote(_reload, str(read_dir)), timeout=cfg.timeout_s)
                seconds.append(time.perf_counter() - t0)
                if meter is not None:
                    wire.append(meter.stop())
                copied = {} if copy_s is None else {"transfer_s": copy_s}
                stages.append({"merge_s": steps["merge_s"], "pack_s": steps["save_s"], **copied, "apply_s": load_s})
                written = sum(f.stat().st_size for f in out.glob("*.safetensors"))
                for d in {out, read_dir}:
                    shutil.rmtree(d, ignore_errors=True)
    finally:
        for actor in (trainer, *engines):
            ray.kill(actor)
    k = median_index(seconds)
    return Row(kind="disk", size=size, model_bytes=model.shape.bf16_bytes(), bytes=written, engines=1, seconds=seconds,
               stages=stages[k], trainer_peak_rss_bytes=rss.peak_bytes("trainer"),
               trainer_peak_extra_bytes=rss.max_extra_bytes("trainer"),
               trainer_peak_extra_rss_bytes=rss.max_extra_rss_bytes("trainer"), engine_peak_rss_bytes=rss.peak_bytes("engine"),
               **(wire[k].row_fields() if wire else {}))


def _gather_merged(shard, version: int, metas_by_rank: list[list], timeout_s: float) -> dict:
    """Runs on every TrainerShard at once: merge the owned boxes of ``version``; rank 0 receives every
    other rank's boxes (gloo, in ``metas_by_rank`` order) into the whole state dict and ``ray.put``s
    it as numpy (bf16 as int16 bits). Rank 0 returns ``{"refs": [ref], ...seconds}``."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    source = shard.state.source(version)  # all-gathers the factors (collective)
    t1 = time.perf_counter()
    rank = shard.spec.rank
    if rank:
        merge_s = 0.0
        for m in metas_by_rank[rank]:
            tm = time.perf_counter()
            buf = torch.empty(box_shape(m.box), dtype=source.out_dtype(m.name))
            source.fill(m.name, m.box, buf)
            merge_s += time.perf_counter() - tm
            dist.send(_bits(buf), dst=0)
        return {"gather_s": t1 - t0, "merge_s": merge_s, "transfer_s": time.perf_counter() - t1 - merge_s}
    full: dict[str, torch.Tensor] = {}
    for metas in metas_by_rank:
        for m in metas:
            if m.name not in full:
                full[m.name] = torch.empty(m.shape, dtype=TORCH_DTYPES[m.dtype])
    for m in metas_by_rank[0]:
        source.fill(m.name, m.box, full[m.name][tuple(slice(a, b) for a, b in m.box)])
    t2 = time.perf_counter()
    for r in range(1, len(metas_by_rank)):
        for m in metas_by_rank[r]:
            view = full[m.name][tuple(slice(a, b) for a, b in m.box)]
            dist.recv(_bits(view), src=r)
    t3 = time.perf_counter()
    nbytes = sum(t.numel() * t.element_size() for t in full.values())
    arrays = {n: (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy() for n, t in full.items()}
    ref = ray.put(arrays)
    del arrays, full
    t4 = time.perf_counter()
    return {"refs": [ref], "bytes": nbytes, "gather_s": t1 - t0, "merge_s": t2 - t1, "transfer_s": t3 - t2,
            "put_s": t4 - t3}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A byte view of a contiguous tensor (gloo moves bytes; bf16 support varies)."""
    if not t.is_contiguous():
        raise ValueError(f"gather baseline: box view of shape {tuple(t.shape)} is not contiguous (EP boxes are)")
    return t.reshape(-1).view(torch.uint8)


def _load_state(engine_actor, refs: list) -> dict:
    """Runs on a RolloutEngine: ``ray.get`` the state dict and copy it into the served parameters."""
    import warnings

    t0 = time.perf_counter()
    arrays = ray.get(refs[0])
    t1 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only (zero-copy) numpy arrays
        for name, param in engine_actor.engine.export_tensors().items():
            param.copy_(torch.from_numpy(arrays[name]).view(param.dtype))
    del arrays
    return {"get_s": t1 - t0, "copy_s": time.perf_counter() - t1}


def run_gather(model: BenchModel, cfg: BenchConfig, size: int, launcher, say=print, *,
               placement: Placement | None = None, meter: WireMeter | None = None) -> Row:
    """The full-gather row at ``size`` (actors from ``launcher``, placed by ``placement``); blocks;
    kills its actors. ``meter`` counts each run's bytes at the network interfaces."""
    placement = placement or Placement()
    trainers = launcher.start_trainers(model.base_dir, model.adapter_dir, ep=cfg.ep, timeout_s=cfg.timeout_s,
                                       actor_options=placement.trainer_options)
    engines = launcher.start_engines(model.base_dir, 1, timeout_s=cfg.timeout_s, actor_options=placement.engines(1))
    seconds, stages, wire, nbytes = [], [], [], 0
    try:
        metas = ray.get([t.owned_metas.remote() for t in trainers], timeout=cfg.timeout_s)
        groups = {"trainer": [actor_pid(t) for t in trainers], "engine": [actor_pid(engines[0])]}
        with RssSampler(groups) as rss:
            for i in range(cfg.repeats):
                say(f"  {size}x gather run {i + 1}/{cfg.repeats}")
                ray.get([t.train_step.remote(i + 1) for t in trainers], timeout=cfg.timeout_s)
                ray.get([t.snapshot.remote(i + 1) for t in trainers], timeout=cfg.timeout_s)
                if meter is not None:
                    meter.start()
                t0 = time.perf_counter()
                parts = ray.get([t.__ray_call__.remote(_gather_merged, i + 1, metas, cfg.timeout_s) for t in trainers],
                                timeout=cfg.timeout_s)
                loaded = ray.get(engines[0].__ray_call__.remote(_load_state, parts[0]["refs"]), timeout=cfg.timeout_s)
                seconds.append(time.perf_counter() - t0)
                if meter is not None:
                    wire.append(meter.stop())
                nbytes = parts[0]["bytes"]
                del parts[0]["refs"]
                stages.append({"gather_s": max(p["gather_s"] for p in parts), "merge_s": max(p["merge_s"] for p in parts),
                               "transfer_s": parts[0]["transfer_s"] + parts[0]["put_s"],
                               "apply_s": loaded["get_s"] + loaded["copy_s"]})
                del parts
                gc.collect()
    finally:
        for actor in (*trainers, *engines):
            ray.kill(actor)
    k = median_index(seconds)
    return Row(kind="gather", size=size, model_bytes=model.shape.bf16_bytes(), bytes=nbytes, engines=1, seconds=seconds,
               stages=stages[k], trainer_peak_rss_bytes=rss.peak_bytes("trainer"),
               trainer_peak_extra_bytes=rss.max_extra_bytes("trainer"),
               trainer_peak_extra_rss_bytes=rss.max_extra_rss_bytes("trainer"), engine_peak_rss_bytes=rss.peak_bytes("engine"),
               **(wire[k].row_fields() if wire else {}))
