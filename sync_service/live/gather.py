"""All-gather of FSDP2-sharded LoRA factors into full-size buffers allocated once.

Under ``fully_shard`` every factor is a ``DTensor`` ``(Shard(0),)``: ``lora_A`` [r, in] is split on
its rank dim, ``lora_B`` [out, r] on its out dim, the fused expert factors (``target_parameters``:
A [r·E, in], B [out, r·E]) likewise. A rank merging its own base rows needs whole factors of the
modules it merges; factors are r-thin, so each rank gathers them all — never the base. Per sync:
pack this rank's rows of every factor into one flat buffer per dtype (each factor padded to its
chunk size), one ``all_gather`` per dtype on weightsync's own process group, unpack each rank's rows
into the full factors. Buffers (send, receive, full factors) are allocated once at construction.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from sync_service.live.base import chunk_rows

__all__ = ["ShardGather"]


@dataclass(frozen=True, slots=True)
class _Slot:
    key: str
    offset: int
    """Element offset of this factor's chunk in its dtype's flat buffer."""
    chunk_rows: int
    """Rows reserved per rank (the largest chunk)."""
    row_numel: int
    rows: tuple[tuple[int, int], ...]
    """Global rows ``[a, b)`` held by each rank of the group."""


class ShardGather:
    """Gathers the ``Shard(0)`` pieces of DTensor factors into whole factors.

    Args:
        factors: PEFT key → ``LiveParam`` whose param is a DTensor ``(Shard(0),)`` on a 1-D mesh whose
            ranks are the ranks of ``group``, in group order.
        group: weightsync's process group (never the training group's collectives).
        rank, world: this rank's index in ``group`` and the group size.
        timeout_s: bound of each collective.

    Memory: the full factors plus a send buffer and a ``[world, n]`` receive buffer per dtype
    (n ≈ factor elements / world), allocated here and reused by every ``gather``.

    Raises:
        ValueError: a factor's mesh is not the group, or its local rows are not the ``torch.chunk``
            rows FSDP2 gives (named).
    """

    def __init__(self, factors: Mapping, *, group, rank: int, world: int, timeout_s: float) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.timeout = timedelta(seconds=timeout_s)
        self.full: dict[str, torch.Tensor] = {}
        self._slots: dict[torch.dtype, list[_Slot]] = {}
        group_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        sizes: dict[torch.dtype, int] = {}
        for key, p in factors.items():
            _check_mesh(key, p.param, group_ranks)
            shape, dtype = p.global_shape, p.param.dtype
            rows = tuple(chunk_rows(shape[0], world, k) for k in range(world))
            if tuple(p.local().shape[:1]) != (rows[rank][1] - rows[rank][0],):
                raise ValueError(f"attach_trainer: {key} holds {p.local().shape[0]} rows on rank {rank}, not the "
                                 f"torch.chunk rows {rows[rank]} FSDP2 gives; shard it with fully_shard")
            row_numel = int(torch.Size(shape[1:]).numel())
            chunk = max(b - a for a, b in rows)
            self._slots.setdefault(dtype, []).append(_Slot(key, sizes.get(dtype, 0), chunk, row_numel, rows))
            sizes[dtype] = sizes.get(dtype, 0) + chunk * row_numel
            self.full[key] = torch.empty(shape, dtype=dtype)
        self._send = {d: torch.zeros(n, dtype=d) for d, n in sizes.items()}
        self._recv = {d: torch.empty((world, n), dtype=d) for d, n in sizes.items()}

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer held (full factors, send and receive buffers)."""
        return sum(t.numel() * t.element_size() for t in (*self.full.values(), *self._send.values(), *self._recv.values()))

    def gather(self, local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole factors of ``local`` (this rank's rows, by key). Collective on ``group``: every rank
        calls it with its own rows. The returned tensors are this object's buffers, overwritten by the
        next call. Blocks at most ``timeout_s`` per collective.

        Raises:
            RuntimeError: a collective did not complete within ``timeout_s`` (a peer is gone or stuck).
        """
        for dtype, slots in self._slots.items():
            send, recv = self._send[dtype], self._recv[dtype]
            for s in slots:
                t = local[s.key]
                send[s.offset:s.offset + t.numel()].view(t.shape).copy_(t)
            dist.all_gather(list(recv.unbind(0)), send, group=self.group, async_op=True).wait(self.timeout)
            for s in slots:
                full = self.full[s.key]
                for k, (a, b) in enumerate(s.rows):
                    n = (b - a) * s.row_numel
                    full[a:b].copy_(recv[k, s.offset:s.offset + n].view((b - a, *full.shape[1:])))
        return self.full


def _check_mesh(key: str, dt, group_ranks: list[int]) -> None:
    from torch.distributed.tensor import Shard

    mesh = dt.device_mesh
    if mesh.ndim != 1 or tuple(dt.placements) != (Shard(0),):
        raise ValueError(f"attach_trainer: {key} is a DTensor placed {tuple(dt.placements)} on a {mesh.ndim}-D mesh; "
                         f"the endpoint gathers (Shard(0),) on a 1-D mesh (FSDP2 fully_shard)")
    if mesh.mesh.flatten().tolist() != list(group_ranks):
        raise ValueError(f"attach_trainer: {key} is sharded over ranks {mesh.mesh.flatten().tolist()} but weightsync's "
                         f"group holds {list(group_ranks)}; pass group= a process group of exactly the mesh's ranks")
