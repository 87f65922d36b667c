"""The whole ``weightsync bench`` run: per size, our rows, the floor, the full-gather and disk rows.

One local Ray (2 CPUs, own temp dir) for the run; every row starts its own actors and kills them at
its end (``gc`` in between), so rows never share memory. Order per size: ours (delta, full,
fan-out), the live FSDP2 trainer, floor (the bytes of our delta sync), full-gather, disk, and with ``--vllm``
the vLLM rows; a row that would not fit the memory available when it is due is skipped with its reason
(``memory_plan``). Then, per ``cfg.links`` rate, the rows across namespace hosts (``link_run``), and the
factor-streaming row
(``sync_service.factor_stream.factor_streaming_row``, in process) and the served check's cost row
(``served_cost.measure``, in process: ``report["served_check"]``).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from sync_service.bench.baselines import run_disk, run_gather
from sync_service.bench.floor import ShmFloor
from sync_service.bench.live import LIVE_KINDS, run_live
from sync_service.bench.memory_plan import skip_reason
from sync_service.bench.model import ensure_model, model_for_size
from sync_service.bench.ours import run_ours
from sync_service.bench.report import build_report
from sync_service.bench.rows import BenchConfig, Row, guarded
from sync_service.bench.rss import RssSampler
from sync_service.bench.vllm_rows import run_vllm
from sync_service.entrypoints.workdir import run_dir, ray_temp

__all__ = ["run_bench", "run_floor"]


def _say(msg: str) -> None:
    from tqdm import tqdm

    tqdm.write(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr)  # above a live bar (``Steps``)
    sys.stderr.flush()


def run_floor(nbytes: int, cfg: BenchConfig, size: int, model_bytes: int) -> Row:
    """``repeats`` copies of ``nbytes`` through the shm floor (after one untimed warm-up copy)."""
    with ShmFloor(cfg.bucket_bytes, timeout_s=cfg.timeout_s) as floor:
        floor.copy(nbytes)
        with RssSampler({"trainer": [os.getpid()], "engine": [floor.reader_pid]}) as rss:
            seconds = [floor.copy(nbytes) for _ in range(cfg.repeats)]
    return Row(kind="floor", size=size, model_bytes=model_bytes, bytes=nbytes, engines=1, seconds=seconds,
               stages={"transfer_s": sorted(seconds)[(len(seconds) - 1) // 2]},
               trainer_peak_rss_bytes=rss.peak_bytes("trainer"), trainer_peak_extra_bytes=rss.max_extra_bytes("trainer"),
               trainer_peak_extra_rss_bytes=rss.max_extra_rss_bytes("trainer"),
               engine_peak_rss_bytes=rss.peak_bytes("engine"), note="writer: the bench process; reader: a spawned process")


def _factor_streaming(quick: bool) -> dict:
    from sync_service.bench.factors import factor_streaming_row

    sizes = {} if quick else dict(num_experts=32, hidden=256, intermediate=128, num_layers=2, r=16)
    row = factor_streaming_row("qwen3_moe", dtype="bfloat16", **sizes)
    return {**row, "model": sizes or "factor_streaming_row defaults"}


def _served_check(cfg: BenchConfig) -> dict:
    """The served check's cost row (``served_cost.measure``): push seconds with ``check_served`` off / log / enforce."""
    from sync_service.bench.served_cost import measure

    sizes = dict(hidden=64, intermediate=32, experts=4) if cfg.quick else {}
    with tempfile.TemporaryDirectory(prefix="served-", dir=cfg.cache_dir) as tmp:
        return measure(Path(tmp), repeats=cfg.repeats, **sizes)


def _links(cfg: BenchConfig, say) -> tuple[list[Row], list[dict]]:
    """The rows across hosts (``link_run.run_links``) at the sizes <= ``cfg.link_max_size``."""
    if not cfg.links:
        return [], []
    from sync_service.bench.link_run import run_links

    models = {s: ensure_model(model_for_size(s, quick=cfg.quick), cfg.cache_dir) for s in cfg.link_sizes()}
    return run_links(cfg, models, say=say)


def _fits(kind: str, size: int, model, skipped: list[dict], say) -> bool:
    """Whether row ``kind`` fits the memory available now (``memory_plan``); if not, it is recorded in ``skipped``
    as ``{"row", "size", "reason"}`` and said."""
    reason = skip_reason(kind, model.shape.bf16_bytes())
    if reason is not None:
        skipped.append({"row": kind, "size": size, "reason": reason})
        say(f"  {size}x {kind} SKIPPED: {reason}")
    return reason is None


def _one_host(model, cfg: BenchConfig, size: int, rows: list[Row], failed: list[dict], launcher, work: Path, tmp: Path,
              say, skipped: list[dict]) -> None:
    """The one-host rows at ``size`` (local Ray, started once): ours, live FSDP2 trainer, floor, full-gather, disk,
    vLLM (``--vllm``). A row the memory plan says does not fit is skipped (``skipped``)."""
    import ray

    from sync_service.entrypoints.sync_cli import start_ray

    if not ray.is_initialized():
        start_ray(ray_temp(tmp))
    if _fits("ours", size, model, skipped, say):
        guarded(failed, "ours", size, say, lambda: run_ours(model, cfg, size, rows, launcher, say=say))
    for kind in LIVE_KINDS:
        if cfg.runs(kind, size) and _fits(kind, size, model, skipped, say):
            guarded(failed, kind, size, say,
                    lambda k=kind: rows.append(run_live(model, cfg, size, launcher, say=say, kind=k)))
    delta = next((r for r in rows if r.kind == "delta" and r.size == size), None)
    if delta is not None:
        say(f"  {size}x floor")
        guarded(failed, "floor", size, say, lambda: rows.append(run_floor(delta.bytes, cfg, size, model.shape.bf16_bytes())))
    if cfg.runs("gather", size) and _fits("gather", size, model, skipped, say):
        guarded(failed, "gather", size, say, lambda: rows.append(run_gather(model, cfg, size, launcher, say=say)))
    if cfg.runs("disk", size):
        guarded(failed, "disk", size, say, lambda: rows.append(run_disk(model, cfg, size, work, launcher, say=say)))
    if cfg.runs("vllm", size):
        guarded(failed, "vllm", size, say, lambda: run_vllm(model, cfg, size, rows, launcher, work, say=say))


def _work_dir(cfg: BenchConfig) -> Path:
    """A fresh scratch directory for the disk row under ``cfg.work_dir`` (default ``cfg.cache_dir``), both
    created as needed. Raises ValueError naming the directory and the fix when one cannot be created or
    written (before any model is generated)."""
    dirs = [("--cache-dir", cfg.cache_dir)] + ([("BenchConfig.work_dir", cfg.work_dir)] if cfg.work_dir else [])
    flag, path = dirs[0]
    try:
        for flag, path in dirs:
            Path(path).mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="disk-", dir=path))  # the last: where the disk row writes
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot create or write a directory there ({exc.strerror}); "
                         "give a writable directory") from None


def run_bench(cfg: BenchConfig, *, launcher, argv: list[str] | None = None, say=_say) -> dict:
    """Run every row the size plan allows (actors from ``launcher``, a ``protocols.endpoints.Launcher``);
    returns the report (``report.build_report``)."""
    import ray

    from sync_service.entrypoints.progress import Steps
    from sync_service.entrypoints.sync_cli import quiet_libraries

    quiet_libraries()
    machine = {"cpus": os.cpu_count(), "load_before": os.getloadavg(), "argv": list(argv or [])}
    rows: list[Row] = []
    failed: list[dict] = []
    skipped: list[dict] = []
    factor_bytes: dict[int, int] = {}
    work = _work_dir(cfg)
    tmp = run_dir("b")
    sizes = cfg.link_sizes() if cfg.link_only else sorted(set(cfg.sizes))
    steps = Steps(len(sizes) + (not cfg.link_only) + bool(cfg.links))  # a bar on a terminal, nothing elsewhere
    try:
        for size in sizes:
            shape = model_for_size(size, quick=cfg.quick)
            steps.step(f"{size}x rows")
            say(f"{size}x: model {shape.key()} ({shape.bf16_bytes() / 1e9:.3f} GB bf16)")
            model = ensure_model(shape, cfg.cache_dir)
            factor_bytes[size] = model.factor_bytes()
            if not cfg.link_only:
                _one_host(model, cfg, size, rows, failed, launcher, work, tmp, say, skipped)
        ray.shutdown()
        if cfg.links:
            steps.step("link rows")
        link_rows, link_failed = _links(cfg, say)
        failed += link_failed
        factor_streaming: dict = {}
        served_check: dict = {}
        if not cfg.link_only:
            say("factor streaming row")
            steps.step("factor streaming row")
            guarded(failed, "factor_streaming", 0, say, lambda: factor_streaming.update(_factor_streaming(cfg.quick)))
            say("served check row")
            guarded(failed, "served_check", 0, say, lambda: served_check.update(_served_check(cfg)))
    finally:
        steps.close()
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    machine["load_after"] = os.getloadavg()
    report = build_report(rows, cfg, factor_bytes=factor_bytes, factor_streaming=factor_streaming, machine=machine,
                          link_rows=link_rows)
    report["served_check"] = served_check
    report["failed"] = failed
    report["skipped"] = skipped
    return report
