"""The trainer ranks' boxes of every tensor tile it exactly — what ranks that agree on their mesh produce.

Each trainer rank lists the global boxes it sends (``TrainerEndpoint.owned_metas``): under any mesh (EP × TP,
FSDP2 / HSDP DTensors, expert ranges) the ranks' boxes of one tensor cover it once, with no gap and no
overlap, and every rank gives the tensor the same whole shape. Ranks started with different meshes (rank 0
``ShardSpec(ep=2)``, rank 1 ``ShardSpec(ep=1, tp=2)``) overlap or leave gaps; checked here, from the metas alone,
before any engine is compared with the plan (whose refusal would otherwise blame the engine's model).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

from protocols.params import Box, ParamMeta, box_numel

__all__ = ["TrainerMeshError", "check_tiling"]

PAIRWISE_MAX = 64
"""Most boxes of one tensor checked pair by pair for overlaps (more: the element count alone decides)."""

_FIX = ("the trainer ranks disagree on the mesh (each rank's ep × tp, expert range or world size); start every rank "
        "with the same mesh (e.g. load_rank(..., ShardSpec(rank=r, ep=E, tp=T)) with one E and T for all ranks)")


class TrainerMeshError(ValueError):
    """The trainer ranks' boxes of a tensor do not tile it (overlap, gap, or different whole shapes); nothing
    was sent. Attributes: ``name`` (the tensor), ``ranks`` (the trainer ranks named)."""

    def __init__(self, name: str, ranks: Sequence[int], why: str):
        super().__init__(f"trainer ranks' boxes of {name} do not tile it: {why}; {_FIX}")
        self.name, self.ranks = name, tuple(ranks)


def _overlap(a: Box, b: Box) -> bool:
    return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b))


def check_tiling(owned: Sequence[Sequence[ParamMeta]]) -> None:
    """``owned[rank]``: each trainer rank's boxes (``owned_metas``). Every tensor's boxes, over all ranks, have one
    whole shape and cover it exactly once.

    Raises:
        TrainerMeshError: naming the tensor, the ranks and what disagrees (shapes, two overlapping boxes, or the
            elements covered of the whole).
    """
    held: dict[str, list[tuple[int, ParamMeta]]] = defaultdict(list)
    for rank, metas in enumerate(owned):
        for m in metas:
            held[m.name].append((rank, m))
    for name, boxes in held.items():
        shapes: dict[tuple[int, ...], int] = {}
        for rank, m in boxes:
            shapes.setdefault(tuple(m.shape), rank)
        if len(shapes) > 1:
            (s0, r0), (s1, r1) = list(shapes.items())[:2]
            raise TrainerMeshError(name, (r0, r1), f"rank {r0} holds it as {list(s0)}, rank {r1} as {list(s1)}")
        if len(boxes) <= PAIRWISE_MAX:
            for i, (ra, a) in enumerate(boxes):
                for rb, b in boxes[i + 1:]:
                    if _overlap(a.covered_box(), b.covered_box()):
                        raise TrainerMeshError(name, (ra, rb), f"rank {ra}'s box {list(a.covered_box())} and rank "
                                                               f"{rb}'s {list(b.covered_box())} overlap")
        covered, whole = sum(box_numel(m.covered_box()) for _, m in boxes), math.prod(next(iter(shapes)))
        if covered != whole:
            ranks = sorted({r for r, _ in boxes})
            raise TrainerMeshError(name, ranks, f"ranks {ranks} cover {covered} of its {whole} elements "
                                                f"{list(next(iter(shapes)))}")
