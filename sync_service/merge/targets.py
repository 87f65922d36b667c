"""Target namings: how one hf-fused tensor becomes the tensors of a target checkpoint / engine.

A target is a function ``(name, shape, layout) -> list[Piece]`` in ``TARGETS``, keyed by target
name. Each ``Piece`` is one output tensor: a box of the hf-fused tensor, optionally with dim 0
dropped (one expert) and the last two dims transposed.

- ``"hf-fused"``: identity (transformers v5 in-memory names; what the HF engine and trainers hold).
- ``"hf"``: exactly the keys ``save_pretrained`` writes (transformers ``conversion_mapping.py``
  reversed): per-expert ``…experts.N.{gate,up,down}_proj.weight`` [out, in], Mixtral
  ``block_sparse_moe.experts.N.w1/w3/w2.weight``; gpt_oss stays fused.
Engine-native namings (e.g. vLLM ``w13_weight``) register here by adding a row to ``TARGETS``.

The same ``"hf"`` table, read backwards, is how ``SafetensorsBase`` assembles fused tensors from
a per-expert checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from protocols.params import Box, box_shape, full_box
from sync_service.merge.errors import MergeError
from sync_service.merge.layouts import FamilyLayout


@dataclass(frozen=True, slots=True)
class Piece:
    """One target tensor cut from an hf-fused tensor.

    Attributes:
        name: the target tensor's name.
        box: the box of the hf-fused tensor it holds.
        drop_dim0: the box has extent 1 on dim 0 (one expert) and the target drops that dim.
        transpose: the target holds the last two dims swapped.
    """

    name: str
    box: Box
    drop_dim0: bool = False
    transpose: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the target tensor."""
        shape = list(box_shape(self.box))
        if self.drop_dim0:
            shape = shape[1:]
        if self.transpose:
            shape[-2], shape[-1] = shape[-1], shape[-2]
        return tuple(shape)

    def to_target(self, fused_box_values: torch.Tensor) -> torch.Tensor:
        """Values of ``box`` (shape ``box_shape(box)``) → the target tensor (a view)."""
        t = fused_box_values[0] if self.drop_dim0 else fused_box_values
        return t.transpose(-1, -2) if self.transpose else t

    def from_target(self, target_values: torch.Tensor) -> torch.Tensor:
        """A target tensor (or a slice of it) → values laid out as the box (a view)."""
        t = target_values.transpose(-1, -2) if self.transpose else target_values
        return t.unsqueeze(0) if self.drop_dim0 else t


def experts_match(name: str, layout: FamilyLayout) -> tuple[str, str] | None:
    """``(prefix, param)`` if ``name`` is a fused expert parameter (``<prefix>mlp.experts.<param>``)."""
    m = re.fullmatch(rf"(.*\.)?{re.escape(layout.experts_module)}\.([A-Za-z0-9_]+)", name)
    if m is None or m.group(2) not in layout.expert_params:
        return None
    return m.group(1) or "", m.group(2)


def _identity(name: str, shape: tuple[int, ...], layout: FamilyLayout) -> list[Piece]:
    return [Piece(name, full_box(shape))]


def _hf(name: str, shape: tuple[int, ...], layout: FamilyLayout) -> list[Piece]:
    match = experts_match(name, layout)
    if match is None or match[1] not in (layout.gate_up, layout.down):
        return [Piece(layout.to_disk(name), full_box(shape))]
    if layout.disk == "fused":  # "by_shape" families are written in memory orientation, as save_pretrained does
        return [Piece(layout.to_disk(name), full_box(shape), transpose=layout.disk_transpose == "always")]
    prefix, param = match
    if len(shape) != 3:
        raise MergeError(f"{name}: fused expert tensor must be 3D [E, d1, d2], got shape {list(shape)}")
    if layout.gate_up_order != "concat":
        raise MergeError(f"family {layout.family}: per-expert disk naming needs a concatenated gate_up layout")
    num_experts, d1, d2 = shape
    out_dim = 1 if layout.orientation == "out_in" else 2
    experts = layout.to_disk(f"{prefix}{layout.experts_module}")
    slots = ("gate", "up") if param == layout.gate_up else ("down",)
    pieces = []
    for e in range(num_experts):
        for slot in slots:
            start, stop, _ = layout.out_selection(slot, shape[out_dim])
            box = [(e, e + 1), (0, d1), (0, d2)]
            box[out_dim] = (start, stop)
            disk_name = layout.per_expert_names[("gate", "up", "down").index(slot)]
            pieces.append(
                Piece(
                    f"{experts}.{e}.{disk_name}.weight",
                    tuple(box),
                    drop_dim0=True,
                    transpose=layout.orientation == "in_out",
                )
            )
    return pieces


TargetFn = Callable[[str, tuple[int, ...], FamilyLayout], list[Piece]]

TARGETS: dict[str, TargetFn] = {
    "hf-fused": _identity,
    "hf": _hf,
}


def target_pieces(target: str, name: str, shape: tuple[int, ...], layout: FamilyLayout | None) -> list[Piece]:
    """The pieces of hf-fused tensor ``name`` in naming ``target``.

    Raises:
        MergeError: unknown target (lists the known ones), or a layout is needed and missing.
    """
    fn = TARGETS.get(target)
    if fn is None:
        raise MergeError(f"unknown target naming {target!r}; known: {', '.join(sorted(TARGETS))}")
    if fn is _identity:
        return _identity(name, shape, layout)  # type: ignore[arg-type]
    if layout is None:
        raise MergeError(f"target {target!r} needs the model family layout; pass layout=layout_for(config)")
    return fn(name, shape, layout)
