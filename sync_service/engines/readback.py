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

__all__ = ["chosen", "digest_row", "served_from_rows", "served_weights", "tensor_bytes", "tensor_digest"]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's served bytes (dtype as held, C order) as a flat uint8 view (copies only when not
    contiguous, or off the CPU)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return memoryview(flat.numpy())


def tensor_digest(tensor: torch.Tensor) -> str:
    """16 hex digits of xxh3_64 over ``tensor_bytes(tensor)``."""
    return xxhash.xxh3_64_hexdigest(tensor_bytes(tensor))


def chosen(held: Mapping[str, object], names: Sequence[str] | None, who: str, hint: str) -> list[str]:
    """The names to read back: every key of ``held`` in its order (``names`` ``None``), else ``names`` (each once).

    Raises:
        KeyError: a name of ``names`` is not in ``held``: ``"{who}: not served here: [...] (N in all); {hint}"``.
    """
    picked = list(held) if names is None else list(dict.fromkeys(names))
    missing = [n for n in picked if n not in held]
    if missing:
        raise KeyError(f"{who}: not served here: {missing[:5]} ({len(missing)} in all); {hint}")
    return picked


def digest_row(name: str, tensor: torch.Tensor | None, source: str, values: bool = False) -> list:
    """``[name, wire dtype, shape, xxh3_64, source, bytes | None]`` of one served tensor (``None``: unreadable, the
    row carries only the name and the source); the rows ``served_from_rows`` reads."""
    if tensor is None:
        return [name, "", [], "", source, None]
    raw = tensor_bytes(tensor)
    return [name, wire_dtype(tensor.dtype), list(tensor.shape), xxhash.xxh3_64_hexdigest(raw), source,
            bytes(raw) if values else None]


def served_weights(engine: str, version: int | None, tensors: Mapping[str, torch.Tensor],
                   names: Sequence[str] | None = None, values: bool = False) -> ServedWeights:
    """``ServedWeights`` of ``tensors`` (name → served tensor of one version), ``names`` only when given.

    Raises:
        KeyError: a name of ``names`` is not among ``tensors`` (the missing ones are named).
    """
    picked = chosen(tensors, names, f"{engine}: served_weights", "names come from param_metas()")
    return served_from_rows(engine, version, [digest_row(n, tensors[n], "served", values) for n in picked])


def served_from_rows(engine: str, version: int | None, rows: Sequence[Sequence]) -> ServedWeights:
    """``ServedWeights`` of rows ``[name, dtype, shape, xxh3_64, source, bytes | None]`` computed where the weights
    live (a vLLM worker: ``engines.vllm.served.served_rows``)."""
    return ServedWeights(engine=engine, version=version, tensors=tuple(
        TensorDigest(name=str(n), dtype=str(d), shape=tuple(int(x) for x in s), xxh3_64=str(h),
                     values=None if v is None else bytes(v), source=str(src)) for n, d, s, h, src, v in rows))
