"""The global box a rank holds of a ``DTensor``, read from the tensor's own placements and mesh.

Any mesh (1-, 2-, 3-D, or a sub-mesh such as FSDP2's data-parallel mesh beside a TP mesh) and any of
``Shard(d)`` (any dim), ``Replicate()`` and ``_StridedShard`` (what FSDP2 over TP gives a TP-sharded
parameter) per mesh axis. The box is torch's own arithmetic, the one DCP saves by:
``compute_local_shape_and_global_offset(global_shape, mesh, placements)`` → (local shape, global
offset) of this rank. For ``_StridedShard`` torch tracks each rank's global indices per dim and returns
the first one, so the box is the rank's data exactly when those indices are contiguous:
``check_contiguous`` proves it from the boxes of every mesh coordinate (distinct per-dim intervals
that tile the dim can only come from contiguous index sets) and refuses the tensor by name otherwise.

Who sends a box (every element produced by exactly one rank): the ranks of the copy of the mesh holding
the lowest rank of weightsync's group (a sub-mesh has one copy per value of the other axes, each holding
the same values); the replicas along ``Replicate`` axes split their common box by rows (``sent_box``). ``Partial`` (a
pending sum, no value of the tensor) and any other placement are refused by name.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from protocols.params import Box

__all__ = ["check_contiguous", "dtensor_box", "group_ranks", "sent_box"]


def group_ranks(group, world: int) -> list[int]:
    """The global ranks of weightsync's ``group`` in group order (``range(world)`` without a group)."""
    if group is None:
        return list(range(world))
    import torch.distributed as dist

    return list(dist.get_process_group_ranks(group))


def _kinds():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return Shard, _StridedShard, Replicate


def _describe(dt) -> str:
    mesh = dt.device_mesh
    return f"placed {tuple(dt.placements)} on a {mesh.ndim}-D mesh {tuple(mesh.shape)}"


def _check_placements(name: str, dt) -> None:
    """Raises ValueError naming a placement that is not Shard / _StridedShard / Replicate."""
    shard, strided, replicate = _kinds()
    for axis, p in enumerate(dt.placements):
        if isinstance(p, (shard, strided, replicate)):
            continue
        fix = ("a Partial placement is a pending sum, not the tensor's values: redistribute it "
               "(dt.redistribute(mesh, [Replicate() or Shard(d)])) before attach_trainer")
        if not getattr(p, "is_partial", lambda: False)():
            fix = "place it with Shard(d), Replicate() or FSDP2 / parallelize_module, or gather it to a plain tensor"
        raise ValueError(f"attach_trainer: {name} is a DTensor {_describe(dt)}; mesh axis {axis} has {p!r}, which the "
                         f"endpoint cannot read — {fix}")


def check_contiguous(name: str, shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence) -> None:
    """Every rank's ``_StridedShard`` indices are contiguous, so its (offset, local shape) box is its data.

    Per tensor dim, the distinct intervals ``[offset, offset + size)`` over every mesh coordinate must
    tile ``[0, n)``; the index sets they stand for partition the dim, so tiling proves each contiguous.

    Raises:
        ValueError: a rank's indices are strided (named, with the placements and the fix).
    """
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    spans: list[set[tuple[int, int]]] = [set() for _ in shape]
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
        if all(local):
            for d, (a, n) in enumerate(zip(offset, local)):
                spans[d].add((a, a + n))
    for d, n in enumerate(shape):
        end = 0
        for a, b in sorted(spans[d]):
            if a != end:
                break
            end = b
        if spans[d] and (end != n or len({a for a, _ in spans[d]}) != len(spans[d])):
            raise ValueError(f"attach_trainer: {name} is a DTensor placed {tuple(placements)} on a mesh "
                             f"{tuple(mesh_shape)}: the _StridedShard leaves a rank strided (not contiguous) rows of "
                             f"dim {d}, which no (offset, shape) box describes — shard the strided dim on the mesh "
                             f"axis before the other one (FSDP2's fully_shard over a TP mesh does), or gather it")


def dtensor_box(name: str, dt, ranks: Sequence[int]) -> Box | None:
    """The global box this rank holds of DTensor ``dt`` (``()`` for a 0-dim tensor), ``None`` if empty.

    Args:
        ranks: the global ranks of weightsync's group; the mesh's ranks must be among them.

    Raises:
        ValueError: a Partial or unknown placement, strided rows, a mesh outside the group (named, with the fix).
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _check_placements(name, dt)
    mesh = dt.device_mesh
    mesh_ranks = mesh.mesh.flatten().tolist()
    if not set(mesh_ranks) <= set(ranks):
        raise ValueError(f"attach_trainer: {name} is a DTensor {_describe(dt)} over ranks {mesh_ranks}, but weightsync's "
                         f"group holds {list(ranks)}; pass group= a process group holding every rank of the job")
    if any(isinstance(p, _kinds()[1]) for p in dt.placements):
        check_contiguous(name, tuple(dt.shape), tuple(mesh.shape), tuple(dt.placements))
    local, offset = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
    if tuple(dt.to_local().shape) != tuple(local):
        raise ValueError(f"attach_trainer: {name} holds a local shape {tuple(dt.to_local().shape)} but its placements "
                         f"{tuple(dt.placements)} give {tuple(local)}; the DTensor's local tensor disagrees with its spec")
    if not all(local):
        return None
    return tuple((a, a + n) for a, n in zip(offset, local))


def sent_box(dt, box: Box | None, ranks: Sequence[int]) -> Box | None:
    """The part of this rank's ``box`` of ``dt`` it sends (``None``: nothing), so that every element is sent
    by exactly one rank of weightsync's group (``ranks``: its global ranks).

    Only the copy of the mesh holding the lowest rank of the group sends. Along the ``Replicate`` axes
    the R ranks holding the same box split it by rows (dim 0 of the box, ``torch.chunk`` sizes, replica
    j = this rank's row-major index over those axes), so each replica merges a part and every rank has
    something to send; a 0-dim tensor is sent by replica 0.
    """
    replicate = _kinds()[2]
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if box is None or coord is None or min(ranks) not in mesh.mesh.flatten().tolist():
        return None
    j, count = 0, 1
    for c, n, p in zip(coord, mesh.shape, dt.placements):
        if isinstance(p, replicate):
            j, count = j * n + c, count * n
    if not box:
        return box if j == 0 else None
    (a, b), rest = box[0], box[1:]
    size = -(-(b - a) // count)
    lo, hi = min(a + j * size, b), min(a + (j + 1) * size, b)
    return ((lo, hi), *rest) if hi > lo else None
