"""``weightsync merge --quantize fp8``: the merged checkpoint written as block FP8, as transformers writes one.

Which tensors: transformers' own rule, run on the meta-device model of the base's config: its FP8
quantizer (``FineGrainedFP8HfQuantizer``, not pre-quantized) replaces every plain ``nn.Linear`` by
``FP8Linear`` and every ``*.experts`` module by ``FP8Experts``, except ``modules_to_not_convert``
(``get_keys_to_not_convert``: lm_head / output embeddings, tied weights, the last parameter's module), and
``param_needs_quantization`` names the parameters it quantizes on load. So embeddings, norms and routers
(not ``nn.Linear`` in the MoE families) stay unquantized. An on-disk tensor of a quantized parameter whose
last two dims do not divide by the block is passed through unquantized (``Fp8Quantize`` does the same).

On disk (checked against transformers' ``save_pretrained`` of a model it quantized on load): ``X.weight``
float8_e4m3fn + ``X.weight_scale_inv`` (float32, or float8_e8m0fnu with ``scale_fmt="ue8m0"``), per-expert keys
where the family stores them so, fused 3D weights with 3D scales where it stores them fused (granitemoe);
``config.json`` gains ``quantization_config`` = ``FineGrainedFP8Config(...).to_dict()``.

Values: each quantized piece is merged into a float32 (``accumulate_dtype="float32"``) or float64 scratch
(the accumulator cast at most once) and quantized by ``quantize.quantize_blocks`` in row bands of whole
blocks; with float64 accumulation the bytes equal transformers' ``Fp8Quantize`` of PEFT's float64 merge cast
to float32.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from sync_service.merge.errors import MergeError
from sync_service.merge.quantize import (FP8_DTYPE, SCALE_FMTS, divides, quantize_blocks, scale_dtype, scale_name,
                                         scale_shape)
from sync_service.merge.targets import Piece

QUANTIZE_METHODS = ("fp8",)
"""``--quantize`` values written; ``mxfp4`` is refused (``check_quantize``)."""

BAND_BYTES = 8 << 20
"""float32 values quantized per step, bytes (``quantize_blocks`` holds one copy of them beside its block grids)."""

Output = tuple[str, torch.dtype, tuple[int, ...]]


@dataclass(frozen=True, kw_only=True, slots=True)
class Fp8Options:
    """Block FP8 as ``transformers.FineGrainedFP8Config`` (its defaults)."""

    weight_block_size: tuple[int, int] = (128, 128)
    """Block ``[rows, cols]`` over a weight's last two dims, elements."""
    scale_fmt: str = "float"
    """``"float"`` (float32 scales) or ``"ue8m0"`` (power-of-two float8_e8m0fnu scales)."""


def check_quantize(quantize: str | None, options: Fp8Options | None) -> None:
    """The ``--quantize`` options of ``merge_checkpoint``; raises ``MergeError`` naming the flag and the fix."""
    if quantize == "mxfp4":
        raise MergeError("--quantize mxfp4 is not supported: transformers' MXFP4 quantizer runs triton kernels "
                         "fetched from the Hub, so there is no offline reference to check it against; use --quantize fp8")
    if quantize is not None and quantize not in QUANTIZE_METHODS:
        raise MergeError(f"unknown --quantize {quantize!r}; known: {', '.join(QUANTIZE_METHODS)}")
    if options is None:
        return
    if quantize is None:
        raise MergeError("--weight-block-size / --scale-fmt need --quantize fp8")
    block = options.weight_block_size
    if len(block) != 2 or not all(type(n) is int and n > 0 for n in block):  # bool is an int: [true, true]
        raise MergeError(f"--weight-block-size {block!r}: give two positive integers, e.g. 128,128")
    if options.scale_fmt not in SCALE_FMTS:
        raise MergeError(f"--scale-fmt {options.scale_fmt!r}: use one of {', '.join(SCALE_FMTS)}")


def _fp8_config(options: Fp8Options, **kwargs):
    from transformers import FineGrainedFP8Config

    return FineGrainedFP8Config(weight_block_size=list(options.weight_block_size), scale_fmt=options.scale_fmt, **kwargs)


def quantized_names(config: Mapping, options: Fp8Options) -> frozenset[str]:
    """In-memory parameter names transformers quantizes to FP8 for the model of ``config`` (a config.json
    dict): its quantizer's module replacement and ``param_needs_quantization``, on the meta device.

    Raises:
        MergeError: transformers cannot FP8-quantize this family (e.g. gpt_oss: ``FP8Experts`` has no biases).
    """
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    from sync_service.merge.derive import config_object, meta_model

    model = meta_model(config_object(dict(config)))
    quantizer = FineGrainedFP8HfQuantizer(_fp8_config(options), pre_quantized=False)
    try:
        quantizer.preprocess_model(model)
    except Exception as err:  # noqa: BLE001 - transformers refusing the family is bad input here
        raise MergeError(f"model family {config.get('model_type')}: transformers cannot FP8-quantize it "
                         f"({type(err).__name__}: {' '.join(str(err).split())[:200]}); merge without --quantize") from None
    return frozenset(n for n, _ in model.named_parameters() if quantizer.param_needs_quantization(model, n))


def write_quantization_config(config_path: Path, options: Fp8Options) -> None:
    """Add ``quantization_config`` to a written config.json, as transformers' ``save_pretrained`` writes it."""
    config = json.loads(config_path.read_text())
    config["quantization_config"] = _fp8_config(options).to_dict()
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _bands(shape: tuple[int, ...], block: tuple[int, int]) -> Iterator[tuple[tuple, tuple]]:
    """``(values index, scales index)`` of row bands of whole blocks covering ``shape`` (``[.., N, K]``), each
    at most ``BAND_BYTES`` of float32 (at least one block row)."""
    bm, bn = block
    rows = max(1, BAND_BYTES // (4 * shape[-1] * bm)) * bm
    for lead in (torch.cartesian_prod(*[torch.arange(n) for n in shape[:-2]]).reshape(-1, len(shape) - 2).tolist()
                 if len(shape) > 2 else [[]]):
        for r0 in range(0, shape[-2], rows):
            r1 = min(r0 + rows, shape[-2])
            yield (*lead, slice(r0, r1)), (*lead, slice(r0 // bm, r1 // bm))


class Fp8Writer:
    """Outputs and values of each target piece of a quantized merge (the interface of ``export._PlainWriter``).

    Args:
        source: the merged source; its out dtype for ``quantized`` names must be the accumulate dtype
            (``out_dtypes``), every other name's the unquantized output dtype.
        quantized: in-memory names transformers quantizes (``quantized_names``).
        plain_dtype: dtype of the pieces of ``quantized`` names left unquantized (block does not divide).
    """

    def __init__(self, source, options: Fp8Options, quantized: frozenset[str], plain_dtype: torch.dtype):
        self.source, self.options, self.quantized, self.plain_dtype = source, options, quantized, plain_dtype
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self.quantized_pieces = 0

    def outputs(self, name: str, piece: Piece) -> list[Output]:
        """The on-disk tensors of ``piece``: ``(key, dtype, shape)``, the weight first."""
        block = self.options.weight_block_size
        if name not in self.quantized:
            return [(piece.name, self.source.out_dtype(name), piece.shape)]
        if not divides(piece.shape, block):
            return [(piece.name, self.plain_dtype, piece.shape)]
        return [(piece.name, FP8_DTYPE, piece.shape),
                (scale_name(piece.name), scale_dtype(self.options.scale_fmt), scale_shape(piece.shape, block))]

    def fill(self, name: str, piece: Piece, views: list[torch.Tensor]) -> None:
        """Write ``piece``'s values into ``views`` (shaped as ``outputs``). Raises what ``MergedSource.fill`` raises."""
        if name not in self.quantized:
            self.source.fill(name, piece.box, piece.from_target(views[0]))
            return
        merged = self._merged(name, piece)
        if len(views) == 1:
            views[0].copy_(merged)  # passed through: one cast from the accumulator
            return
        self.quantized_pieces += 1
        for values, scales in _bands(piece.shape, self.options.weight_block_size):
            q, s = quantize_blocks(merged[values], self.options.weight_block_size, self.options.scale_fmt)
            views[0][values].copy_(q)
            views[1][scales].copy_(s)

    def _merged(self, name: str, piece: Piece) -> torch.Tensor:
        """``piece``'s merged values in the accumulate dtype, in the target's shape (a reused scratch)."""
        dtype = self.source.out_dtype(name)
        nbytes = math.prod(piece.shape) * dtype.itemsize
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        merged = self._scratch[:nbytes].view(dtype).view(piece.shape)
        self.source.fill(name, piece.box, piece.from_target(merged))
        return merged
