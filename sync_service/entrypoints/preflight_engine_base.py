"""``weightsync sync --engine-base DIR``: the checkpoint the engines load must hold the base's tensors, in the
base's shapes, each in a floating dtype the trainers' merge can cast into (``coordinator.planning.engine_dtypes``).
Checked from the safetensors headers before Ray starts (no tensor is read); a bad one exits 2 in one line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from protocols.params import MERGE_DTYPES
from sync_service.entrypoints.preflight import fail

__all__ = ["check_engine_base"]

_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # safetensors header names


def _header_tensors(model_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name → (dtype, shape) of every tensor in ``model_dir``'s ``*.safetensors`` (headers only)."""
    from safetensors import safe_open

    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                out[name] = (_DTYPES.get(piece.get_dtype(), piece.get_dtype()), tuple(piece.get_shape()))
    return out


def check_engine_base(args: argparse.Namespace, base: Path) -> None:
    """Exit 2 naming the first tensor that differs, unless ``args.engine_base`` (or nothing) fits ``base``."""
    engine_base = args.engine_base
    if engine_base is None:
        return
    if args.engine != "hf":
        fail(args, f"--engine-base: supported with --engine hf; --engine {args.engine} engines load --base "
                   f"(an fp32 trainer into a bf16 vLLM server: start the server from the bf16 checkpoint and "
                   f"give its --vllm-url)")
    config = engine_base / "config.json"
    if not engine_base.is_dir() or not config.is_file():
        fail(args, f"--engine-base {engine_base}: not a model directory (no config.json); give a checkpoint "
                   f"written by save_pretrained")
    if "quantization_config" in json.loads(config.read_text()):
        fail(args, f"--engine-base {engine_base}: a quantized checkpoint (quantization_config); engines serving "
                   f"block FP8 are not synced yet — give a bf16/fp16/fp32 checkpoint")
    ours, theirs = _header_tensors(base), _header_tensors(engine_base)
    if set(ours) != set(theirs):
        odd = sorted(set(ours) ^ set(theirs))[0]
        fail(args, f"--engine-base {engine_base}: tensor {odd} is in only one of --base and --engine-base; give "
                   f"the same model (e.g. --base saved in another dtype)")
    for name, (dtype, shape) in sorted(ours.items()):
        want, want_shape = theirs[name]
        if want_shape != shape:
            fail(args, f"--engine-base {engine_base}: {name} is {list(want_shape)} there and {list(shape)} in "
                       f"--base; give the same model (only the dtype may differ)")
        if want != dtype and not (want in MERGE_DTYPES and dtype in MERGE_DTYPES):
            fail(args, f"--engine-base {engine_base}: {name} is {want} there and {dtype} in --base; only "
                       f"float64/float32/float16/bfloat16 tensors are cast")
