"""Parameter metadata shared by trainers, engines and the wire.

A *box* selects a hyper-rectangle of a tensor: one ``(start, stop)`` pair per dimension, in
elements, half-open. A trainer shard owns one or more boxes of an engine tensor (an expert block
under expert parallelism, a ``[gate_shard; up_shard]`` row pair under tensor parallelism, a dim-0
range under FSDP); a bucket entry carries one box (a tensor larger than a bucket is cut into boxes
along its leading dimensions). A box's bytes travel contiguous, in row-major order of the box.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Box = tuple[tuple[int, int], ...]
"""One ``(start, stop)`` per dimension; ``()`` for a 0-d tensor."""

# Wire names of the dtypes weightsync moves, and their element size in bytes.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e8m0fnu": 1,  # block-FP8 scales only (ue8m0: a power of two per byte), never a weight's dtype
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}
FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})
"""Wire names of the floating-point dtypes."""
MERGE_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
"""Wire names a merged tensor or a LoRA factor may have (the dtypes a merge writes)."""


def full_box(shape: tuple[int, ...]) -> Box:
    """The box covering a whole tensor of ``shape``."""
    return tuple((0, n) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    """Shape of the sub-tensor a box selects."""
    return tuple(stop - start for start, stop in box)


def box_numel(box: Box) -> int:
    return math.prod(box_shape(box))


@dataclass(frozen=True, slots=True)
class ParamMeta:
    """One tensor (or one box of it) as a trainer produces it or an engine holds it.

    Attributes:
        name: tensor name in the target naming (e.g. HF ``model.layers.0.mlp.experts.gate_up_proj``).
        dtype: wire dtype name, a key of ``DTYPE_BYTES`` (``"bfloat16"``, ...).
        shape: shape of the *whole* tensor, in elements.
        box: the part this record covers; ``None`` means the whole tensor.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    box: Box | None = None

    def covered_box(self) -> Box:
        return full_box(self.shape) if self.box is None else self.box

    @property
    def nbytes(self) -> int:
        """Bytes of the covered part."""
        return box_numel(self.covered_box()) * DTYPE_BYTES[self.dtype]
