"""``weightsync merge``: merge a PEFT LoRA adapter into a base checkpoint, streamed to safetensors."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from sync_service.merge.errors import MergeError
from sync_service.merge.targets import TARGETS


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``"2GB"``, ``"500MB"``, ``"1.5GiB"``, ``"1000"`` → bytes (decimal KB/MB/GB, binary KiB/MiB/GiB)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) * _UNITS[unit] < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} not understood; use e.g. 2GB, 500MB, 1GiB, 4096")
    return int(float(m.group(1)) * _UNITS[unit])


MIN_STAGING_SIZE = 4096


def parse_staging_size(text: str) -> int:
    """``parse_size`` with a floor of ``MIN_STAGING_SIZE`` bytes (smaller budgets merge element by element)."""
    size = parse_size(text)
    if size < MIN_STAGING_SIZE:
        raise argparse.ArgumentTypeError(f"size {text!r} is below the minimum {MIN_STAGING_SIZE} bytes (4KiB); use e.g. 64MiB")
    return size


def parse_block(text: str) -> tuple[int, int]:
    """``"128,128"`` → ``(128, 128)``: the FP8 block, two positive integers."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"block size {text!r} not understood; give two positive integers, e.g. 128,128")
    return int(parts[0]), int(parts[1])


def max_threads() -> int:
    """Most ``--threads``: the CPUs this process may run on (its affinity; ``os.cpu_count()`` where the
    platform has none). More threads than CPUs only contend, and OpenMP crashes on ~10^5 threads."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", required=True, help="base checkpoint directory (config.json + *.safetensors; a block-FP8 "
                                                      "one is dequantized, merged, requantized), or a "
                                                      "torch.distributed.checkpoint directory with its config.json (docs/merge.md), or a "
                                                      "Megatron-Core torch_dist checkpoint with Megatron-Bridge LoRA (with --hf-config)")
    parser.add_argument("--adapter", default=None, help="PEFT LoRA adapter directory (adapter_config.json + adapter_model"
                                                        ".safetensors), or a DCP directory of the PEFT model (docs/merge.md); "
                                                        "without it the base itself is written (with --quantize fp8: an FP8 "
                                                        "copy of the base; with --dtype: cast)")
    parser.add_argument("--hf-config", default=None, metavar="DIR",
                        help="with a Megatron-Core torch_dist --base: the HF model directory it was converted from "
                             "(config.json; its weights where the checkpoint holds only the LoRA) (docs/integrate.md)")
    parser.add_argument("--lora-alpha", default=None, type=float,
                        help="with a torch_dist --base and no Megatron-Bridge run_config.yaml inside it: the LoRA alpha "
                             "it was trained with (the merge is W + alpha/dim * linear_out @ linear_in)")
    parser.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    parser.add_argument("--target", default="hf", choices=sorted(TARGETS), help="output naming (default: hf, as save_pretrained)")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"], help="output dtype (default: the base's; with --quantize, of the tensors left unquantized: bfloat16)")
    parser.add_argument("--max-shard-size", default="5GB", type=parse_size, help="largest shard, e.g. 2GB, 500MB (default 5GB)")
    parser.add_argument("--staging-size", default="64MiB", type=parse_staging_size, help="fp32 merge scratch budget, at least 4KiB (default 64MiB)")
    parser.add_argument("--threads", default=1, type=int,
                        help="torch intra-op threads, at most the CPUs this process may run on (default 1: the merge is memory-bound in cache-sized steps; "
                             "more threads gain little and slow down badly on a busy machine)")
    parser.add_argument("--accumulate-dtype", choices=("float32", "float64"), default="float32",
                        help="merge scratch dtype (float64: bitwise PEFT's float64 merge cast once, and with --quantize fp8 "
                             "bitwise transformers' FP8 of it; twice the scratch)")
    parser.add_argument("--quantize", default=None, metavar="fp8",
                        help="write block FP8 as transformers' FineGrainedFP8Config does (docs/merge.md); mxfp4 is refused")
    parser.add_argument("--weight-block-size", default=None, type=parse_block, help="FP8 block, rows,cols (default 128,128)")
    parser.add_argument("--scale-fmt", default=None, choices=("float", "ue8m0"), help="FP8 scales: float32 (default) or ue8m0")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")


def _megatron_inputs(args: argparse.Namespace, tmp: Path) -> tuple[Path, Path]:
    """(base dir, PEFT adapter dir) of a Megatron-Core torch_dist ``--base`` (``sync_service/megatron/torch_dist.py``)."""
    from sync_service.megatron.torch_dist import hf_dirs

    if args.adapter is not None:
        raise MergeError(f"--adapter {args.adapter}: a torch_dist --base holds its Megatron-Bridge LoRA; drop --adapter")
    if args.hf_config is None:
        raise MergeError(f"--base {args.base} is a Megatron-Core torch_dist checkpoint; give --hf-config DIR, "
                         f"the HF model directory it was converted from")
    base, adapter, _ = hf_dirs(args.base, args.hf_config, tmp, alpha=args.lora_alpha)
    return base, adapter


def run(args: argparse.Namespace) -> int:
    import torch

    from sync_service.megatron.torch_dist import is_torch_dist_dir
    from sync_service.merge.dcp import resolve_inputs
    from sync_service.entrypoints.progress import Steps
    from sync_service.entrypoints.workdir import run_root
    from sync_service.merge.export import merge_checkpoint
    from sync_service.merge.export_fp8 import Fp8Options

    if not 1 <= args.threads <= max_threads():
        print(f"weightsync merge: error: --threads must be in [1, {max_threads()}] (the CPUs this process may run on), "
              f"got {args.threads}; give at most {max_threads()}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    fp8 = None
    if args.weight_block_size is not None or args.scale_fmt is not None:
        fp8 = Fp8Options(weight_block_size=args.weight_block_size or (128, 128), scale_fmt=args.scale_fmt or "float")
    # on a terminal, a bar names the seconds of reading (PEFT's import, the headers, the factors) before the merge's
    # own bar; off a terminal one line once everything is checked (a refusal stays one line), then the FP8 report
    terminal = not args.no_progress and sys.stderr.isatty()
    reading, t0 = Steps(1, enabled=terminal), time.monotonic()

    def merging() -> None:
        reading.close()
        if not args.no_progress and not terminal:
            print(f"weightsync merge: read and checked the base and the adapter; merging into {args.out} "
                  f"({time.monotonic() - t0:.1f} s in)", file=sys.stderr, flush=True)

    try:
        with tempfile.TemporaryDirectory(prefix="wsync-dcp", dir=run_root()) as tmp:
            reading.step("reading the base and the adapter")
            if is_torch_dist_dir(args.base):
                base, adapter = _megatron_inputs(args, Path(tmp))
            elif args.hf_config is not None or args.lora_alpha is not None:
                raise MergeError(f"--hf-config / --lora-alpha go with a Megatron-Core torch_dist --base; {args.base} "
                                 f"is not one (no metadata.json naming sharded_backend torch_dist)")
            else:
                base, adapter = resolve_inputs(Path(args.base), None if args.adapter is None else Path(args.adapter), Path(tmp))
            summary = merge_checkpoint(
                base, adapter, args.out, target=args.target, dtype=args.dtype,
                max_shard_bytes=args.max_shard_size, staging_bytes=args.staging_size,
                accumulate_dtype=args.accumulate_dtype, quantize=args.quantize, fp8=fp8,
                progress=False if args.no_progress else None, on_merge=merging,
            )
    except MergeError as exc:
        reading.close()
        print(f"weightsync merge: error: {exc}", file=sys.stderr)
        return 2
    finally:
        reading.close()
    if "quantized" in summary:
        print(fp8_report(summary, fp8.weight_block_size if fp8 else (128, 128)), file=sys.stderr)
    print(json.dumps(summary))
    return 0


def fp8_report(summary: dict, block: tuple[int, int]) -> str:
    """What ``--quantize fp8`` did, for stderr: how many weights became FP8 of those transformers quantizes, and a
    warning naming an unquantized one and a block that divides them all when the block leaves most of them out.

    ``summary``: ``merge_checkpoint``'s (``quantized``, ``quantizable``, ``unquantized``)."""
    done, of = summary["quantized"], summary["quantizable"]
    size = ",".join(map(str, block))
    line = (f"weightsync merge: --quantize fp8: {done} of {of} weights transformers quantizes are FP8 "
            f"(--weight-block-size {size})")
    left = summary.get("unquantized")
    if left is None:
        return line
    line += (f"; the other {of - done} stay {left['dtype']}: the block does not divide "
             f"their last two dims (e.g. {left['example']})")
    if 2 * done < of:
        line += f"\nweightsync merge: warning: the block leaves most weights unquantized; --weight-block-size {left['block_hint']} divides them all"
    return line
