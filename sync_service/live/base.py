"""A ``ShardedBase`` over a live model's base parameters: views of the training storage, no copy.

Which global boxes a rank holds and produces (every element is produced by exactly one rank):

- a ``DTensor`` on any mesh (FSDP2, HSDP, FSDP2 × TP, FSDP2 × EP, TP × EP, ``Shard(d)`` on any dim): the
  boxes it holds, from the DTensor's own placements (``placement.py``: torch's walk, as DCP uses; an
  ep rank holds only its experts); replicas along ``Replicate`` axes split their common boxes by rows
  (``placement.sent_pieces``);
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
from sync_service.live.placement import dtensor_pieces, sent_pieces
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


def _dtensor_shard(name: str, dt, ranks: list[int]) -> LocalShard:
    """The rank's boxes of a DTensor on any mesh (``placement.py``); pieces only where this rank sends them."""
    pieces = sent_pieces(dt, dtensor_pieces(name, dt, ranks), ranks)
    meta = ParamMeta(name=name, dtype=wire_dtype(dt.dtype), shape=tuple(dt.shape))
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


def live_base(params, *, layout, tied_aliases, rank: int, world: int, experts: ExpertBlock | None,
              ranks: list[int] | None = None) -> ShardedBase:
    """A ShardedBase over ``params`` (hf-fused name → ``LiveParam``, in layer order), views only.
    ``ranks``: the global ranks of weightsync's group (default ``range(world)``).

    Raises:
        ValueError: a DTensor ``placement.dtensor_pieces`` refuses (Partial, a mesh outside the group:
            named, with the fix); an expert tensor whose expert count disagrees with ``experts``.
    """
    ranks = list(range(world)) if ranks is None else ranks
    shards = {}
    for name, p in params.items():
        if p.sharded:
            shards[name] = _dtensor_shard(name, p.param, ranks)
        elif experts is not None and expert_names().fused.search(name):
            shards[name] = _expert_shard(name, p.local(), experts)
        else:
            shards[name] = _replicated_shard(name, p.local(), rank, world)
    return ShardedBase(shards, layout=layout, tied_aliases=tied_aliases)
