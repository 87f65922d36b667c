"""``weightsync sync --engine-base DIR``: the checkpoint the engines load must hold the base's tensors, in the
base's shapes, each in a floating dtype the trainers' merge can cast into (``coordinator.planning.engine_dtypes``),
or a block-FP8 checkpoint for ``--engine hf`` (``quantization_config`` quant_method "fp8": a quantized tensor is
float8_e4m3fn in the base's shape with ``*_scale_inv`` of the block grid beside it, float32 or, with scale_fmt
"ue8m0", float8_e8m0fnu; no scale without its FP8 values). A block-FP8 ``--base`` is compared as the trainers
read it (``merge.fp8_base``): its FP8 tensors as float32, its scales not at all. Checked from the safetensors headers before Ray starts (no tensor is
read); a bad one exits 2 in one line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from protocols.params import MERGE_DTYPES
from sync_service.entrypoints.preflight import fail

__all__ = ["check_engine_base"]

_SCALE_DTYPES = {"float": "float32", "ue8m0": "float8_e8m0fnu"}
"""``quantization_config.scale_fmt`` → the wire dtype of the scales (``merge.quantize.scale_dtype``; no torch here)."""


def _header_tensors(args: argparse.Namespace, flag: str, model_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name → (dtype, shape) of every tensor in ``model_dir``'s ``*.safetensors`` (headers only). Exits 2 naming
    the file safetensors cannot read, or a directory without any."""
    from safetensors import safe_open

    from sync_service.dtypes import SAFETENSORS_DTYPES  # the header tags (safe_open imports torch anyway)

    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        fail(args, f"{flag} {model_dir}: no *.safetensors file; give a checkpoint written by save_pretrained")
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    out[name] = (SAFETENSORS_DTYPES.get(piece.get_dtype(), piece.get_dtype()), tuple(piece.get_shape()))
        except Exception as exc:  # noqa: BLE001 - safetensors' own errors on a damaged file: one line
            fail(args, f"{flag}: {path} is not a readable safetensors file ({type(exc).__name__}: {exc}); write it "
                       f"again (e.g. weightsync merge)")
    return out


def _quantization_config(args: argparse.Namespace, config: Path) -> dict:
    """``config.json``'s ``quantization_config`` (``{}`` when absent). Exits 2 naming the file when it is not JSON or
    the entry is not an object."""
    if not config.is_file():
        return {}
    try:
        quant = json.loads(config.read_text()).get("quantization_config") or {}
    except (ValueError, AttributeError) as exc:
        fail(args, f"--engine-base: {config} is not a JSON object ({exc}); give a checkpoint written by save_pretrained")
    if not isinstance(quant, dict):
        fail(args, f"--engine-base: {config}: quantization_config is {quant!r}, not an object; write the checkpoint "
                   f"with weightsync merge --quantize fp8")
    return quant


def check_engine_base(args: argparse.Namespace, base: Path) -> None:
    """Exit 2 naming the first tensor that differs, unless ``args.engine_base`` (or nothing) fits ``base``."""
    engine_base = args.engine_base
    if engine_base is None:
        return
    config = engine_base / "config.json"
    quant = _quantization_config(args, config)
    if quant and args.engine != "hf":
        fail(args, f"--engine-base {engine_base}: a quantized checkpoint is served by --engine hf only (block FP8); weightsync "
                   f"does not load FP8 values and scales into vLLM yet (docs/vllm.md, FP8); give a bf16 checkpoint")
    if args.engine != "hf":
        fail(args, f"--engine-base: supported with --engine hf; --engine {args.engine} engines load --base "
                   f"(an fp32 trainer into a bf16 vLLM server: start the server from the bf16 checkpoint and "
                   f"give its --vllm-url)")
    if not engine_base.is_dir() or not config.is_file():
        fail(args, f"--engine-base {engine_base}: not a model directory (no config.json); give a checkpoint "
                   f"written by save_pretrained")
    ours, theirs = _header_tensors(args, "--base", base), _header_tensors(args, "--engine-base", engine_base)
    if _is_fp8(base):  # the trainers read a block-FP8 --base dequantized, in float32 (merge.fp8_base)
        ours = {n: ("float32" if d == "float8_e4m3fn" else d, s) for n, (d, s) in ours.items() if not n.endswith("_scale_inv")}
    if quant:
        theirs = _fp8_values(args, engine_base, quant, theirs)
    if set(ours) != set(theirs):
        odd = sorted(set(ours) ^ set(theirs))[0]
        fail(args, f"--engine-base {engine_base}: tensor {odd} is in only one of --base and --engine-base; give "
                   f"the same model (e.g. --base saved in another dtype)")
    for name, (dtype, shape) in sorted(ours.items()):
        want, want_shape = theirs[name]
        if want_shape != shape:
            fail(args, f"--engine-base {engine_base}: {name} is {list(want_shape)} there and {list(shape)} in "
                       f"--base; give the same model (only the dtype may differ)")
        if want != dtype and not (want in MERGE_DTYPES and dtype in MERGE_DTYPES) and not (
                quant and want == "float8_e4m3fn" and dtype in MERGE_DTYPES):
            fail(args, f"--engine-base {engine_base}: {name} is {want} there and {dtype} in --base; only "
                       f"float64/float32/float16/bfloat16 tensors are cast")


def _is_fp8(base: Path) -> bool:
    """Whether ``--base`` is a block-FP8 checkpoint (its scales were checked by ``check_sharding``'s ``open_base``)."""
    from sync_service.merge.fp8_checkpoint import is_fp8_checkpoint

    try:
        return is_fp8_checkpoint(base)
    except (ValueError, AttributeError):  # not JSON / not an object: check_sharding names the file
        return False


def _fp8_values(args: argparse.Namespace, engine_base: Path, quant: dict,
                tensors: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors of a block-FP8 engine base without their scales, each scale checked against the block grid of
    its values (exits 2 naming the first that is not)."""
    from sync_service.fp8 import scale_name

    block = quant.get("weight_block_size")
    # scale_fmt absent means float; null is refused, as transformers' FineGrainedFP8Config refuses it
    if quant.get("quant_method") != "fp8" or quant.get("scale_fmt", "float") not in _SCALE_DTYPES:
        fail(args, f"--engine-base {engine_base}: quantization_config {quant} is not served; engines serve block FP8 "
                   f"(quant_method fp8, weight_block_size, scale_fmt float or ue8m0), e.g. weightsync merge "
                   f"--quantize fp8")
    scales = _SCALE_DTYPES[quant.get("scale_fmt", "float")]
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        fail(args, f"--engine-base {engine_base}: quantization_config weight_block_size {block!r} is not two positive "
                   f"ints [rows, cols]; write the checkpoint with weightsync merge --quantize fp8")
    if not any(dtype == "float8_e4m3fn" for dtype, _ in tensors.values()):
        fail(args, f"--engine-base {engine_base}: quantization_config says fp8 but it holds no float8_e4m3fn tensor; "
                   f"write it with weightsync merge --quantize fp8 and a --weight-block-size that divides its tensors")
    for name, (dtype, shape) in sorted(tensors.items()):
        if dtype != "float8_e4m3fn":
            continue
        grid = (*shape[:-2], shape[-2] // block[0], shape[-1] // block[1]) if len(shape) >= 2 else None
        got = tensors.get(scale_name(name))
        if grid is None or shape[-2] % block[0] or shape[-1] % block[1] or got != (scales, grid):
            fail(args, f"--engine-base {engine_base}: {name} {list(shape)} needs {scales} scales {scale_name(name)} "
                       f"{list(grid or ())} for blocks {list(block)}, got {got}; write it with weightsync merge --quantize fp8")
    used = {scale_name(n) for n, (dtype, _) in tensors.items() if dtype == "float8_e4m3fn"}
    stray = sorted(n for n in tensors if n.endswith("_scale_inv") and n not in used)
    if stray:  # scales beside bf16 values: the engine would load them or drop them, neither what the file says
        fail(args, f"--engine-base {engine_base}: {stray[0]} has no float8_e4m3fn values beside it ({len(stray)} such "
                   f"scale tensor(s)); write it with weightsync merge --quantize fp8")
    return {n: t for n, t in tensors.items() if not n.endswith("_scale_inv")}
