"""The one table between torch dtypes, wire dtype names and safetensors dtype tags.

Wire names are the keys of ``protocols.params.DTYPE_BYTES`` (``"bfloat16"``, ``"float8_e4m3fn"``, ...),
which are also the names of the torch dtypes (``torch.bfloat16``). Every module that turns a tensor's
dtype into a ``ParamMeta.dtype`` or back uses ``wire_dtype`` / ``torch_dtype`` from here.
"""

from __future__ import annotations

import torch

from protocols.params import DTYPE_BYTES, FLOAT_DTYPES, MERGE_DTYPES

__all__ = ["FLOAT_DTYPES", "MERGE_DTYPES", "SAFETENSORS_DTYPES", "TORCH_DTYPES", "WIRE_DTYPES", "torch_dtype",
           "wire_dtype"]

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_BYTES}
"""Wire name → torch dtype."""
WIRE_DTYPES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}
"""torch dtype → wire name."""
SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}
"""safetensors header dtype tag → wire name (the safetensors format's ``dtype`` field)."""


def wire_dtype(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``.

    Raises:
        ValueError: a dtype weightsync does not move (complex, ``uint32``, ...), naming the ones it does.
    """
    try:
        return WIRE_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no wire name; use one of {sorted(TORCH_DTYPES)}") from None


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` → ``torch.bfloat16``.

    Raises:
        ValueError: ``name`` is not a wire dtype name, naming the ones that are.
    """
    try:
        return TORCH_DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"dtype {name!r} is not a wire dtype; use one of {sorted(TORCH_DTYPES)}") from None
