"""A block-FP8 checkpoint as the base of a merge or a trainer: dequantize the block, merge, requantize.

A QLoRA-style base (DeepSeek-V3 / Qwen3-*-FP8, ``weightsync merge --quantize fp8``): ``X.weight`` float8_e4m3fn
``[.., N, K]`` plus ``X.weight_scale_inv`` ``[.., N/bm, K/bn]`` (float32, or power-of-two ``float8_e8m0fnu`` with
``scale_fmt`` "ue8m0"), ``quantization_config`` quant_method "fp8" with ``weight_block_size [bm, bn]`` in
config.json. ``Fp8Base`` is a ``SafetensorsBase`` whose FP8 tensors read dequantized: every box is
``fp8.to(float32) × scale_inv.to(float32)`` per element, one float32 product each — the operations of
transformers' ``Fp8Dequantize._dequantize_one``, so bitwise what ``FineGrainedFP8Config(dequantize=True)`` loads
before its cast into the model dtype. The merge core then adds the LoRA delta to these values in its
accumulation dtype and casts or quantizes once per the engine's table; no delta is ever added to FP8 values.

Dtype reported by ``metas()`` for a dequantized tensor: **float32**, the dtype in which the dequantized value is
exact (transformers' ``dequantize=True`` casts it into the model dtype, bfloat16, a second rounding the float64
oracle does not make). A trainer loading this base holds those tensors in float32 (4 bytes an element, not 1).
Unquantized tensors (embeddings, norms, lm_head, routers) keep their stored dtype. The scales are not listed:
they are consumed here (fused experts: the per-expert scales placed as their values are, ``_fused_scales``).

Requantizing is not a pass-through: transformers' ``Fp8Quantize`` of a dequantized block gives the same FP8
values with float32 scales but about one scale in eight one or two ulps away (1 / (448 / amax) rounds
differently from the stored one), and with ue8m0 scales a block whose largest value is at most 224·scale comes back with half
the scale and doubled FP8 codes (the same dequantized values). Every tensor an FP8 engine holds is therefore
sent as ``Fp8Quantize`` of the merged model — one rule for changed and unchanged tensors alike, the oracle's.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from protocols.params import Box, box_shape
from sync_service.dtypes import SAFETENSORS_DTYPES
from sync_service.fp8 import FP8_WIRE, box_aligned, scale_name
from sync_service.merge.base import SafetensorsBase
from sync_service.merge.errors import MergeError
from sync_service.merge.finite import all_finite
from sync_service.merge.inputs import read_json_object
from sync_service.merge.layouts import FamilyLayout

__all__ = ["Fp8Base", "dequantize_box", "open_base"]

_SCALE_TAGS = {"float": "F32", "ue8m0": "F8_E8M0"}
"""``FineGrainedFP8Config`` scale_fmt → the safetensors dtype tag of its ``*_scale_inv`` (float32 / float8_e8m0fnu)."""
_FIX = "write the checkpoint with weightsync merge --quantize fp8 or transformers' save_pretrained"


def open_base(checkpoint_dir: str | Path, *, as_loaded: bool = False) -> SafetensorsBase:
    """The base of a merge or a trainer: ``Fp8Base`` for a block-FP8 checkpoint, else ``SafetensorsBase``.

    Raises:
        MergeError: any other ``quantization_config`` (only block FP8 is dequantized), FP8 tensors without one, or
            what the base raises.
    """
    path = Path(checkpoint_dir) / "config.json"
    quant = read_json_object(path).get("quantization_config") if path.is_file() else None
    if not quant:
        return _unquantized(SafetensorsBase(checkpoint_dir, as_loaded=as_loaded), path)
    if isinstance(quant, dict) and quant.get("quant_method") != "fp8":
        method = quant.get("quant_method")
        raise MergeError(f"{path}: quantization_config quant_method {method!r}: a quantized base is read only as block "
                         f"FP8 (quant_method fp8 with weight_block_size); give its bf16/fp32 checkpoint instead")
    return Fp8Base(checkpoint_dir, as_loaded=as_loaded)


def _unquantized(base: SafetensorsBase, config_path: Path) -> SafetensorsBase:
    """``base`` unless it holds FP8 values, which without a ``quantization_config`` have no block or format to be
    dequantized by (read raw they would be merged as if they were the weights). Raises MergeError naming one."""
    fp8 = sorted(m.name for m in base.metas() if m.dtype == FP8_WIRE)
    if fp8:
        raise MergeError(f"{config_path}: no quantization_config, but {fp8[0]} ({len(fp8)} tensor(s)) is {FP8_WIRE}; "
                         f"add the quantization_config it was written with (quant_method fp8, weight_block_size, "
                         f"scale_fmt) or give its bf16/fp32 checkpoint")
    return base


def _block_of(config_path: Path, quant: dict) -> tuple[tuple[int, int], str]:
    """``(weight_block_size, scale_fmt)`` of a block-FP8 ``quantization_config``. Raises MergeError naming the file.
    ``scale_fmt`` absent means "float" (``FineGrainedFP8Config``'s default); ``null`` is refused, as transformers does."""
    if not isinstance(quant, dict):
        raise MergeError(f"{config_path}: quantization_config is {quant!r}, not an object; {_FIX}")
    block, fmt = quant.get("weight_block_size"), quant.get("scale_fmt", "float")
    if not isinstance(block, list) or len(block) != 2 or not all(type(n) is int and n > 0 for n in block):
        raise MergeError(f"{config_path}: quantization_config weight_block_size {block!r} is not two positive ints "
                         f"[rows, cols] (per-tensor FP8 is not read); {_FIX}")
    if fmt not in ("float", "ue8m0"):
        raise MergeError(f"{config_path}: quantization_config scale_fmt {fmt!r}: use 'float' or 'ue8m0'; {_FIX}")
    return (block[0], block[1]), fmt


def dequantize_box(values: torch.Tensor, scales: torch.Tensor, box: Box, block: tuple[int, int]) -> torch.Tensor:
    """``box`` of an FP8 tensor dequantized: ``values`` (float8_e4m3fn, ``box_shape(box)``) × the scale of each
    element's block, both in float32, one product per element (transformers' ``Fp8Dequantize._dequantize_one``).
    ``scales``: the whole tensor's float32 scale grid ``[.., N/bm, K/bn]``; ``box`` may cut blocks anywhere.
    Returns a new float32 tensor of ``box_shape(box)``."""
    (r0, r1), (c0, c1) = box[-2:]
    bm, bn = block
    lead = tuple(slice(a, b) for a, b in box[:-2])
    grid = scales[(*lead, slice(r0 // bm, -(-r1 // bm)), slice(c0 // bn, -(-c1 // bn)))]
    per_element = grid.repeat_interleave(bm, dim=-2).repeat_interleave(bn, dim=-1)
    per_element = per_element[..., r0 % bm: r0 % bm + r1 - r0, c0 % bn: c0 % bn + c1 - c0]
    return values.to(torch.float32) * per_element


class Fp8Base(SafetensorsBase):
    """A block-FP8 checkpoint read dequantized (module docstring); the ``BaseProvider`` of ``SafetensorsBase``.

    Attributes:
        block: ``(bm, bn)`` of ``weight_block_size``. scale_fmt: ``"float"`` or ``"ue8m0"``.
        dequantized_dtype: the dtype name of config.json (``"bfloat16"`` if absent): what transformers'
            ``dequantize=True`` loads and the default output dtype of ``weightsync merge`` without ``--quantize``.

    Raises:
        MergeError: a bad ``quantization_config``, or one with no FP8 tensor; an FP8 tensor whose scales are
            missing, mis-shaped (not the block grid of its shape), transposed on disk, of another dtype than its
            ``scale_fmt`` writes, not finite (an ue8m0 byte 0xFF is NaN) or <= 0; scales without FP8 values — each
            naming the tensor; and what ``SafetensorsBase`` raises.
    """

    def __init__(self, checkpoint_dir: str | Path, layout: FamilyLayout | None = None, *, as_loaded: bool = False):
        config_path = Path(checkpoint_dir) / "config.json"
        config = read_json_object(config_path) if config_path.is_file() else {}
        self.block, self.scale_fmt = _block_of(config_path, config.get("quantization_config", {}))
        self.dequantized_dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
        self._scale_disk: dict[str, tuple[str, str, tuple[int, ...]]] = {}
        super().__init__(checkpoint_dir, layout, as_loaded=as_loaded)
        self._scales = {m.name: self._fused_scales(m.name, m.shape) for m in self._metas if m.dtype == FP8_WIRE}
        if not self._scales:
            raise MergeError(f"{config_path}: quantization_config says fp8 but no tensor is {FP8_WIRE}; drop the "
                             f"quantization_config or {_FIX}")
        self._check_stray_scales()
        self._metas = [replace(m, dtype="float32") if m.name in self._scales else m for m in self._metas]

    def _disk_index(self) -> dict[str, tuple[str, str, tuple[int, ...]]]:
        """disk key → (file, wire dtype, shape) of every tensor but the scales, which go to ``_scale_disk`` with
        their safetensors dtype tag."""
        entries = self._disk_entries()
        self._scale_disk = {key: entry for key, entry in entries.items() if key.endswith("_scale_inv")}
        return {key: (file, SAFETENSORS_DTYPES.get(tag, tag), shape) for key, (file, tag, shape) in entries.items()
                if key not in self._scale_disk}

    def _fused_scales(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The float32 scale grid of FP8 tensor ``name`` in hf-fused naming, from the disk scales of its pieces."""
        bm, bn = self.block
        if len(shape) < 2 or shape[-2] % bm or shape[-1] % bn:
            raise MergeError(f"{self.dir}: {name} {list(shape)} is {FP8_WIRE} but the block {[bm, bn]} of "
                             f"quantization_config does not divide its last two dims; {_FIX}")
        out = torch.empty((*shape[:-2], shape[-2] // bm, shape[-1] // bn), dtype=torch.float32)
        for piece, _ in self._plans[name]:
            out[self._grid_slices(name, piece)] = piece.from_target(self._disk_scales(name, piece))
        return out

    def _grid_slices(self, name: str, piece) -> tuple[slice, ...]:
        """The scale-grid slices of a values piece; its box must lie on block edges."""
        if piece.transpose or not box_aligned(piece.box, self.block):
            raise MergeError(f"{self.dir}: {piece.name} of {name} is {'transposed on disk' if piece.transpose else 'cut off the block edges'}; "
                             f"only FP8 checkpoints as save_pretrained writes them (block-aligned, untransposed) are read")
        (r0, r1), (c0, c1) = piece.box[-2:]
        bm, bn = self.block
        return (*(slice(a, b) for a, b in piece.box[:-2]), slice(r0 // bm, r1 // bm), slice(c0 // bn, c1 // bn))

    def _disk_scales(self, name: str, piece) -> torch.Tensor:
        """The disk scales of values piece ``piece`` as float32, checked: present, a scale dtype, the block grid."""
        key = scale_name(piece.name)
        entry = self._scale_disk.get(key)
        want = (*piece.shape[:-2], piece.shape[-2] // self.block[0], piece.shape[-1] // self.block[1])
        if entry is None:
            raise MergeError(f"{self.dir}: {piece.name} is {FP8_WIRE} but its scales {key} are missing; {_FIX}")
        file, tag, got = entry
        if tag not in _SCALE_TAGS.values() or got != want:
            raise MergeError(f"{self.dir}: {key} (scales of {name}) is {tag}{list(got)}; block FP8 with "
                             f"weight_block_size {list(self.block)} needs F32 or F8_E8M0 {list(want)}; {_FIX}")
        if tag != _SCALE_TAGS[self.scale_fmt]:
            raise MergeError(f"{self.dir}: {key} (scales of {name}) is {tag} but quantization_config scale_fmt is "
                             f"{self.scale_fmt!r}, whose scales are {_SCALE_TAGS[self.scale_fmt]}; {_FIX}")
        with safe_open(file, framework="pt") as f:
            scales = f.get_tensor(key).to(torch.float32)
        if not all_finite(scales):  # an ue8m0 byte 0xFF is NaN: every value of its block would be
            raise MergeError(f"{self.dir}: {key} (scales of {name}) holds NaN or Inf; {_FIX}")
        if scales.numel() and float(scales.min()) <= 0:  # transformers' Fp8Quantize writes amax / 448 > 0
            raise MergeError(f"{self.dir}: {key} (scales of {name}) holds a scale <= 0 ({float(scales.min()):g}): its "
                             f"block would dequantize to zeros or flipped signs; block-FP8 scales are positive; {_FIX}")
        return scales

    def _check_stray_scales(self) -> None:
        """Every scale on disk belongs to an FP8 tensor (a scale beside bf16 values would be silently dropped)."""
        used = {scale_name(piece.name) for name in self._scales for piece, _ in self._plans[name]}
        stray = sorted(set(self._scale_disk) - used)
        if stray:
            raise MergeError(f"{self.dir}: {stray[0]} has no {FP8_WIRE} values beside it ({len(stray)} such scale "
                             f"tensor(s)); {_FIX}")

    def read(self, name: str, box: Box) -> torch.Tensor:
        """``box`` of ``name``: FP8 tensors dequantized into a new float32 tensor (``dequantize_box``), the others
        as ``SafetensorsBase.read``."""
        scales = self._scales.get(name)
        if scales is None:
            return super().read(name, box)
        if any(a == b for a, b in box):
            return torch.empty(box_shape(box), dtype=torch.float32)
        return dequantize_box(self._read_stored(name, box), scales, box, self.block)
