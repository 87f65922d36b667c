"""All-gather of DTensor LoRA factors, on any mesh and placement, into full-size buffers allocated once.

A factor is a ``DTensor`` placed on any mesh (FSDP2 ``Shard(0)`` on its rank or out dim, ``Shard(1)``,
HSDP's ``(Replicate, Shard)``, FSDP2 × TP's ``_StridedShard``, a data-parallel sub-mesh beside a TP
mesh). Each rank holds one box of it (``placement.dtensor_box``: global offset + local shape); the
whole factor is the union of every rank's box. A rank merging its own base boxes needs whole factors;
factors are r-thin, so each rank gathers them all — never the base.

``exchange()`` (once, collective, after every rank attached) all-gathers each rank's boxes, checks
that they tile every factor, and allocates the buffers: per dtype one flat send buffer (each factor a
slot of the largest box any rank holds) and a ``[world, n]`` receive buffer. Per sync, ``gather``
packs this rank's boxes, runs one ``all_gather`` per dtype on weightsync's own process group, and
copies each distinct box (the first rank holding it; replicas hold the same values) into the factor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from protocols.params import Box, box_shape
from sync_service.live.placement import dtensor_box, group_ranks

__all__ = ["ShardGather"]


@dataclass(frozen=True, slots=True)
class _Slot:
    key: str
    offset: int
    """Element offset of this factor's slot in its dtype's flat buffer."""
    boxes: tuple[tuple[int, Box], ...]
    """(rank, global box) of each distinct box of the factor, the first rank holding it."""


class ShardGather:
    """Gathers the boxes of DTensor factors into whole factors (see the module docstring).

    Args:
        factors: PEFT key → ``LiveParam`` whose param is a DTensor whose mesh's ranks are in ``group``.
        group: weightsync's process group (never the training group's collectives).
        rank, world: this rank's index in ``group`` and the group size.
        timeout_s: bound of each collective.

    Memory (after ``exchange``): the full factors plus a send buffer and a ``[world, n]`` receive buffer
    per dtype (n: the sum of each factor's largest box), reused by every ``gather``.

    Raises:
        ValueError: a placement ``placement.dtensor_box`` refuses (named, with the fix).
    """

    def __init__(self, factors: Mapping, *, group, rank: int, world: int, timeout_s: float) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.timeout = timedelta(seconds=timeout_s)
        ranks = group_ranks(group, world)
        self._mine = {key: dtensor_box(key, p.param, ranks) for key, p in factors.items()}
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
        """All-gather every rank's boxes, plan the slots and allocate the buffers. Collective on ``group``,
        once, on every rank (after attach agreed). Blocks at most ``timeout_s``.

        Raises:
            ValueError: the ranks' boxes of a factor do not tile it (named; the same on every rank).
            RuntimeError: the collective did not complete within ``timeout_s``.
        """
        table = self._all_boxes()
        sizes: dict[torch.dtype, int] = {}
        for key, full in self.full.items():
            boxes = _distinct(key, tuple(full.shape), [row[key] for row in table])
            largest = max((_numel(b) for _, b in boxes), default=0)
            self._slots.setdefault(full.dtype, []).append(_Slot(key, sizes.get(full.dtype, 0), tuple(boxes)))
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
                for k, box in s.boxes:
                    shape = box_shape(box)
                    n = _numel(box)
                    full[tuple(slice(a, b) for a, b in box)].copy_(recv[k, s.offset:s.offset + n].view(shape))
        return self.full

    def _all_boxes(self) -> list[dict[str, Box | None]]:
        """Every rank's box of every factor (``None``: holds none), in group rank order."""
        ndim = max((t.dim() for t in self.full.values()), default=0)
        width = 1 + 2 * ndim
        mine = torch.zeros((len(self.full), width), dtype=torch.int64)
        for i, box in enumerate(self._mine.values()):
            if box is not None:
                mine[i, 0] = 1
                mine[i, 1:1 + 2 * len(box)] = torch.tensor([v for ab in box for v in ab], dtype=torch.int64)
        mine = mine.to(self.device)  # the table is built on the host, exchanged on the group's device
        rows = [mine] if self.world == 1 else [torch.empty_like(mine) for _ in range(self.world)]
        if self.world > 1:
            dist.all_gather(rows, mine, group=self.group, async_op=True).wait(self.timeout)
        out = []
        for row in (r.cpu() for r in rows):
            out.append({key: _decode(row[i], full.dim()) for i, (key, full) in enumerate(self.full.items())})
        return out


def _numel(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def _decode(row: torch.Tensor, ndim: int) -> Box | None:
    if not int(row[0]):
        return None
    v = row[1:1 + 2 * ndim].tolist()
    return tuple((v[2 * d], v[2 * d + 1]) for d in range(ndim))


def _distinct(key: str, shape: tuple[int, ...], boxes: list[Box | None]) -> list[tuple[int, Box]]:
    """(first rank, box) per distinct box; they must tile ``shape`` (disjoint, volumes summing to its numel).

    Raises:
        ValueError: overlapping boxes or a gap (named).
    """
    seen: dict[Box, int] = {}
    for k, box in enumerate(boxes):
        if box is not None:
            seen.setdefault(box, k)
    distinct = [(k, box) for box, k in seen.items()]
    total = sum(_numel(b) for _, b in distinct)
    overlap = any(all(a1 < b2 and a2 < b1 for (a1, b1), (a2, b2) in zip(x, y))
                  for i, (_, x) in enumerate(distinct) for _, y in distinct[i + 1:])
    if overlap or total != _numel(tuple((0, n) for n in shape)):
        raise ValueError(f"attach_trainer: the ranks' boxes of {key} {[b for _, b in distinct]} do not tile its shape "
                         f"{shape} exactly (overlap or gap); every element must be held by some rank, replicas alike")
    return distinct
