"""A ``ShardedBase`` over a live model's base parameters: views of the training storage, no copy.

Which global boxes a rank holds and produces (every element is produced by exactly one rank):

- ``DTensor`` ``(Shard(0),)`` on a 1-D mesh (FSDP2 ``fully_shard``): the rows it holds, from the
  DTensor's own placement arithmetic (``compute_local_shape_and_global_offset``, as DCP uses);
- a fused expert tensor ``[E_local, ...]`` of an expert-parallel rank (``expert_range=(e0, e1)``):
  global experts ``[e0, e1)`` of the ``[E, ...]`` tensor;
- any other plain tensor is replicated (one process, DDP, the non-expert part under EP): rank k of
  W produces rows chunk k of dim 0 (``torch.chunk`` sizes, possibly empty), so the merge work is
  spread over the ranks; a 0-dim tensor is produced by rank 0.

The base is frozen under LoRA training, so reading it at send time reads the snapshot's values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocols.params import ParamMeta
from sync_service.dtypes import wire_dtype
from sync_service.merge.layouts import expert_names
from sync_service.sharding.base import LocalShard, ShardedBase
from sync_service.sharding.rules import Piece

__all__ = ["ExpertBlock", "chunk_rows", "live_base"]


@dataclass(frozen=True, slots=True)
class ExpertBlock:
    """The global experts ``[start, stop)`` an expert-parallel rank's module holds, of ``num_experts``."""

    start: int
    stop: int
    num_experts: int


def chunk_rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rows ``[a, b)`` of ``n`` that chunk ``rank`` of ``world`` covers (``torch.chunk`` sizes, as FSDP2)."""
    size = -(-n // world) if n else 0
    return min(rank * size, n), min((rank + 1) * size, n)


def _whole(shape: tuple[int, ...], rows: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    return (rows,) + tuple((0, n) for n in shape[1:])


def _dtensor_shard(name: str, dt) -> LocalShard:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if dt.device_mesh.ndim != 1 or tuple(dt.placements) != (Shard(0),):
        raise ValueError(f"attach_trainer: {name} is a DTensor placed {tuple(dt.placements)} on a "
                         f"{dt.device_mesh.ndim}-D mesh; the endpoint reads (Shard(0),) on a 1-D mesh (FSDP2 "
                         f"fully_shard) — shard with fully_shard, or gather it to a plain tensor")
    shape = tuple(dt.shape)
    local_shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    meta = ParamMeta(name=name, dtype=wire_dtype(dt.dtype), shape=shape)
    pieces: tuple[Piece, ...] = ()
    if shape and local_shape[0] > 0:
        rows = local_shape[0]
        pieces = (Piece(global_box=_whole(shape, (offset[0], offset[0] + rows)), local_box=_whole(shape, (0, rows))),)
    elif not shape and dt.device_mesh.get_local_rank() == 0:
        pieces = (Piece(global_box=(), local_box=()),)
    return LocalShard(meta=meta, local=dt.to_local().detach(), pieces=pieces, owned=True)


def _expert_shard(name: str, t: torch.Tensor, block: ExpertBlock) -> LocalShard:
    if t.shape[0] != block.stop - block.start:
        raise ValueError(f"attach_trainer: {name} holds {t.shape[0]} experts but expert_range=({block.start}, "
                         f"{block.stop}) says {block.stop - block.start}; pass this rank's global expert range")
    shape = (block.num_experts, *t.shape[1:])
    meta = ParamMeta(name=name, dtype=wire_dtype(t.dtype), shape=shape)
    piece = Piece(global_box=_whole(shape, (block.start, block.stop)), local_box=_whole(shape, (0, t.shape[0])))
    return LocalShard(meta=meta, local=t.detach(), pieces=(piece,), owned=True)


def _replicated_shard(name: str, t: torch.Tensor, rank: int, world: int) -> LocalShard:
    shape = tuple(t.shape)
    meta = ParamMeta(name=name, dtype=wire_dtype(t.dtype), shape=shape)
    if not shape:
        pieces = (Piece(global_box=(), local_box=()),) if rank == 0 else ()
    else:
        rows = chunk_rows(shape[0], world, rank)
        pieces = (Piece(global_box=_whole(shape, rows), local_box=_whole(shape, rows)),) if rows[1] > rows[0] else ()
    return LocalShard(meta=meta, local=t.detach(), pieces=pieces, owned=True)


def live_base(params, *, layout, tied_aliases, rank: int, world: int, experts: ExpertBlock | None) -> ShardedBase:
    """A ShardedBase over ``params`` (hf-fused name → ``LiveParam``, in layer order), views only.

    Raises:
        ValueError: a DTensor placed other than ``(Shard(0),)`` on a 1-D mesh (named, with the fix); an
            expert tensor whose expert count disagrees with ``experts``.
    """
    shards = {}
    for name, p in params.items():
        if p.sharded:
            shards[name] = _dtensor_shard(name, p.param)
        elif experts is not None and expert_names().fused.search(name):
            shards[name] = _expert_shard(name, p.local(), experts)
        else:
            shards[name] = _replicated_shard(name, p.local(), rank, world)
    return ShardedBase(shards, layout=layout, tied_aliases=tied_aliases)
