"""The flags of ``weightsync sync`` (``add_arguments``), those ``demo`` shares (``add_common_arguments``) and
those ``sync`` / ``demo`` / ``run`` share (``add_version_arguments``); ``version_options`` reads the latter back."""

from __future__ import annotations

import argparse
from pathlib import Path

from sync_service import defaults
from sync_service.entrypoints.preflight import CLI_ENGINES
from sync_service.transports.spec import TRANSPORTS

__all__ = ["CHECK_SERVED", "absolute_path", "add_arguments", "add_common_arguments", "add_version_arguments", "version_options"]

CHECK_SERVED = ("off", "log", "enforce")
"""The values of ``--check-served`` (``SyncConfig.check_served``)."""


def absolute_path(text: str) -> Path:
    """The ``type=`` of every path flag: ``text`` (``~`` expanded) made absolute against the working directory
    now, since the processes it is handed to (Ray workers, a ``vllm serve`` started in its own directory) have
    another one (a relative ``--base qwen-base`` was read there as a Hub repo name)."""
    return Path(text).expanduser().absolute()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", required=True, type=absolute_path, help="base checkpoint directory (a block-FP8 one: the "
                                                                 "trainers read it dequantized, docs/merge.md)")
    parser.add_argument("--adapter", type=absolute_path, default=None, help="PEFT LoRA adapter directory (optional)")
    parser.add_argument("--engine-base", type=absolute_path, default=None, metavar="DIR",
                        help="the checkpoint the engines load (default: --base): the base in the serving dtype (each "
                             "tensor merged in the accumulation dtype and cast once into the engine's) or in block FP8 "
                             "(weightsync merge --quantize fp8: quantized once per block on the trainers); --engine hf; "
                             "docs/merge.md")
    parser.add_argument("--secret-file", type=absolute_path, default=None,
                        help="file holding the HMAC key that authenticates every bucket (>= 16 bytes, not group/"
                             "world-writable; default: $WEIGHTSYNC_SECRET_FILE, else a fresh random key per run)")
    parser.add_argument("--no-check-finite", dest="check_finite", action="store_false",
                        help="do not refuse merged weights holding NaN/Inf (the check costs one pass per tensor)")
    parser.add_argument("--vllm-url", dest="vllm_urls", action="append", default=[], metavar="URL",
                        help="--engine vllm-server: a running vLLM server started with the weightsync backend "
                             "(repeat for several; default: start --engines local servers). docs/vllm.md")
    parser.add_argument("--vllm-api-key", default=None, metavar="KEY",
                        help="the servers' --api-key (default: $VLLM_API_KEY)")
    parser.add_argument("--digests", type=absolute_path, default=None, metavar="FILE",
                        help="after each version write every engine's per-tensor xxh3_64 digests of the weights it "
                             "serves to FILE (JSON, every engine kind; vLLM reports its own names, and checkpoint copies where it keeps a "
                             "tensor opaque: \"source\" per tensor; docs/operations.md)")
    add_common_arguments(parser, versions=1)


def add_common_arguments(parser: argparse.ArgumentParser, *, versions: int) -> None:
    parser.add_argument("--trainers", type=int, default=None, help="trainer shards (default: ep · tp)")
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel ranks (default: --trainers, or 2)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    parser.add_argument("--engine", choices=tuple(CLI_ENGINES), default="hf",
                        help="rollout engine kind (default hf): " + "; ".join(f"{k}: {e.help}" for k, e in CLI_ENGINES.items()))
    parser.add_argument("--engines", type=int, default=None, metavar="M",
                        help="number of rollout engines (default: " + ", ".join(
                            f"{e.default_count} for {k}" for k, e in CLI_ENGINES.items()) + ")")
    parser.add_argument("--versions", type=int, default=versions, help=f"weight versions to push (default {versions})")
    parser.add_argument("--transport", choices=tuple(TRANSPORTS), default=defaults.TRANSPORT,
                        help=f"transport (default {defaults.TRANSPORT})")
    parser.add_argument("--bucket-bytes", type=int, default=defaults.SMALL_MODEL_BUCKET_BYTES,
                        help=f"bucket size in bytes (default {defaults.SMALL_MODEL_BUCKET_BYTES >> 20} MiB)")
    parser.add_argument("--timeout", type=float, default=defaults.TIMEOUT_S,
                        help=f"per-step timeout, seconds (default {defaults.TIMEOUT_S:g})")
    parser.add_argument("--json", type=absolute_path, default=None, help="write the results as JSON to this path")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve Prometheus metrics on 127.0.0.1:PORT/metrics while the run lasts (0: a free port)")
    parser.add_argument("--check-served", choices=CHECK_SERVED, default="log",
                        help="each engine's check of the bytes it is about to serve (SyncConfig.check_served; "
                             "default log: a finding is a warning and the version commits; enforce: the engine refuses "
                             "the commit; off: not installed; docs/operations.md)")
    add_version_arguments(parser)


def add_version_arguments(parser: argparse.ArgumentParser) -> None:
    """``--accumulate-dtype``, ``--first-version``, ``--reset-versions`` (sync, demo, run)."""
    parser.add_argument("--accumulate-dtype", choices=("float32", "float64"), default="float32",
                        help="merge accumulation dtype (default float32); float64 serves PEFT's float64 merge cast "
                             "once bit for bit, and the verdict then accepts no greedy-token flip at a near-tie")
    parser.add_argument("--first-version", type=int, default=None, metavar="N",
                        help="first weight version pushed (default: one above the highest version the engines "
                             "serve, 0 for fresh engines); at or below a served version it is refused")
    parser.add_argument("--reset-versions", action="store_true",
                        help="number versions from --first-version (default 0) even below what the engines serve")



def version_options(args: argparse.Namespace) -> dict:
    """The ``RunConfig`` fields of ``add_version_arguments``' flags."""
    return {"accumulate_dtype": args.accumulate_dtype, "first_version": args.first_version,
            "reset_versions": args.reset_versions}
