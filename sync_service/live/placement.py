"""The global boxes a rank holds of a ``DTensor``, read from the tensor's own placements and mesh.

Any mesh (1-, 2-, 3-D, or a sub-mesh such as FSDP2's data-parallel mesh beside a TP or EP mesh) and any
of ``Shard(d)`` (any dim), ``Replicate()`` and ``_StridedShard`` (what FSDP2 over TP / EP gives a sharded
parameter; PEFT's expert ``lora_B`` on an ep axis) per mesh axis. The indices are torch's own arithmetic,
the walk DCP's ``compute_local_shape_and_global_offset`` makes (``dim_indices``): per tensor dim, the
global indices this rank holds, in local order. Consecutive runs of them make boxes (``index_pieces``):
one box when every dim is contiguous (Shard, FSDP2 over TP), several when a ``_StridedShard`` leaves a
rank strided indices (each a ``Piece``: global box + where it sits in the local tensor).

Who sends a box (every element produced by exactly one rank): the ranks of the copy of the mesh holding
the lowest rank of weightsync's group (a sub-mesh has one copy per value of the other axes, each holding
the same values); the replicas along ``Replicate`` axes split their common boxes by rows (``sent_pieces``).
``Partial`` (a pending sum, no value of the tensor) and any other placement are refused by name.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from sync_service.sharding.rules import Piece

__all__ = ["dim_indices", "dtensor_pieces", "group_ranks", "index_pieces", "sent_pieces"]


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


def dim_indices(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
                placements: Sequence) -> list[list[int]]:
    """Per tensor dim, the global indices mesh coordinate ``coord`` holds, in local order.

    torch's own walk (``_compute_local_shape_and_global_offset``, which keeps only the first index):
    the placements shard left to right, each ``Shard`` / ``_StridedShard`` picking this coordinate's
    indices of the ones the placements before it left (``_get_shard_size_and_offsets``).
    """
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets

    shard, strided, _ = _kinds()
    local, held = list(shape), {}
    for axis, p in enumerate(placements):
        if isinstance(p, (shard, strided)):
            size, index = _get_shard_size_and_offsets(local[p.dim], mesh_shape[axis], coord[axis], p, held.get(p.dim),
                                                      shape[p.dim], False)
            local[p.dim], held[p.dim] = size, index
    return [held[d].tolist()[:local[d]] if d in held else list(range(n)) for d, n in enumerate(shape)]


def _runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive indices: (global start, global stop, local start)."""
    runs: list[tuple[int, int, int]] = []
    for i, g in enumerate(indices):
        if runs and runs[-1][1] == g:
            runs[-1] = (runs[-1][0], g + 1, runs[-1][2])
        else:
            runs.append((g, g + 1, i))
    return runs


def index_pieces(indices: list[list[int]]) -> tuple[Piece, ...]:
    """The boxes a rank's per-dim global indices (``dim_indices``) make: one ``Piece`` per product of
    per-dim runs of consecutive indices (one piece when every dim is contiguous; none when empty)."""
    per_dim = [_runs(ix) for ix in indices]
    pieces = []
    for combo in itertools.product(*per_dim):
        pieces.append(Piece(global_box=tuple((a, b) for a, b, _ in combo),
                            local_box=tuple((c, c + b - a) for a, b, c in combo)))
    return tuple(pieces)


def dtensor_pieces(name: str, dt, ranks: Sequence[int]) -> tuple[Piece, ...]:
    """The global boxes this rank holds of DTensor ``dt`` and where each sits in its local tensor (one
    piece, ``((), ())``, for a 0-dim tensor; none if it holds nothing). ``_StridedShard`` indices that are
    not contiguous give several pieces (PEFT's expert ``lora_B`` [out, r·E] on an ep axis: r runs).

    Args:
        ranks: the global ranks of weightsync's group; the mesh's ranks must be among them.

    Raises:
        ValueError: a Partial or unknown placement, a mesh outside the group (named, with the fix).
    """
    _check_placements(name, dt)
    mesh = dt.device_mesh
    mesh_ranks = mesh.mesh.flatten().tolist()
    if not set(mesh_ranks) <= set(ranks):
        raise ValueError(f"attach_trainer: {name} is a DTensor {_describe(dt)} over ranks {mesh_ranks}, but weightsync's "
                         f"group holds {list(ranks)}; pass group= a process group holding every rank of the job")
    coord = mesh.get_coordinate()
    if coord is None:
        return ()
    indices = dim_indices(tuple(dt.shape), tuple(mesh.shape), coord, tuple(dt.placements))
    if tuple(dt.to_local().shape) != tuple(len(ix) for ix in indices):
        raise ValueError(f"attach_trainer: {name} holds a local shape {tuple(dt.to_local().shape)} but its placements "
                         f"{tuple(dt.placements)} give {tuple(len(ix) for ix in indices)}; the DTensor's local tensor "
                         f"disagrees with its spec")
    return index_pieces(indices)


def sent_pieces(dt, pieces: Sequence[Piece], ranks: Sequence[int]) -> tuple[Piece, ...]:
    """The parts of this rank's ``pieces`` of ``dt`` it sends, so that every element is sent by exactly one
    rank of weightsync's group (``ranks``: its global ranks).

    Only the copy of the mesh holding the lowest rank of the group sends. Along the ``Replicate`` axes
    the R ranks holding the same pieces split each by rows (dim 0 of its box, ``torch.chunk`` sizes,
    replica j = this rank's row-major index over those axes), so each replica merges a part and every
    rank has something to send; a 0-dim tensor is sent by replica 0.
    """
    replicate = _kinds()[2]
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None or min(ranks) not in mesh.mesh.flatten().tolist():
        return ()
    j, count = 0, 1
    for c, n, p in zip(coord, mesh.shape, dt.placements):
        if isinstance(p, replicate):
            j, count = j * n + c, count * n
    out = []
    for piece in pieces:
        if not piece.global_box:
            out.extend([piece] if j == 0 else [])
            continue
        (a, b), rest = piece.global_box[0], piece.global_box[1:]
        size = -(-(b - a) // count)
        lo, hi = min(a + j * size, b), min(a + (j + 1) * size, b)
        if hi > lo:
            (la, _), lrest = piece.local_box[0], piece.local_box[1:]
            out.append(Piece(global_box=((lo, hi), *rest), local_box=((la + lo - a, la + hi - a), *lrest)))
    return tuple(out)
