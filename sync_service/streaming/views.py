"""Typed tensor views into a flat uint8 bucket buffer (no copy).

bf16 / float8 have no numpy dtype: a ``torch.uint8`` view is re-viewed with ``.view(dtype)``
(entries start at 64-byte aligned offsets, so every dtype view is aligned).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from protocols.params import box_shape
from protocols.wire import PlanEntry

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32,
    "int64": torch.int64, "bool": torch.bool,
}
WIRE_DTYPES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}


def as_byte_tensor(buf) -> torch.Tensor:
    """A 1-D ``torch.uint8`` tensor sharing memory with ``buf`` (numpy array or buffer).

    Read-only buffers (Ray's zero-copy numpy arrays) are viewed as well; callers never write
    through such a view.
    """
    if isinstance(buf, torch.Tensor):
        return buf
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if arr.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array": we only read it
        return torch.from_numpy(arr.reshape(-1).view(np.uint8))


def entry_view(buf_u8: torch.Tensor, entry: PlanEntry) -> torch.Tensor:
    """The entry's box as a tensor of its dtype and box shape, viewing ``buf_u8`` (no copy)."""
    raw = buf_u8[entry.offset:entry.offset + entry.nbytes]
    return raw.view(TORCH_DTYPES[entry.dtype]).view(box_shape(entry.box))
