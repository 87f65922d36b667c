"""``weightsync sync``: stream a base checkpoint + PEFT adapter from sharded trainers to rollout
engines on a local Ray, and verify every version.

Per version: (version > 0: every trainer takes a deterministic training step on its factors) →
``WeightSync.push`` → verify on every engine that (a) its weights equal PEFT's own
``merge_and_unload`` of that version's adapter (replayed on the driver; float64, cast once: an
oracle independent of weightsync's merge, ``verify.peft_oracle``) up to the rounding of an
fp32-accumulated merge, (b) they equal the ``weightsync merge`` output of that version read back
(same tolerance: the file and the stream merge in tiles of different shapes), and (c) its greedy
generations equal those of the PEFT-merged model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from sync_service import defaults
from sync_service.entrypoints.preflight import (CLI_ENGINES, check_adapter, check_run_arguments, check_sharding, check_temp_dir,
                                                check_transport, fail, resolve_engines, resolve_parallel)
from sync_service.entrypoints.preflight_engine_base import check_engine_base
from sync_service.entrypoints.progress import Steps
from sync_service.verify.hf import verify_version
from sync_service.entrypoints.workdir import run_dir, run_root, ray_temp
from sync_service.entrypoints.sync_args import (add_arguments, add_common_arguments, add_version_arguments,  # noqa: F401
                                                 version_options)



@dataclass(kw_only=True, slots=True)
class RunConfig:
    """One local sync run."""

    base: Path
    """Base checkpoint directory (``config.json`` + ``*.safetensors``)."""
    adapter: Path | None
    """PEFT LoRA adapter directory; ``None`` syncs the base as is."""
    engine_base: Path | None = None
    """The checkpoint the engines load (``--engine-base``; ``None``: ``base``): the base's tensors and shapes, in
    the dtypes the engines serve — each tensor is merged in ``accumulate_dtype`` and cast once into them."""
    ep: int = 1
    """Expert-parallel trainer ranks."""
    tp: int = 1
    """Tensor-parallel trainer ranks (trainers = ep · tp)."""
    engine: str = "hf"
    """Rollout engine kind, a key of ``preflight.CLI_ENGINES``."""
    engines: int = 2
    """Rollout engines."""
    versions: int = 3
    """Weight versions pushed; factors change between versions as a training step would."""
    transport: str = "shm"
    """``shm`` | ``ray`` | ``torch``."""
    bucket_bytes: int = defaults.SMALL_MODEL_BUCKET_BYTES
    """Bucket payload size, bytes."""
    timeout_s: float = defaults.TIMEOUT_S
    """Bound of every blocking step, seconds."""
    work_dir: Path | None = None
    """Where per-version adapters and merge outputs go (default: a temp dir, removed at the end)."""
    json_path: Path | None = None
    """Write the results as JSON here."""
    digests_path: Path | None = None
    """After each version, write every engine's per-tensor digests of what it serves here (JSON,
    ``write_digests``); ``None``: not read back."""
    check_finite: bool = True
    """Refuse a version whose merged weights hold NaN/Inf (``SyncConfig.check_finite``)."""
    secret: bytes | None = field(default=None, repr=False)
    """HMAC key of every bucket (``SyncConfig.secret``); ``None``: a fresh random one."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (``SyncConfig.metrics_port``); ``None``: not served."""
    vllm_urls: tuple[str, ...] = ()
    """``--engine vllm-server``: running servers to sync into (none: start ``engines`` local ones)."""
    vllm_api_key: str | None = field(default=None, repr=False)
    """The servers' ``--api-key`` (``--vllm-api-key`` or ``$VLLM_API_KEY``)."""
    accumulate_dtype: str = "float32"
    """The merge's accumulation dtype (``SyncConfig.accumulate_dtype``): ``"float64"`` serves PEFT's float64
    merge cast once bit for bit, so the verdict accepts no token flip (``verify.tokens``)."""
    first_version: int | None = None
    """The first version pushed; ``None``: one above the highest version the engines serve (0 for fresh ones)."""
    reset_versions: bool = False
    """Number versions from ``first_version`` (default 0) even at or below what the engines serve
    (``SyncConfig.reset_versions``)."""
    check_served: str = "log"
    """Each engine's check of what it is about to serve (``SyncConfig.check_served``): ``"off"`` | ``"log"`` |
    ``"enforce"``."""


@dataclass(slots=True)
class VersionRow:
    version: int
    full: bool
    bytes: int
    buckets: int
    seconds: float
    gb_per_s: float
    stages: dict
    engines: list = field(default_factory=list)
    conversions: dict = field(default_factory=dict)
    """The plan's casts into the engines' dtypes: ``"float32->bfloat16"`` → tensors (``WeightSync.dtype_conversions``)."""
    policy_kl_floor: float | None = None
    """KL(π_fp32 ‖ π_trainer) of the version's unmerged PEFT policy, nats per token (``verify.policy_kl``): what
    the trainer's own dtype costs; each engine row's ``policy_kl`` is KL(π_trainer ‖ π_engine). ``None``: not measured."""

    @property
    def verified(self) -> bool:
        return bool(self.engines) and all(e["verified"] for e in self.engines)

    @classmethod
    def of(cls, version: int, metrics, engines: list[dict]) -> "VersionRow":
        """The row of one push: ``metrics`` is its ``SyncMetrics``, ``engines`` one check dict per engine."""
        return cls(version=version, full=metrics.full, bytes=metrics.bytes, buckets=metrics.buckets,
                   seconds=metrics.seconds, gb_per_s=metrics.gb_per_s, stages=metrics.stage_seconds(),
                   engines=engines)


def quiet_libraries() -> None:
    """No per-load progress bars from transformers / the hub in the table output."""
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def start_ray(tmp: Path) -> None:
    """A local Ray (2 CPUs, temp dir ``tmp``, no dashboard; workers with ``defaults.RAY_WORKER_ENV``); a command's
    SIGTERM handling stays as it was (``cli.sigterm_kept``)."""
    import ray

    from sync_service.entrypoints.cli import sigterm_kept

    with sigterm_kept():
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp), log_to_driver=False,
                 runtime_env={"env_vars": defaults.RAY_WORKER_ENV})


def run_local(cfg: RunConfig, launcher) -> list[VersionRow]:
    """Start Ray, trainers and engines (``launcher``: ``protocols.endpoints.Launcher``); push and
    verify ``cfg.versions`` versions. Returns the rows.

    Raises:
        EndpointDiedError: an actor died; its cause (``coordinator.deaths.death_cause``) is looked up before
            Ray's temp dir, which holds the dead worker's log, is removed.
    """
    import ray

    from sync_service.api import WeightSync
    from sync_service.entrypoints.local import AdapterReplay
    from sync_service.verify.policy_kl import policy_check

    tmp = run_dir("sync")
    work = cfg.work_dir or tmp / "work"
    rows: list[VersionRow] = []
    steps = Steps(3 + 2 * cfg.versions)
    try:
        steps.step("starting a local Ray (2 CPUs)")
        start_ray(ray_temp(tmp))
        steps.step(f"starting {cfg.ep * cfg.tp} trainer shard(s) (ep={cfg.ep}, tp={cfg.tp}) and {cfg.engines} engine(s)")
        trainers, engines = start_actors(cfg, launcher)
        names = [ray.get(e.engine_name.remote()) for e in engines]
        steps.step("planning, validating the plan against every engine")
        sync = WeightSync(trainers=trainers, engines=engines, config=sync_config(cfg))
        announce_metrics(sync)
        replay = AdapterReplay(cfg.adapter) if cfg.adapter is not None else None
        first = first_version(sync.engine_versions(), given=cfg.first_version, reset=cfg.reset_versions)
        for v in range(first, first + cfg.versions):
            steps.step(f"version {v}: training step, push")
            if v and replay is not None:
                ray.get([t.train_step.remote(v) for t in trainers], timeout=cfg.timeout_s)
                replay.step(v)
            m = sync.push(v)
            steps.step(f"version {v}: verify")
            checks = verify_version(cfg.base, work / f"v{v}", replay, engines, tp=cfg.tp, timeout_s=cfg.timeout_s)
            floor, kls = policy_check(cfg.base, None if replay is None else work / f"v{v}" / "adapter", engines,
                                      timeout_s=cfg.timeout_s)
            rows.append(VersionRow.of(v, m, [{"engine": n, **c, "policy_kl": kl} for n, c, kl in zip(names, checks, kls)]))
            rows[-1].policy_kl_floor = floor
            rows[-1].conversions = {f"{a}->{b}": n for (a, b), n in sorted(sync.dtype_conversions.items())}
            if cfg.digests_path is not None:
                write_digests(cfg.digests_path, v, engines, cfg.timeout_s)
            print_row(rows[-1])
        sync.close()
    except ray.exceptions.RayActorError as exc:  # a bare ray.get (start-up, train_step): say why, while the logs exist
        from sync_service.coordinator.deaths import died_error

        raise died_error(exc) from exc
    finally:
        steps.close()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def sync_config(cfg: RunConfig):
    """The ``SyncConfig`` of a local run."""
    from sync_service.api import SyncConfig

    return SyncConfig(transport=cfg.transport, bucket_bytes=cfg.bucket_bytes, timeout_s=cfg.timeout_s,
                      check_finite=cfg.check_finite, secret=cfg.secret, metrics_port=cfg.metrics_port,
                      accumulate_dtype=cfg.accumulate_dtype, reset_versions=cfg.reset_versions,
                      check_served=cfg.check_served)


@contextmanager
def local_session(tmp: Path, steps: Steps, label: str = "starting a local Ray (2 CPUs)") -> Iterator[None]:
    """One command's local Ray: ``label`` as a progress step, Ray started with its temp dir under ``tmp``
    (``start_ray``); on exit, error or not, the progress closed, Ray shut down and ``tmp`` removed."""
    import ray

    try:
        steps.step(label)
        start_ray(ray_temp(tmp))
        yield
    finally:
        steps.close()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def engines_and_sync(cfg: RunConfig, launcher, trainers: list, steps: Steps):
    """``cfg.engines`` engines from ``launcher`` (a ``protocols.endpoints.Launcher``) on ``cfg.base``, and a
    ``WeightSync`` of ``trainers`` (handles, rank order) into them, its plan validated: (engines, engine names,
    sync, first version to push: ``first_version`` of what they serve). Raises what ``WeightSync`` raises."""
    import ray

    from sync_service.api import WeightSync

    steps.step(f"starting {cfg.engines} engine(s)")
    engines = launcher.start_engines(cfg.base, cfg.engines, timeout_s=cfg.timeout_s)
    names = ray.get([e.engine_name.remote() for e in engines], timeout=cfg.timeout_s)
    steps.step("planning, validating the plan against every engine")
    sync = WeightSync(trainers=trainers, engines=engines, config=sync_config(cfg))
    return engines, names, sync, first_version(sync.engine_versions(), given=cfg.first_version, reset=cfg.reset_versions)


def first_version(served: dict[str, int | None], *, given: int | None = None, reset: bool = False) -> int:
    """A run's first version: ``given`` (``--first-version``); else 0 with ``reset`` (``--reset-versions``);
    else one above the highest version in ``served`` (engine name → the version it serves:
    ``WeightSync.engine_versions()``), so a run over engines an earlier run synced (``--vllm-url``,
    ``weightsync run``) continues their numbering. A ``given`` at or below what an engine serves is
    refused by the first push (``SyncConfig.reset_versions``; one line, exit 2)."""
    from sync_service.coordinator.versions import next_version

    if given is not None:
        return given
    return 0 if reset else next_version(served)


def start_actors(cfg: RunConfig, launcher) -> tuple[list, list]:
    """Trainers and engines of ``cfg``, started at once (their processes import torch and load the base in
    parallel: one start-up wait instead of two). Blocks until both answer (``cfg.timeout_s`` each)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="start-engines") as pool:
        engines = pool.submit(launcher.start_engines, cfg.engine_base or cfg.base, cfg.engines, timeout_s=cfg.timeout_s)
        trainers = launcher.start_trainers(cfg.base, cfg.adapter, ep=cfg.ep, tp=cfg.tp, timeout_s=cfg.timeout_s)
        return trainers, engines.result()


def announce_metrics(sync) -> None:
    """Say on stderr where a ``WeightSync``'s Prometheus metrics are served (nothing when they are not)."""
    if sync.metrics_port is not None:
        print(f"weightsync: Prometheus metrics on http://{sync.config.metrics_host}:{sync.metrics_port}/metrics",
              file=sys.stderr, flush=True)


def print_header() -> None:
    Steps.write(f"{'version':>7}  {'sync':>5}  {'bytes':>10}  {'buckets':>7}  {'seconds':>8}  {'GB/s':>7}  verified")


def print_row(r: VersionRow) -> None:
    ok = "yes" if r.verified else "NO: " + ", ".join(e["engine"] for e in r.engines if not e["verified"])
    Steps.write(f"{r.version:>7}  {'full' if r.full else 'delta':>5}  {r.bytes:>10}  {r.buckets:>7}  "
                f"{r.seconds:>8.3f}  {r.gb_per_s:>7.3f}  {ok}")


def write_json(path: Path, rows: list[VersionRow], extra: dict) -> None:
    doc = {"versions": [{"version": r.version, "full": r.full, "bytes": r.bytes, "buckets": r.buckets,
                         "seconds": r.seconds, "gb_per_s": r.gb_per_s, "stages": r.stages, "verified": r.verified,
                         "engines": r.engines, "dtype_conversions": r.conversions,
                         "policy_kl_floor": r.policy_kl_floor} for r in rows], **extra}
    path.write_text(json.dumps(doc, indent=2) + "\n")


def write_digests(path: Path, version: int, engines: list, timeout_s: float) -> None:
    """Add version ``version``'s entry to the digests file ``path`` (``{"versions": [{"version", "engines":
    {engine: {"version", "tensors": {name: {"dtype", "shape", "xxh3_64"}}}}}]}``), each engine's digests
    computed on the engine over the bytes it serves (``coordinator.readback.served_weights``)."""
    from sync_service.coordinator.readback import served_weights

    doc = json.loads(path.read_text()) if version and path.is_file() else {"versions": []}
    served = served_weights(engines, timeout_s=timeout_s)
    doc["versions"].append({"version": version, "engines": {n: {"version": w.version, "tensors": w.digests()}
                                                            for n, w in sorted(served.items())}})
    path.write_text(json.dumps(doc, indent=1) + "\n")


def execute(cfg: RunConfig, extra: dict, launcher) -> int:
    """The hf engine run (``CLI_ENGINES["hf"]``): table, verdict, JSON; 0 iff every version verified."""
    return run_and_report(cfg, lambda c: run_local(c, launcher), extra, engines=f"{cfg.engines} engine(s)")


def execute_engine(cfg: RunConfig, extra: dict, launcher) -> int:
    """Run ``cfg`` with the runner of its engine kind (``CLI_ENGINES[cfg.engine].runner``); actors from
    ``launcher`` (``protocols.endpoints.Launcher``)."""
    import importlib

    quiet_libraries()
    module, function = CLI_ENGINES[cfg.engine].runner.split(":")
    return getattr(importlib.import_module(module), function)(cfg, extra, launcher)


def run_and_report(cfg: RunConfig, run, extra: dict, *, engines: str, json_extra: dict | None = None) -> int:
    """Run ``run(cfg)``, print the table and the verdict, write ``cfg.json_path``; 0 iff every version verified."""
    print_header()
    t0 = time.perf_counter()
    rows = run(cfg)
    total = time.perf_counter() - t0
    ok = len(rows) == cfg.versions and all(r.verified for r in rows)
    Steps.write(f"{'all versions verified' if ok else 'VERIFICATION FAILED'} on {engines} in {total:.1f} s")
    if cfg.json_path is not None:
        write_json(cfg.json_path, rows, {**extra, **(json_extra or {}), "ok": ok, "total_seconds": total,
                                         "ep": cfg.ep, "tp": cfg.tp, "transport": cfg.transport,
                                         "accumulate_dtype": cfg.accumulate_dtype})
    return 0 if ok else 1


def run(args: argparse.Namespace) -> int:
    """``weightsync sync`` entry (see ``sync_service/entrypoints/cli.py``). Every check that needs no actor runs
    before Ray starts (``sync_service.entrypoints.preflight``); a bad value exits 2 with one line."""
    ep, tp = resolve_parallel(args)
    check_temp_dir(args)  # before the temp dirs below
    for what, path in (("--base", args.base), ("--adapter", args.adapter)):
        if path is not None and not path.is_dir():
            fail(args, f"{what} {path}: not a directory")
    given = {"base": str(args.base), "adapter": None if args.adapter is None else str(args.adapter),
             "engine_base": None if args.engine_base is None else str(args.engine_base)}
    with tempfile.TemporaryDirectory(prefix="wsync-dcp", dir=run_root()) as tmp:
        args.base, args.adapter = hf_inputs(args, Path(tmp))
        return _run_checked(args, ep, tp, given)


def hf_inputs(args: argparse.Namespace, work_dir: Path) -> tuple[Path, Path | None]:
    """``--base`` / ``--adapter`` with a torch.distributed.checkpoint directory among them written as HF
    directories under ``work_dir`` (``merge.dcp.resolve_inputs``); exits 2 with one line on a bad one."""
    from sync_service.merge.dcp import resolve_inputs
    from sync_service.merge.errors import MergeError

    try:
        return resolve_inputs(args.base, args.adapter, work_dir)
    except MergeError as exc:
        fail(args, str(exc))


def _run_checked(args: argparse.Namespace, ep: int, tp: int, given: dict) -> int:
    """``run`` once the inputs are HF directories: the preflight checks, then the engine kind's runner
    (``given``: the ``--base`` / ``--adapter`` paths as given, for the report)."""
    check_run_arguments(args)
    if args.vllm_urls:
        from sync_service.entrypoints.preflight_vllm_server import check_servers

        check_servers(args)
    check_sharding(args, args.base, ep, tp)  # the base itself before --engine-base, which is compared with it
    check_engine_base(args, args.base)
    check_transport(args, ep * tp)
    engines = resolve_engines(args, args.adapter, args.base)
    if args.vllm_urls:
        engines = len(args.vllm_urls)  # the servers given, none started
    if args.adapter is not None:
        check_adapter(args, args.base, args.adapter)
    from sync_service.security import resolve_secret

    try:
        secret = resolve_secret(args.secret_file)
    except (OSError, ValueError) as exc:
        fail(args, f"--secret-file: {exc}")
    cfg = RunConfig(base=args.base, adapter=args.adapter, engine_base=args.engine_base, ep=ep, tp=tp, engine=args.engine, engines=engines,
                    versions=args.versions, transport=args.transport, bucket_bytes=args.bucket_bytes,
                    timeout_s=args.timeout, json_path=args.json, digests_path=args.digests, check_finite=args.check_finite, secret=secret,
                    metrics_port=args.metrics_port, vllm_urls=tuple(args.vllm_urls),
                    vllm_api_key=args.vllm_api_key or os.environ.get("VLLM_API_KEY"), check_served=args.check_served,
                    **version_options(args))
    return execute_engine(cfg, given, args.launcher)
