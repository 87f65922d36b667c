"""Block FP8 as an engine's served state: FP8 values and their scales, a dequantized copy to compute with.

Table rule (``sync_service.fp8``): each tensor the checkpoint quantizes is listed as ``float8_e4m3fn`` in its
own shape, followed by its scales ``scale_name(X)`` (``X.weight_scale_inv``, or ``<fused>_scale_inv`` for
fused experts, as transformers' ``FP8Linear`` / ``FP8Experts`` name them in memory) ``[.., N/bm, K/bn]`` in the
checkpoint's scale dtype: float32, or float8_e8m0fnu (``scale_fmt`` "ue8m0", powers of two). Those bytes are
what the engine serves: ``served()`` and readback report them.

Compute: an engine without FP8 kernels (the CPU HF engine) computes with a copy dequantized in its model's dtype,
as transformers' ``FineGrainedFP8Config(dequantize=True)`` loads one (``quantize.dequantize_blocks``, bitwise its
``Fp8Dequantize``: both operands to float32 — an e8m0 scale exactly — one product, one cast). It is refreshed
after each sync's last byte: ``finish_update`` dequantizes the staged values and scales (as vLLM's
``process_weights_after_loading`` runs after a load) into spare tensors, and ``commit`` swaps them in with the
staged FP8 under the generation lock; the copies they replace become the next sync's spares (``keep_spare``), so a
sync allocates compute copies only the first time; the float32 temporaries of the dequantization live in one
cache-sized work buffer (``quantize.Dequantizer``) reused by every sync.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from protocols.params import ParamMeta
from sync_service.dtypes import wire_dtype
from sync_service.fp8 import scale_name
from sync_service.merge.quantize import Dequantizer

__all__ = ["Fp8Served", "load_fp8_model"]


def load_fp8_model(path: str | Path, load) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """``(model dequantized by transformers, {FP8 values and scales in hf-fused naming})`` of a block-FP8
    checkpoint; ``load(path, quantization_config=...)`` loads the model (``hf.load_causal_lm``)."""
    from transformers import FineGrainedFP8Config

    from sync_service.merge.fp8_checkpoint import read_fp8_checkpoint

    tensors, block = read_fp8_checkpoint(path)
    fmt = "ue8m0" if any(t.dtype == torch.float8_e8m0fnu for t in tensors.values()) else "float"
    model = load(path, quantization_config=FineGrainedFP8Config(weight_block_size=list(block), scale_fmt=fmt,
                                                                 dequantize=True))
    params = dict(model.named_parameters())
    fp8 = {n: t for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn and n in params}
    return model, {**fp8, **{scale_name(n): tensors[scale_name(n)] for n in fp8}}


class Fp8Served:
    """The FP8 part of an engine's served state.

    Args:
        tensors: FP8 values and their scales, hf-fused names (``load_fp8_model``); the engine owns them.
        params: the model's parameters (the dequantized copies are written into ``params[name].data``).
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]):
        self.tensors = dict(tensors)
        self.values = [n for n, t in self.tensors.items() if t.dtype == torch.float8_e4m3fn]
        self._spare: dict[str, torch.Tensor] = {}
        for n in self.values:
            if n not in params or tuple(params[n].shape) != tuple(self.tensors[n].shape):
                raise ValueError(f"FP8 tensor {n} {list(self.tensors[n].shape)} is not a parameter of the model "
                                 f"of that shape; load model and FP8 tensors from one checkpoint")
        self._params = params
        self._dequantize = Dequantizer()  # its float32 work buffer is reused by every sync

    def metas(self, name: str, param: torch.Tensor) -> list[ParamMeta]:
        """The table rows of parameter ``name``: FP8 values + scales, or the parameter as it is."""
        if name not in self.tensors:
            return [ParamMeta(name=name, dtype=wire_dtype(param.dtype), shape=tuple(param.shape))]
        return [ParamMeta(name=n, dtype=wire_dtype(self.tensors[n].dtype), shape=tuple(self.tensors[n].shape))
                for n in (name, scale_name(name))]

    def dequantized(self, staged: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Parameter name → its next compute tensor for each FP8 tensor whose values or scales are ``staged``
        (the other half from the served state), in the parameter's dtype: a spare (``keep_spare``) or, the first
        time, a new tensor. Takes no lock; the caller swaps them in (``commit``) or drops them (``abort``)."""
        out = {}
        for n in self.values:
            s = scale_name(n)
            if n in staged or s in staged:
                param = self._params[n]
                spare = self._spare.pop(n, None)
                if spare is None or spare.shape != param.shape or spare.dtype != param.dtype or spare.device != param.device:
                    spare = None
                out[n] = self._dequantize(staged.get(n, self.tensors[n]), staged.get(s, self.tensors[s]),
                                          param.dtype, out=spare)
        return out

    def keep_spare(self, name: str, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` (the compute copy a commit replaced, or one an abort dropped) for the next sync of
        ``name``; nothing may read it afterwards."""
        if tensor.is_contiguous():
            self._spare[name] = tensor
