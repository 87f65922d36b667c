"""Preallocated, reused bucket buffers (two or more, so filling bucket k+1 overlaps sending k), on the device the
transport wants its bytes on (``transports.devices.bucket_device``)."""

from __future__ import annotations

import queue
from dataclasses import dataclass

import numpy as np
import torch

from sync_service.streaming.views import as_byte_tensor


@dataclass(kw_only=True, slots=True)
class BucketPoolConfig:
    bucket_bytes: int = 256 << 20
    """Capacity of one bucket payload, bytes (the plan's ``bucket_bytes``)."""
    num_buffers: int = 2
    """Buckets in flight: 2 = double buffering; more absorbs jitter at the cost of memory."""
    device: str = "cpu"
    """Where the buffers live: ``"cpu"`` (host arrays, pinned when CUDA is available: ``host_buffer``) or a CUDA
    device (uint8 tensors there, for a transport that sends device buffers: ``torch_dist`` under NCCL)."""


def host_buffer(nbytes: int) -> np.ndarray:
    """A touched 1-D uint8 host array of ``nbytes``: pinned (page-locked) when CUDA is available, so copies
    between it and a device run at full speed; plain host memory otherwise (the same code on a CPU machine)."""
    if not torch.cuda.is_available():
        return np.ones(nbytes, dtype=np.uint8)
    return torch.ones(nbytes, dtype=torch.uint8).pin_memory().numpy()


class BucketPool:
    """``num_buffers`` page-touched uint8 buffers of ``bucket_bytes`` on ``config.device``, allocated once.

    ``acquire`` hands out a free buffer index (blocking, with a timeout); ``release`` returns it.
    ``array(i)`` is the buffer a transport sends (a numpy array on the host, a uint8 tensor on a device),
    ``tensor(i)`` the torch view the bucketer fills (same memory). The buffers are allocated (and their pages touched) on first use, once:
    a ``Sender`` over a transport that lends its own buffers (shm ring slots) never allocates them.
    """

    def __init__(self, config: BucketPoolConfig | None = None, **kw):
        self.config = config or BucketPoolConfig(**kw)
        if self.config.num_buffers < 1 or self.config.bucket_bytes < 1:
            raise ValueError(f"BucketPool needs num_buffers >= 1 and bucket_bytes >= 1, got {self.config}")
        self._arrays: list[np.ndarray] = []
        self._tensors: list[torch.Tensor] = []
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(self.config.num_buffers):
            self._free.put(i)

    @property
    def bucket_bytes(self) -> int:
        return self.config.bucket_bytes

    def acquire(self, timeout_s: float) -> int:
        """Index of a free buffer. Raises TimeoutError if none is released within ``timeout_s``."""
        try:
            return self._free.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            raise TimeoutError(f"no free bucket buffer within {timeout_s:.1f}s (sender stalled)") from None

    def release(self, index: int) -> None:
        self._free.put(index)

    @property
    def nbytes(self) -> int:
        """Bytes the buffers take on ``config.device`` once allocated."""
        return self.config.bucket_bytes * self.config.num_buffers

    def array(self, index: int):
        self._allocate()
        return self._arrays[index]

    def tensor(self, index: int) -> torch.Tensor:
        self._allocate()
        return self._tensors[index]

    def _allocate(self) -> None:
        if not self._arrays:
            size, device = self.config.bucket_bytes, torch.device(self.config.device)
            if device.type == "cpu":
                arrays = [host_buffer(size) for _ in range(self.config.num_buffers)]
            else:
                arrays = [torch.ones(size, dtype=torch.uint8, device=device) for _ in range(self.config.num_buffers)]
            self._tensors = [as_byte_tensor(a) for a in arrays]
            self._arrays = arrays
