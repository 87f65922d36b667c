"""A deterministic stand-in for an optimizer step on LoRA factors (demo, tests, benchmarks).

``step_delta(key, full_shape, step, scale)`` is defined on the *full* factor, so a sharded trainer
(which applies its slice, ``local_factors``) and a reference replaying the steps on the full
adapter agree bit for bit.
"""

from __future__ import annotations

import zlib

import torch

__all__ = ["step_delta"]


def step_delta(key: str, full_shape: tuple[int, ...], step: int, scale: float) -> torch.Tensor:
    """fp32 ``scale · N(0, 1)`` of ``full_shape``, seeded by (crc32(key), step)."""
    gen = torch.Generator().manual_seed((zlib.crc32(key.encode()) << 20) ^ step)
    return torch.randn(tuple(full_shape), generator=gen) * scale
