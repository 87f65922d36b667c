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
from sync_service.dtypes import TORCH_DTYPES



def as_byte_array(buf) -> np.ndarray:
    """A 1-D ``uint8`` numpy array sharing memory with ``buf`` (numpy array, buffer or CPU uint8 tensor)."""
    if isinstance(buf, torch.Tensor):
        return buf.numpy()
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    return arr.reshape(-1).view(np.uint8)


def as_byte_tensor(buf) -> torch.Tensor:
    """A 1-D ``torch.uint8`` tensor sharing memory with ``buf`` (numpy array or buffer).

    Read-only buffers (Ray's zero-copy numpy arrays) are viewed as well; callers never write
    through such a view.
    """
    if isinstance(buf, torch.Tensor):
        return buf
    arr = as_byte_array(buf)
    if arr.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array": we only read it
        return torch.from_numpy(arr)


def entry_view(buf_u8: torch.Tensor, entry: PlanEntry) -> torch.Tensor:
    """The entry's box as a tensor of its dtype and box shape, viewing ``buf_u8`` (no copy)."""
    raw = buf_u8[entry.offset:entry.offset + entry.nbytes]
    return raw.view(TORCH_DTYPES[entry.dtype]).view(box_shape(entry.box))
