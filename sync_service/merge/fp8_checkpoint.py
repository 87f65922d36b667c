"""A block-FP8 checkpoint (``weightsync merge --quantize fp8`` or transformers' ``save_pretrained``) read in
hf-fused naming, as an engine that serves block FP8 holds it (``sync_service.fp8``).

On disk: ``X.weight`` float8_e4m3fn + ``X.weight_scale_inv`` (float32, or float8_e8m0fnu with ``scale_fmt``
"ue8m0"; kept in that dtype), per-expert keys where the family stores them so (qwen3_moe
``experts.N.gate_proj.weight`` and its scales). In memory (transformers' ``FP8Experts``):
one fused ``experts.gate_up_proj`` [E, 2I, H] float8 with ``experts.gate_up_proj_scale_inv`` [E, 2I/bm, H/bn];
the fused scales are the per-expert scales placed as the values are (``targets.target_pieces("hf")`` of the
scale grid), which is exact because every per-expert block is a block of the fused tensor (I divides by bm).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from protocols.params import full_box
from sync_service.fp8 import FP8_WIRE, scale_name
from sync_service.merge.base import SafetensorsBase
from sync_service.merge.errors import MergeError
from sync_service.merge.quantize import SCALE_FMTS, scale_dtype
from sync_service.merge.targets import target_pieces

__all__ = ["fp8_block", "fp8_scale_dtype", "is_fp8_checkpoint", "read_fp8_checkpoint"]


def is_fp8_checkpoint(model_dir: str | Path) -> bool:
    """Whether ``model_dir``'s config.json has a ``quantization_config`` with ``quant_method`` "fp8".

    Raises:
        MergeError: a ``quantization_config`` of another method, or not an object: engines serve unquantized or
            block-FP8 checkpoints only (and sync writes into nothing else).
    """
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return False
    quant = json.loads(config.read_text()).get("quantization_config") or {}
    if not quant:
        return False
    if not isinstance(quant, dict):
        raise MergeError(f"{config}: quantization_config is {quant!r}, not an object; write the checkpoint with "
                         f"weightsync merge --quantize fp8")
    if quant.get("quant_method") != "fp8":
        raise MergeError(f"{config}: quantization_config quant_method {quant.get('quant_method')!r} is not served; "
                         f"engines serve unquantized or block-FP8 checkpoints (weightsync merge --quantize fp8)")
    return True


def fp8_block(config: dict) -> tuple[int, int]:
    """The ``weight_block_size`` of a block-FP8 config.json dict.

    Raises:
        MergeError: no block size (per-tensor FP8), or a ``scale_fmt`` other than "float" / "ue8m0".
    """
    quant = config.get("quantization_config") or {}
    block = quant.get("weight_block_size")
    if quant.get("quant_method") != "fp8" or not block or len(block) != 2:
        raise MergeError(f"quantization_config {quant}: only block FP8 (quant_method fp8 with weight_block_size "
                         f"[bm, bn]) is served")
    fp8_scale_dtype(config)
    return int(block[0]), int(block[1])


def fp8_scale_dtype(config: dict) -> torch.dtype:
    """The dtype of a block-FP8 config.json dict's scales: float32 (``scale_fmt`` "float" or none), or
    float8_e8m0fnu ("ue8m0"). Raises ``MergeError`` for any other ``scale_fmt``, naming the ones served."""
    fmt = (config.get("quantization_config") or {}).get("scale_fmt") or "float"
    if fmt not in SCALE_FMTS:
        raise MergeError(f"quantization_config scale_fmt {fmt!r}: engines serve {' or '.join(SCALE_FMTS)} scales; "
                         f"write the checkpoint with weightsync merge --quantize fp8 --scale-fmt float")
    return scale_dtype(fmt)


def _disk_scales(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every ``*_scale_inv`` tensor on disk (1/(bm·bn) of the weights' elements), by disk key."""
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update((k, f.get_tensor(k)) for k in f.keys() if k.endswith("_scale_inv"))
    return out


def _fused_scales(name: str, shape: tuple[int, ...], block: tuple[int, int], base: SafetensorsBase,
                  disk: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The scales of FP8 tensor ``name`` in hf-fused naming, assembled from the disk scales of its pieces (each in
    ``dtype``, the config's scale format)."""
    grid = (*shape[:-2], shape[-2] // block[0], shape[-1] // block[1])
    out = torch.empty(grid, dtype=dtype)
    for piece in target_pieces("hf", name, grid, base.layout):
        key = scale_name(piece.name)
        if piece.transpose or key not in disk:
            raise MergeError(f"{base.dir}: scales {key} of {name} {'are transposed on disk' if piece.transpose else 'missing'}; "
                             f"only checkpoints as save_pretrained writes qwen3_moe-style FP8 experts are served")
        if disk[key].dtype != dtype:
            raise MergeError(f"{base.dir}: scales {key} are {disk[key].dtype}, but quantization_config's scale_fmt "
                             f"says {dtype}; write the checkpoint again with weightsync merge --quantize fp8")
        values = disk[key]
        out[tuple(slice(a, b) for a, b in piece.box)] = values.unsqueeze(0) if piece.drop_dim0 else values
    return out


def read_fp8_checkpoint(model_dir: str | Path) -> tuple[dict[str, torch.Tensor], tuple[int, int]]:
    """Every tensor of the block-FP8 checkpoint in hf-fused naming — FP8 values, their scales under ``scale_name``
    (float32, or float8_e8m0fnu for ue8m0: ``fp8_scale_dtype``), the unquantized tensors as stored — and its block.
    Memory: the whole checkpoint (copies).

    Raises:
        MergeError: not a block-FP8 checkpoint, an unknown scale_fmt, scales that do not fit their values (what
            ``merge.fp8_base.Fp8Base`` refuses: mis-shaped, another dtype than scale_fmt's, NaN/Inf, stray).
    """
    from sync_service.merge.fp8_base import Fp8Base

    model_dir = Path(model_dir)
    Fp8Base(model_dir)  # the checks an FP8 base gets: block, format, scales' grid, dtype, finiteness, stray scales
    base = SafetensorsBase(model_dir)
    block, dtype = fp8_block(base.config), fp8_scale_dtype(base.config)
    disk = _disk_scales(model_dir)
    out: dict[str, torch.Tensor] = {}
    for m in base.metas():
        if m.name.endswith("_scale_inv"):
            continue  # placed with their values
        out[m.name] = base.read(m.name, full_box(m.shape)).clone()
        if m.dtype == FP8_WIRE:
            out[scale_name(m.name)] = _fused_scales(m.name, m.shape, block, base, disk, dtype)
    return out, block
