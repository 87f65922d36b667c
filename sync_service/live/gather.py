"""All-gather of DTensor LoRA factors, on any mesh and placement, into full-size buffers allocated once.

A factor is a ``DTensor`` placed on any mesh (FSDP2 ``Shard(0)`` on its rank or out dim, ``Shard(1)``,
HSDP's ``(Replicate, Shard)``, FSDP2 × TP's ``_StridedShard``, a data-parallel sub-mesh beside a TP
mesh; PEFT's expert ``lora_B`` strided on an ep axis). Each rank holds one or more boxes of it
(``placement.dtensor_pieces``: global box + where it sits in the local tensor); the whole factor is
the union of every rank's boxes. A rank merging its own base boxes needs whole factors;
factors are r-thin, so each rank gathers them all — never the base.

``exchange()`` (once, collective, after every rank attached) all-gathers each rank's pieces, checks
that their boxes tile every factor, and allocates the buffers: per dtype one flat send buffer (each
factor a slot of the largest local tensor any rank holds) and a ``[world, n]`` receive buffer. Per
sync, ``gather`` packs this rank's local tensors, runs one ``all_gather`` per dtype on weightsync's
own process group, and copies each distinct box (the first rank holding it; replicas hold the same
values) into the factor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from protocols.params import Box
from sync_service.live.placement import dtensor_pieces, group_ranks
from sync_service.sharding.rules import Piece

__all__ = ["ShardGather"]


@dataclass(frozen=True, slots=True)
class _Part:
    rank: int
    """The first rank (group order) holding ``box``."""
    box: Box
    """Global box of the factor."""
    local_box: Box
    """Where ``box`` sits in that rank's local tensor."""
    local_shape: tuple[int, ...]
    """That rank's local tensor's shape."""


@dataclass(frozen=True, slots=True)
class _Slot:
    key: str
    offset: int
    """Element offset of this factor's slot in its dtype's flat buffer."""
    parts: tuple[_Part, ...]
    """Each distinct global box of the factor, from the first rank holding it (replicas hold the same values)."""


class ShardGather:
    """Gathers the boxes of DTensor factors into whole factors (see the module docstring).

    Args:
        factors: PEFT key → ``LiveParam`` whose param is a DTensor whose mesh's ranks are in ``group``.
        group: weightsync's process group (never the training group's collectives).
        rank, world: this rank's index in ``group`` and the group size.
        timeout_s: bound of each collective.

    Memory (after ``exchange``): the full factors plus a send buffer and a ``[world, n]`` receive buffer
    per dtype (n: the sum of each factor's largest local tensor), reused by every ``gather``.

    Raises:
        ValueError: a placement ``placement.dtensor_pieces`` refuses (named, with the fix).
    """

    def __init__(self, factors: Mapping, *, group, rank: int, world: int, timeout_s: float) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.timeout = timedelta(seconds=timeout_s)
        ranks = group_ranks(group, world)
        self._mine = {key: dtensor_pieces(key, p.param, ranks) for key, p in factors.items()}
        self.device = next((p.local().device for p in factors.values()), torch.device("cpu"))
        """Where every buffer lives: the factors' own device (the group's backend fits it: ``devices.group_backend``)."""
        self.full: dict[str, torch.Tensor] = {k: torch.empty(p.global_shape, dtype=p.param.dtype, device=self.device)
                                              for k, p in factors.items()}
        self._slots: dict[torch.dtype, list[_Slot]] = {}
        self._send: dict[torch.dtype, torch.Tensor] = {}
        self._recv: dict[torch.dtype, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer held (full factors, send and receive buffers)."""
        return sum(t.numel() * t.element_size() for t in (*self.full.values(), *self._send.values(), *self._recv.values()))

    def exchange(self) -> None:
        """All-gather every rank's pieces, plan the slots and allocate the buffers. Collective on ``group``,
        once, on every rank (after attach agreed). Blocks at most ``timeout_s`` per collective (two).

        Raises:
            ValueError: the ranks' boxes of a factor do not tile it (named; the same on every rank).
            RuntimeError: a collective did not complete within ``timeout_s``.
        """
        table = self._all_pieces()
        sizes: dict[torch.dtype, int] = {}
        for key, full in self.full.items():
            parts = _distinct(key, tuple(full.shape), [row[key] for row in table])
            largest = max((_numel(_local_shape(row[key])) for row in table), default=0)
            self._slots.setdefault(full.dtype, []).append(_Slot(key, sizes.get(full.dtype, 0), tuple(parts)))
            sizes[full.dtype] = sizes.get(full.dtype, 0) + largest
        self._send = {d: torch.zeros(n, dtype=d, device=self.device) for d, n in sizes.items()}
        self._recv = {d: torch.empty((self.world, n), dtype=d, device=self.device) for d, n in sizes.items()}

    def gather(self, local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole factors of ``local`` (this rank's local tensors, by key). Collective on ``group``: every
        rank calls it with its own. The returned tensors are this object's buffers, overwritten by the
        next call. Blocks at most ``timeout_s`` per collective.

        Raises:
            RuntimeError: a collective did not complete within ``timeout_s`` (a peer is gone or stuck).
        """
        assert self._slots or not self.full, "ShardGather.exchange() runs once before the first gather"
        for dtype, slots in self._slots.items():
            send, recv = self._send[dtype], self._recv[dtype]
            for s in slots:
                t = local[s.key]
                send[s.offset:s.offset + t.numel()].view(t.shape).copy_(t)
            dist.all_gather(list(recv.unbind(0)), send, group=self.group, async_op=True).wait(self.timeout)
            for s in slots:
                full = self.full[s.key]
                for part in s.parts:
                    held = recv[part.rank, s.offset:s.offset + _numel(part.local_shape)].view(part.local_shape)
                    full[_slices(part.box)].copy_(held[_slices(part.local_box)])
        return self.full

    def _all_pieces(self) -> list[dict[str, tuple[Piece, ...]]]:
        """Every rank's pieces of every factor (``()``: holds none), in group rank order."""
        ndim = max((t.dim() for t in self.full.values()), default=0)
        count = torch.tensor([max((len(p) for p in self._mine.values()), default=0)], dtype=torch.int64,
                             device=self.device)
        if self.world > 1:
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group, async_op=True).wait(self.timeout)
        width = 4 * ndim
        mine = torch.zeros((len(self.full), 1 + int(count) * width), dtype=torch.int64)
        for i, pieces in enumerate(self._mine.values()):
            mine[i, 0] = len(pieces)
            for k, p in enumerate(pieces):
                flat = [v for ab in (*p.global_box, *p.local_box) for v in ab]
                mine[i, 1 + k * width:1 + k * width + len(flat)] = torch.tensor(flat, dtype=torch.int64)
        mine = mine.to(self.device)  # the table is built on the host, exchanged on the group's device
        rows = [mine] if self.world == 1 else [torch.empty_like(mine) for _ in range(self.world)]
        if self.world > 1:
            dist.all_gather(rows, mine, group=self.group, async_op=True).wait(self.timeout)
        return [{key: _decode(row[i], full.dim(), width) for i, (key, full) in enumerate(self.full.items())}
                for row in (r.cpu() for r in rows)]


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _numel(shape_or_box) -> int:
    n = 1
    for v in shape_or_box:
        n *= v[1] - v[0] if isinstance(v, tuple) else v
    return n


def _local_shape(pieces: tuple[Piece, ...]) -> tuple[int, ...]:
    """The local tensor's shape the pieces tile (per dim, the furthest local end)."""
    if not pieces:
        return (0,)
    return tuple(max(p.local_box[d][1] for p in pieces) for d in range(len(pieces[0].local_box)))


def _decode(row: torch.Tensor, ndim: int, width: int) -> tuple[Piece, ...]:
    out = []
    for k in range(int(row[0])):
        v = row[1 + k * width:1 + k * width + 4 * ndim].tolist()
        pairs = [(v[2 * d], v[2 * d + 1]) for d in range(2 * ndim)]
        out.append(Piece(global_box=tuple(pairs[:ndim]), local_box=tuple(pairs[ndim:])))
    return tuple(out)


def _distinct(key: str, shape: tuple[int, ...], held: list[tuple[Piece, ...]]) -> list[_Part]:
    """Per distinct global box, the first rank holding it; the boxes must tile ``shape`` (disjoint,
    volumes summing to its numel).

    Raises:
        ValueError: overlapping boxes or a gap (named).
    """
    seen: dict[Box, _Part] = {}
    for k, pieces in enumerate(held):
        for p in pieces:
            if p.global_box not in seen:
                seen[p.global_box] = _Part(k, p.global_box, p.local_box, _local_shape(pieces))
    boxes = list(seen)
    total = sum(_numel(b) for b in boxes)
    overlap = any(all(a1 < b2 and a2 < b1 for (a1, b1), (a2, b2) in zip(x, y))
                  for i, x in enumerate(boxes) for y in boxes[i + 1:])
    if overlap or total != _numel(shape):
        raise ValueError(f"attach_trainer: the ranks' boxes of {key} {boxes} do not tile its shape "
                         f"{shape} exactly (overlap or gap); every element must be held by some rank, replicas alike")
    return list(seen.values())
