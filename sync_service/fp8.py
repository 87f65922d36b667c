"""Block FP8 in parameter tables: the one naming and block rule trainers, planning and engines share.

An engine that serves a tensor ``X`` in block FP8 lists two entries in its table (hf-fused naming, as
transformers holds ``FP8Linear`` / ``FP8Experts`` in memory, ``integrations/finegrained_fp8.py``):

- ``X`` as ``float8_e4m3fn`` in ``X``'s shape ``[.., N, K]``;
- its scales ``scale_name(X)`` (``X.weight`` → ``X.weight_scale_inv``; any other name, a fused expert
  parameter ``experts.gate_up_proj`` → ``experts.gate_up_proj_scale_inv``) ``[.., N/bm, K/bn]`` in a dtype of
  ``SCALE_WIRES``: ``float32`` (``scale_fmt="float"``) or ``float8_e8m0fnu`` (``"ue8m0"``: one power of two per
  byte, DeepSeek-V3.1 / V4 style); dequantized value = fp8 × scale per ``[bm, bn]`` block.

The block is read from the two shapes (``table_blocks``), the scale format from the scales' dtype
(``table_scale_dtypes``): nothing else needs to travel; the trainer quantizes with the rounding of that format. A box of ``X`` is
sent as FP8 only when its last two dims start and stop on block edges (``box_aligned``); its scales are the
box ``scale_box(box, block)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from protocols.params import Box, ParamMeta

__all__ = ["FP8_WIRE", "SCALE_WIRES", "box_aligned", "scale_box", "scale_meta", "scale_name", "table_blocks",
           "table_scale_dtypes"]

FP8_WIRE = "float8_e4m3fn"
"""Wire dtype of block-FP8 values."""
SCALE_WIRES: dict[str, str] = {"float32": "float", "float8_e8m0fnu": "ue8m0"}
"""Wire dtype of their scales → the ``FineGrainedFP8Config.scale_fmt`` whose rounding writes it
(``merge.quantize.quantize_blocks``, transformers' ``Fp8Quantize``)."""


def scale_name(name: str) -> str:
    """transformers' name of the scales of ``name`` (``Fp8Quantize``, ``FP8Linear``, ``FP8Experts``)."""
    return name.rsplit(".", 1)[0] + ".weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"


def box_aligned(box: Sequence[tuple[int, int]], block: tuple[int, int]) -> bool:
    """Whether ``box`` starts and stops on block edges in its last two dims (leading dims: anywhere)."""
    return len(box) >= 2 and all(a % b == 0 and c % b == 0 for (a, c), b in zip(box[-2:], block))


def scale_box(box: Box, block: tuple[int, int]) -> Box:
    """The scales' box of an aligned ``box`` of the values: last two dims divided by the block."""
    (r0, r1), (c0, c1) = box[-2:]
    return (*box[:-2], (r0 // block[0], r1 // block[0]), (c0 // block[1], c1 // block[1]))


def scale_meta(meta: ParamMeta, block: tuple[int, int], dtype: str = "float32") -> ParamMeta:
    """The scales' ``ParamMeta`` of the values' ``meta`` (whole tensor or an aligned box), in wire ``dtype``
    (a key of ``SCALE_WIRES``: the engine's, ``table_scale_dtypes``)."""
    shape = (*meta.shape[:-2], meta.shape[-2] // block[0], meta.shape[-1] // block[1])
    box = None if meta.box is None else scale_box(meta.box, block)
    return ParamMeta(scale_name(meta.name), dtype, shape, box)


def table_blocks(table: Iterable[ParamMeta]) -> dict[str, tuple[int, int]]:
    """FP8 value name → its block ``(bm, bn)``, for every ``float8_e4m3fn`` entry of an engine's table whose
    scales are listed beside it (``scale_name``, a dtype of ``SCALE_WIRES``, the block grid of its shape).

    Raises:
        ValueError: an FP8 entry without its scales, or scales whose dtype is not a scale dtype or whose shape
            is not a block grid of the values'.
    """
    return {n: block for n, (block, _) in _table_fp8(table).items()}


def table_scale_dtypes(table: Iterable[ParamMeta]) -> dict[str, str]:
    """FP8 value name → the wire dtype of its scales (a key of ``SCALE_WIRES``), for the same entries as
    ``table_blocks`` (raises what it raises)."""
    return {n: dtype for n, (_, dtype) in _table_fp8(table).items()}


def _table_fp8(table: Iterable[ParamMeta]) -> dict[str, tuple[tuple[int, int], str]]:
    """FP8 value name → (block, scales' wire dtype); raises what ``table_blocks`` raises."""
    metas = {m.name: m for m in table}
    out = {}
    for m in metas.values():
        if m.dtype != FP8_WIRE:
            continue
        s = metas.get(scale_name(m.name))
        if s is None or s.dtype not in SCALE_WIRES or len(s.shape) != len(m.shape) or len(m.shape) < 2 \
                or s.shape[:-2] != m.shape[:-2] or any(n % g or not g for n, g in zip(m.shape[-2:], s.shape[-2:])):
            raise ValueError(f"{m.name} is {FP8_WIRE}{list(m.shape)}; an engine serving block FP8 lists its scales "
                             f"{scale_name(m.name)} as {' or '.join(SCALE_WIRES)}[.., N/bm, K/bn] beside it, got "
                             f"{None if s is None else f'{s.dtype}{list(s.shape)}'}")
        out[m.name] = ((m.shape[-2] // s.shape[-2], m.shape[-1] // s.shape[-1]), s.dtype)
    return out
