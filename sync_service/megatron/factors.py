"""The Megatron-Bridge LoRA factors a rank's merge needs, read in place or gathered where the split requires it.

Bridge's adapter on a column-parallel base (``linear_qkv``, ``linear_fc1``) splits ``linear_in`` [dim, in] on dim
across the tensor-parallel ranks (expert-TP ranks for experts) while each rank's base rows need all of it; on a
row-parallel base (``linear_proj``) ``linear_out`` [out, dim] is split on out while each rank's base columns need
all of its rows. ``FactorNeeds`` reads from the placements which factors a rank's segments need beyond what it
holds; ``GroupGather`` gathers exactly those, within weightsync's mirror of the Megatron group that splits them
(one ``all_gather`` per dtype and group per push, into buffers allocated once at attach). Everything else is read
from the rank's own shards.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta

import torch
import torch.distributed as dist

from sync_service.megatron.placement import Placement

__all__ = ["GroupGather", "mirror_groups", "local_rows", "local_cols"]

_WIDTH = 5  # per piece: r0, r1, c0, c1, local row start


def local_rows(p: Placement, rows: torch.Tensor) -> torch.Tensor | None:
    """Local row indices of global ``rows`` (all columns) of ``p``'s tensor, where one of its pieces holds them all."""
    lo, hi = int(rows.min()), int(rows.max()) + 1
    for box, index in p.pieces:
        (r0, r1), (c0, c1) = box
        if r0 <= lo and hi <= r1 and (c0, c1) == (0, p.global_shape[1]):
            return rows - r0 + (index[0].start if index else 0)
    return None


def local_cols(p: Placement, cols: tuple[int, int]) -> tuple[int, int] | None:
    """Local column range of global ``cols`` (all rows) of ``p``'s tensor, where one of its pieces holds them."""
    for box, index in p.pieces:
        (r0, r1), (c0, c1) = box
        if (r0, r1) == (0, p.global_shape[0]) and c0 <= cols[0] and cols[1] <= c1 and not index:
            return cols[0] - c0, cols[1] - c0
    return None


def mirror_groups(megatron_groups: list, *, group, world: int, timeout_s: float) -> list:
    """Weightsync's own gloo group mirroring each of ``megatron_groups`` (this rank's Megatron groups, e.g. its tensor-
    and expert-tensor-parallel ones), ``None`` where a group has one rank. Collective on ``group`` (weightsync's, over
    every rank of the job): every rank learns every rank's groups (one int64 all-gather each, on the host) and makes
    every distinct one, in one order. The factor gathers run on the host (``GroupGather``): factors are r-thin."""
    out = []
    for megatron_group in megatron_groups:
        ranks = dist.get_process_group_ranks(megatron_group) if megatron_group is not None else [dist.get_rank()]
        mine = torch.full((world,), -1, dtype=torch.int64)
        mine[:len(ranks)] = torch.tensor(sorted(ranks), dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine, group=group, async_op=True).wait(timedelta(seconds=timeout_s))
        distinct = sorted({tuple(int(v) for v in row if v >= 0) for row in rows})
        made = None
        for members in distinct:
            g = (dist.new_group(list(members), backend="gloo", timeout=timedelta(seconds=timeout_s))
                 if len(members) > 1 else None)
            if dist.get_rank() in members:
                made = g
        out.append(made)
    return out


class GroupGather:
    """All-gathers the listed factors within one group (see the module docstring).

    Args:
        factors: global key → (this rank's ``Placement`` of it, its local tensor) — the same keys and local
            shapes on every member (the members split the same tensors).
        group: weightsync's mirror of the Megatron group that splits them.
        timeout_s: bound of each collective.

    ``exchange()`` (collective, once) checks the members agree and learns their boxes; ``gather(local)`` (collective,
    per push) returns whole factors (buffers owned here, overwritten by the next call).

    Raises:
        ValueError: the members list other factors or shapes, or their boxes do not tile a factor (named).
    """

    def __init__(self, factors: dict[str, tuple[Placement, torch.Tensor]], *, group, timeout_s: float) -> None:
        self.keys = sorted(factors)
        self.placements = {k: factors[k][0] for k in self.keys}
        self.group, self.timeout = group, timedelta(seconds=timeout_s)
        self.size = dist.get_world_size(group)
        self.device = torch.device("cpu")  # gloo: host buffers (the local factors are copied in, r-thin)
        self._shapes = {k: tuple(factors[k][1].shape) for k in self.keys}
        self.full = {k: torch.empty(self.placements[k].global_shape, dtype=factors[k][1].dtype, device=self.device)
                     for k in self.keys}
        self._offsets: dict[str, int] = {}
        sizes: dict[torch.dtype, int] = {}
        for k in self.keys:
            dtype = self.full[k].dtype
            self._offsets[k] = sizes.get(dtype, 0)
            sizes[dtype] = sizes.get(dtype, 0) + factors[k][1].numel()
        self._send = {d: torch.empty(n, dtype=d, device=self.device) for d, n in sizes.items()}
        self._recv = {d: torch.empty((self.size, n), dtype=d, device=self.device) for d, n in sizes.items()}
        self._pieces: list[dict[str, list[tuple[int, ...]]]] = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.full.values(), *self._send.values(), *self._recv.values()))

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        rows = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(rows, t, group=self.group, async_op=True).wait(self.timeout)
        return rows

    def exchange(self) -> None:
        """Check the members gather the same factors and learn each member's boxes (two int64 all-gathers)."""
        text = "\n".join(f"{k}:{self._shapes[k]}:{self.full[k].dtype}" for k in self.keys)
        digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
        if len({int(r) for r in self._all_gather(torch.tensor([digest], dtype=torch.int64))}) > 1:
            raise ValueError(f"the ranks of a Megatron tensor-parallel group need different LoRA factors gathered "
                             f"({self.keys[:3]}…); every rank of the group must hold the same modules")
        table = torch.full((max(len(self.keys), 1), 2 * _WIDTH), -1, dtype=torch.int64)
        for i, k in enumerate(self.keys):
            for j, (box, index) in enumerate(self.placements[k].pieces[:2]):
                (r0, r1), (c0, c1) = box
                table[i, j * _WIDTH:(j + 1) * _WIDTH] = torch.tensor([r0, r1, c0, c1, index[0].start if index else 0])
        rows = self._all_gather(table)
        self._pieces = [{k: [tuple(int(v) for v in row[i, j * _WIDTH:(j + 1) * _WIDTH]) for j in range(2)
                             if int(row[i, j * _WIDTH]) >= 0] for i, k in enumerate(self.keys)} for row in rows]
        for k in self.keys:
            filled = torch.zeros(self.placements[k].global_shape, dtype=torch.int8)
            for member in self._pieces:
                for r0, r1, c0, c1, _ in member[k]:
                    filled[r0:r1, c0:c1] += 1
            if not bool((filled > 0).all()):
                raise ValueError(f"{k}: the tensor-parallel ranks' boxes do not cover it; cannot gather it")

    def gather(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole factors of ``self.keys`` from every member's ``local`` (global key → local tensor)."""
        for dtype, send in self._send.items():
            for k in self.keys:
                if self.full[k].dtype == dtype:
                    t = local[k]
                    send[self._offsets[k]:self._offsets[k] + t.numel()].view(t.shape).copy_(t)
            recv = self._recv[dtype]
            dist.all_gather(list(recv.unbind(0)), send, group=self.group, async_op=True).wait(self.timeout)
            for k in self.keys:
                if self.full[k].dtype != dtype:
                    continue
                shape, off = self._shapes[k], self._offsets[k]
                for m, member in enumerate(self._pieces):
                    held = recv[m, off:off + _numel(shape)].view(shape)
                    for r0, r1, c0, c1, l0 in member[k]:
                        self.full[k][r0:r1, c0:c1].copy_(held[l0:l0 + r1 - r0])
        return self.full


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for v in shape:
        n *= v
    return n
