"""What an engine serves, read back: per-tensor digests (and bytes, for small models).

``RolloutEndpoint.served_weights(names, values)`` answers a ``ServedWeights``: one ``TensorDigest``
per served tensor, computed on the engine over exactly the bytes it serves — the tensor in its served
dtype, C order, native (little-endian) byte order — with xxh3_64 (https://xxhash.com; the checksum the
buckets carry). Two engines, or an engine and a reference checkpoint cast to the engine's dtype, serve
the same tensor iff the digests are equal (up to a 64-bit hash collision). Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SOURCES", "ServedWeights", "TensorDigest"]

SOURCES = ("served", "checkpoint-copy", "unreadable")
"""Where a ``TensorDigest``'s bytes come from: ``served`` — the tensor the engine computes with, as it holds it
after its own post-load processing (its own name); ``checkpoint-copy`` — the engine keeps that tensor opaque (a
vLLM CPU build's oneDNN-packed dense weights, prepacked ``w13``/``w2``), so the digest is of the committed
checkpoint-format copy it was built from (checkpoint name, engine dtype); ``unreadable`` — an opaque tensor with
no copy to read (``xxh3_64`` is ``""``; named, never skipped)."""


@dataclass(frozen=True, slots=True)
class TensorDigest:
    """One served tensor.

    Attributes:
        name: the tensor, in the trainers' (hf-fused) naming. dtype: its wire dtype name ("bfloat16").
        shape: its shape. xxh3_64: 16 lowercase hex digits of xxh3_64 over its served bytes.
        values: those bytes (``numel * itemsize``), when asked for (``values=True``), else ``None``.
        source: one of ``SOURCES`` (``"served"`` for engines that serve their table's tensors as held).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    xxh3_64: str
    values: bytes | None = None
    source: str = "served"


@dataclass(frozen=True, slots=True)
class ServedWeights:
    """One engine's served tensors of one committed ``version`` (``None``: the checkpoint it started from),
    read together (no commit in between)."""

    engine: str
    version: int | None
    tensors: tuple[TensorDigest, ...]

    def digests(self) -> dict[str, dict]:
        """``{name: {"dtype", "shape", "xxh3_64", "source"}}`` (JSON-ready, sorted by name)."""
        return {t.name: {"dtype": t.dtype, "shape": list(t.shape), "xxh3_64": t.xxh3_64, "source": t.source}
                for t in sorted(self.tensors, key=lambda t: t.name)}
