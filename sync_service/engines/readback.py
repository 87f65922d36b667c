"""Read back what an engine serves: ``protocols.readback.ServedWeights`` from its served tensors.

The digest is xxh3_64 over the tensor's bytes in its served dtype (C order; a non-contiguous tensor is
hashed as its contiguous copy), so it is bitwise: equal digests ⇔ equal bytes (up to a collision).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import xxhash

from protocols.readback import ServedWeights, TensorDigest
from sync_service.dtypes import wire_dtype

__all__ = ["served_from_rows", "served_weights", "tensor_bytes", "tensor_digest"]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's served bytes (dtype as held, C order) as a flat uint8 view (copies only when not
    contiguous, or off the CPU)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return memoryview(flat.numpy())


def tensor_digest(tensor: torch.Tensor) -> str:
    """16 hex digits of xxh3_64 over ``tensor_bytes(tensor)``."""
    return xxhash.xxh3_64_hexdigest(tensor_bytes(tensor))


def served_weights(engine: str, version: int | None, tensors: Mapping[str, torch.Tensor],
                   names: Sequence[str] | None = None, values: bool = False) -> ServedWeights:
    """``ServedWeights`` of ``tensors`` (name → served tensor of one version), ``names`` only when given.

    Raises:
        KeyError: a name of ``names`` is not among ``tensors`` (the missing ones are named).
    """
    chosen = list(tensors) if names is None else list(dict.fromkeys(names))
    missing = [n for n in chosen if n not in tensors]
    if missing:
        raise KeyError(f"{engine}: served_weights: not served here: {missing[:5]} ({len(missing)} in all); "
                       f"names come from param_metas()")
    out = []
    for name in chosen:
        t = tensors[name]
        raw = tensor_bytes(t)
        out.append(TensorDigest(name=name, dtype=wire_dtype(t.dtype), shape=tuple(t.shape),
                                xxh3_64=xxhash.xxh3_64_hexdigest(raw), values=bytes(raw) if values else None))
    return ServedWeights(engine=engine, version=version, tensors=tuple(out))


def served_from_rows(engine: str, version: int | None, rows: Sequence[Sequence]) -> ServedWeights:
    """``ServedWeights`` of rows ``[name, dtype, shape, xxh3_64, source, bytes | None]`` computed where the weights
    live (a vLLM worker: ``engines.vllm.served.served_rows``)."""
    return ServedWeights(engine=engine, version=version, tensors=tuple(
        TensorDigest(name=str(n), dtype=str(d), shape=tuple(int(x) for x in s), xxh3_64=str(h),
                     values=None if v is None else bytes(v), source=str(src)) for n, d, s, h, src, v in rows))
