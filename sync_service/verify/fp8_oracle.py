"""The oracle of an engine that serves block FP8: transformers' own quantizer on PEFT's float64 merge.

For every tensor ``X`` an engine's table lists as ``float8_e4m3fn`` with its scales ``X_scale_inv``
(``sync_service.fp8``'s rule, the block read from the two shapes), the oracle is transformers'
``Fp8Quantize._quantize_one(X, merged.float())`` (``integrations/finegrained_fp8.py``, the quantizer
``FineGrainedFP8Config`` checkpoints are written with; ``scale_fmt`` "ue8m0" where the engine's scales are
float8_e8m0fnu, else "float") of PEFT's float64 ``merge_and_unload``; every other
tensor is that merge cast once into the engine's dtype. The model the oracle decodes with is the same merge
with each FP8 tensor replaced by transformers' ``Fp8Dequantize._dequantize_one`` of the oracle's values and
scales, in the engine's compute dtype: what transformers computes with after loading the checkpoint with
``FineGrainedFP8Config(dequantize=True)``. Nothing of weightsync's quantizer (``merge/quantize.py``) runs here.

With ``--accumulate-dtype float64`` the served FP8 bytes and scales equal this oracle bit for bit; with
float32 an FP8 value may sit one FP8 step away and a scale one float32 rounding away (``peft_oracle.values_match``
allows one unit in the last place of the oracle value, here the FP8 step; for a ue8m0 scale that unit is a factor
of two, which also moves its whole block's FP8 values: test ue8m0 engines with float64 accumulation).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import SimpleNamespace

import torch

from protocols.params import ParamMeta
from sync_service.fp8 import SCALE_WIRES, scale_name, table_blocks, table_scale_dtypes
from sync_service.verify.peft_oracle import cast_, engine_dtype

__all__ = ["compute_dtype", "dequantized_", "quantized_state", "transformers_dequantize", "transformers_quantize"]


def _quantizer(block: tuple[int, int], scale_fmt: str) -> SimpleNamespace:
    from transformers import FineGrainedFP8Config

    return SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=list(block), scale_fmt=scale_fmt))


def transformers_quantize(key: str, values: torch.Tensor, block: tuple[int, int],
                          scale_fmt: str = "float") -> dict[str, torch.Tensor]:
    """transformers' ``Fp8Quantize._quantize_one(key, values)``: ``{key: float8_e4m3fn [.., N, K], scale key:
    scales [.., N/bm, K/bn]}`` (float32, or float8_e8m0fnu for ``"ue8m0"``), or ``{key: values}`` where
    transformers passes the tensor through (1-D, or a shape the block does not divide)."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    return Fp8Quantize(_quantizer(block, scale_fmt))._quantize_one(key, values)


def transformers_dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' ``Fp8Dequantize._dequantize_one``: ``values`` (float8_e4m3fn) times their block's scale
    (float32 or float8_e8m0fnu, both taken to float32), in ``dtype``; the block is read from the scales' grid."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(_quantizer((1, 1), "float"))._dequantize_one(values, scales, dtype)


def compute_dtype(table: Sequence[ParamMeta]) -> torch.dtype:
    """The dtype an FP8 engine computes in: the one floating dtype of its entries that are neither FP8 values
    nor their scales (bfloat16 when they hold several, as FP8 checkpoints ship)."""
    blocks = table_blocks(table)
    skip = set(blocks) | {scale_name(n) for n in blocks}
    return engine_dtype([m for m in table if m.name not in skip]) or torch.bfloat16


def quantized_state(merged: Mapping[str, torch.Tensor], table: Sequence[ParamMeta]) -> dict[str, torch.Tensor]:
    """The oracle of an engine with parameter table ``table``: from ``merged`` (PEFT's merge in float64, name →
    tensor, ``peft_oracle.model_state`` naming), every FP8 entry through ``transformers_quantize`` (fp32 input,
    the scale format of the table's scales: float32, or ue8m0's float8_e8m0fnu), every other floating tensor cast
    once into the table's dtype (names the table lacks: ``compute_dtype``). Name → tensor, scales included."""
    blocks, fmts = table_blocks(table), {n: SCALE_WIRES[d] for n, d in table_scale_dtypes(table).items()}
    serving = compute_dtype(table)
    dtypes = {m.name: m.dtype for m in table}
    out: dict[str, torch.Tensor] = {}
    for name, t in merged.items():
        if name in blocks:
            out |= transformers_quantize(name, t.to(torch.float32), blocks[name], fmts[name])
        elif t.is_floating_point():
            out[name] = t.to(getattr(torch, dtypes[name]) if name in dtypes else serving)
        else:
            out[name] = t
    return out


def dequantized_(model: torch.nn.Module, oracle: Mapping[str, torch.Tensor], table: Sequence[ParamMeta],
                 dtype: torch.dtype) -> torch.nn.Module:
    """``model`` (PEFT's float64 merge) cast to ``dtype`` with every FP8 parameter of ``table`` replaced by
    ``transformers_dequantize`` of ``oracle``'s values and scales, in place (``peft_oracle.cast_``: the rotary
    ``inv_freq`` stays float32, as the engine's); returns it (eval mode)."""
    cast_(model, dtype)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in table_blocks(table):
            params[name].copy_(transformers_dequantize(oracle[name], oracle[scale_name(name)], dtype))
    return model.train(False)
