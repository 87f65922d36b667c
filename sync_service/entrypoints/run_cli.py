"""``weightsync run --config FILE [--address auto|HOST:PORT] [--json PATH]``: sync on a Ray cluster.

Connects to a running Ray cluster (``--address auto`` inside a RayJob / on a cluster node, or
``HOST:PORT`` of the GCS) — or starts a local one when no address is given, advertising the
``trainer`` / ``rollout`` resources the config asks for — places the trainer shards and rollout
engines by their custom resources (``sync_service.cluster.placement``), chooses the transport, and pushes
``run.versions`` versions like ``weightsync sync``: a deterministic training step between versions,
then, with ``run.verify``, every engine's weights compared with the reference merge.
Prints one row per version; ``--json`` writes them with the placement (node per actor).
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from sync_service import defaults, security
from sync_service.cluster.config import ConfigError, DeployConfig, SecretConfig, load_config
from sync_service.entrypoints.preflight import check_deploy, fail
from sync_service.entrypoints.progress import Steps
from sync_service.verify.hf import verify_weights
from sync_service.entrypoints.sync_cli import (VersionRow, add_version_arguments, announce_metrics, first_version, print_header,
                                               print_row, quiet_libraries, write_json)
from sync_service.entrypoints.workdir import run_dir, ray_temp
from sync_service.entrypoints.sync_args import absolute_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, type=absolute_path, help="YAML config (see deploy/example-config.yaml)")
    parser.add_argument("--address", default=None,
                        help="Ray cluster: 'auto' (this node's cluster) or HOST:PORT; omitted: start a local Ray")
    parser.add_argument("--json", type=absolute_path, default=None, help="write the results as JSON to this path")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve Prometheus metrics on 127.0.0.1:PORT/metrics while the run lasts (0: a free port)")
    add_version_arguments(parser)


def load_secret(cfg: SecretConfig, environ: dict[str, str] | None = None) -> bytes | None:
    """The session secret from ``cfg.env`` (first) or ``cfg.file`` (``security.load_secret``: a file
    writable by group/others is refused). Raises ConfigError when it is shorter than ``cfg.min_bytes``,
    unsafe, or missing while ``cfg.required``."""
    try:
        secret = security.load_secret(value_env=cfg.env, file=cfg.file, file_optional=True, environ=environ,
                                      min_bytes=cfg.min_bytes)
    except (OSError, TypeError, ValueError) as exc:
        raise ConfigError("secret", f"{exc} (generate one: openssl rand -hex 32)") from None
    if secret is None and cfg.required:
        raise ConfigError("secret", f"no session secret in ${cfg.env} or {cfg.file}; mount the Kubernetes Secret "
                          f"{cfg.k8s_name!r} (deploy/README in docs/deploy.md) or set secret.required: false")
    return secret


def connect(address: str | None, cfg: DeployConfig, tmp: Path) -> None:
    """``ray.init`` to ``address``, or a local Ray advertising the config's resources; the command's SIGTERM
    handling stays (``cli.sigterm_kept``)."""
    import ray

    from sync_service.entrypoints.cli import sigterm_kept

    env, t, e = defaults.RAY_WORKER_ENV, cfg.trainers, cfg.engines
    local = dict(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp),
                 resources={t.resource: t.shards * t.resource_per_shard, e.resource: e.count * e.resource_per_engine})
    with sigterm_kept():
        ray.init(**({"address": address} if address is not None else local), log_to_driver=False,
                 runtime_env={"env_vars": env})


def run_versions(cfg: DeployConfig, deployment, sync, first_version: int = 0, versions: int | None = None,
                 replay=None, steps: Steps | None = None) -> list[VersionRow]:
    """Push ``versions`` (default ``cfg.run.versions``) versions from ``first_version`` on: training step
    (version > 0) → push → verify (``cfg.run.verify``). ``replay`` (an ``AdapterReplay``) is advanced
    alongside the trainers; pass the same one across calls. ``steps``: progress, a step per version.
    Returns one row per version."""
    import ray

    rows = []
    for v in range(first_version, first_version + (cfg.run.versions if versions is None else versions)):
        if steps is not None:
            steps.step(f"version {v}: training step, push" + (", verify" if cfg.run.verify else ""))
        if v and cfg.model.adapter is not None:
            ray.get([t.train_step.remote(v) for t in deployment.trainers], timeout=cfg.sync.timeout_s)
            if replay is not None:
                replay.step(v)
        m = sync.push(v)
        engines = [{"engine": r.engine, "committed": r.committed} for r in m.engines]
        if cfg.run.verify:
            checks = verify_weights(cfg.model.base, deployment.engines, replay, tp=cfg.trainers.tp,
                                    timeout_s=cfg.sync.timeout_s)
            engines = [{**e, **c} for e, c in zip(engines, checks)]
        else:
            engines = [{**e, "verified": e["committed"]} for e in engines]
        rows.append(VersionRow.of(v, m, engines))
        print_row(rows[-1])
    return rows


def placement_report(deployment) -> dict:
    """Node id of every trainer shard and engine, and the transport chosen (with the reason)."""
    transport, reason = deployment.transport()
    return {"trainer_nodes": deployment.trainer_nodes(), "engine_nodes": deployment.engine_nodes(),
            "transport": transport, "transport_reason": reason}


def execute(cfg: DeployConfig, address: str | None, json_path: Path | None, launcher, *,
            metrics_port: int | None = None, versions: dict | None = None) -> int:
    """Connect, place (actors from ``launcher``), push and verify; 0 when every version verified on every engine.
    ``versions``: ``sync_cli.version_options`` (``accumulate_dtype``, ``first_version``, ``reset_versions``);
    the first version follows what the engines serve unless given."""
    versions = {"accumulate_dtype": "float32", "first_version": None, "reset_versions": False, **(versions or {})}
    import ray

    from sync_service.api import SyncConfig, WeightSync
    from sync_service.entrypoints.local import AdapterReplay
    from sync_service.cluster.placement import Deployment

    secret = load_secret(cfg.secret)
    quiet_libraries()
    tmp = run_dir("run")
    rows: list = []
    t0 = time.perf_counter()
    steps = Steps(3 + cfg.run.versions)
    try:
        steps.step(f"connecting to Ray ({address or 'a local one'})")
        connect(address, cfg, ray_temp(tmp))
        steps.step(f"placing {cfg.trainers.shards} trainer shard(s) and {cfg.engines.count} engine(s)")
        deployment = Deployment.start(cfg, launcher)
        try:
            placed = placement_report(deployment)
            Steps.write(f"placed {len(deployment.trainers)} trainer shard(s) on {len(set(placed['trainer_nodes']))} node(s), "
                        f"{len(deployment.engines)} engine(s) on {len(set(placed['engine_nodes']))} node(s); transport "
                        f"{placed['transport']} ({placed['transport_reason']})")
            steps.step("planning, validating the plan against every engine")
            sync = WeightSync(trainers=deployment.trainers, engines=deployment.engines, config=SyncConfig(
                transport=placed["transport"], bucket_bytes=cfg.sync.bucket_bytes, timeout_s=cfg.sync.timeout_s,
                delta=cfg.sync.delta, secret=secret,  # None: the coordinator makes a fresh per-session secret
                metrics_port=metrics_port, accumulate_dtype=versions["accumulate_dtype"],
                reset_versions=versions["reset_versions"]))
            announce_metrics(sync)
            replay = AdapterReplay(cfg.model.adapter) if cfg.model.adapter is not None else None
            print_header()
            first = first_version(sync.engine_versions(), given=versions["first_version"], reset=versions["reset_versions"])
            rows = run_versions(cfg, deployment, sync, first_version=first, replay=replay, steps=steps)
            sync.close()
        finally:
            deployment.close()
    finally:
        steps.close()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    total = time.perf_counter() - t0
    ok = len(rows) == cfg.run.versions and all(r.verified for r in rows)
    Steps.write(f"{'all versions committed' + (' and verified' if cfg.run.verify else '') if ok else 'FAILED'} "
                f"on {cfg.engines.count} engine(s) in {total:.1f} s")
    if json_path is not None:
        write_json(json_path, rows, {"ok": ok, "total_seconds": total, "placement": placed,
                                     "session_secret": secret is not None, "base": str(cfg.model.base)})
    return 0 if ok else 1


def run(args: argparse.Namespace) -> int:
    """``weightsync run`` entry (see ``sync_service/entrypoints/cli.py``). The config, the engine kind, the
    transport, ``SyncConfig``'s bounds and (where the driver sees them) the model files are checked
    before Ray starts (``preflight.check_deploy``); a bad value exits 2 with one line."""
    try:
        cfg = load_config(args.config)
    except (ConfigError, FileNotFoundError) as exc:
        fail(args, f"{args.config}: {exc}")
    for what, path in (("model.base", cfg.model.base), ("model.adapter", cfg.model.adapter)):
        if path is not None and not path.is_absolute() and args.address is not None:
            fail(args, f"{args.config}: {what} {path} is relative, and the Ray nodes read it from their own working "
                       f"directory; give an absolute path on storage every node mounts")
        if path is not None and not path.is_dir() and args.address is None:
            fail(args, f"{args.config}: {what} {path}: not a directory")
    # a local run: relative model paths are the driver's, made absolute before the actors get them
    if args.address is None:
        cfg.model.base = cfg.model.base.expanduser().absolute()
        cfg.model.adapter = cfg.model.adapter and cfg.model.adapter.expanduser().absolute()
    check_deploy(args, cfg)
    if args.json is not None and not args.json.parent.is_dir():
        fail(args, f"--json {args.json}: directory {args.json.parent} does not exist; create it or choose another path")
    from sync_service.entrypoints.sync_cli import version_options

    return execute(cfg, args.address, args.json, args.launcher, metrics_port=args.metrics_port,
                   versions=version_options(args))
