"""FSDP2-style sharding: ``DTensor``s with ``Shard(0)`` on a (CPU or CUDA) ``DeviceMesh``.

``fsdp_base(dtensors)`` wraps a rank's DTensor parameters (``torch.distributed.tensor``, as
``fully_shard`` leaves them) as a ``ShardedBase``: rank k holds global rows
``[offset_k, offset_k + local_rows)`` of every tensor (torch.chunk sizes, possibly empty) and produces
exactly those — every element is sent by one rank. Global offsets come from the DTensor's own
placement arithmetic (``compute_local_shape_and_global_offset``, what DCP uses).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from protocols.params import ParamMeta
from sync_service.dtypes import wire_dtype
from sync_service.sharding.base import LocalShard, ShardedBase
from sync_service.sharding.rules import Piece

__all__ = ["fsdp_base"]


def fsdp_base(dtensors: Mapping[str, DTensor], *, layout: object | None = None) -> ShardedBase:
    """A ShardedBase over this rank's local shards of dim-0-sharded DTensors (no copy).

    Raises:
        ValueError: a tensor is not a DTensor placed ``[Shard(0)]`` on a 1-D mesh.
    """
    shards = {}
    for name, dt in dtensors.items():
        if not isinstance(dt, DTensor) or tuple(dt.placements) != (Shard(0),):
            raise ValueError(f"{name}: expected a DTensor with placements (Shard(0),), got "
                             f"{getattr(dt, 'placements', type(dt).__name__)}; shard it with fully_shard / distribute_tensor")
        local = dt.to_local()
        shape = tuple(dt.shape)
        local_shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
        meta = ParamMeta(name=name, dtype=wire_dtype(dt.dtype), shape=shape)
        rows = local_shape[0] if shape else 0
        pieces: tuple[Piece, ...] = ()
        if shape and rows > 0:
            global_box = ((offset[0], offset[0] + rows),) + tuple((0, n) for n in shape[1:])
            local_box = ((0, rows),) + tuple((0, n) for n in shape[1:])
            pieces = (Piece(global_box=global_box, local_box=local_box),)
        elif not shape and dt.device_mesh.get_local_rank() == 0:
            pieces = (Piece(global_box=(), local_box=()),)
        shards[name] = LocalShard(meta=meta, local=local.detach(), pieces=pieces, owned=True)
    return ShardedBase(shards, layout=layout)
