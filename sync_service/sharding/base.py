"""``ShardedBase``: a BaseProvider over one trainer rank's local tensors, serving global boxes.

The merge core asks a base for ``read(name, box)`` with ``box`` in *global* coordinates of the
hf-fused tensor; this provider maps it to the rank's local tensor (EP expert offset, TP gate/up row
mapping, dim-0 FSDP offset) and returns a view — no copy, never written. ``owned()`` lists the boxes
this rank produces (under TP two boxes of ``gate_up_proj`` per expert block: its gate rows and its
up rows); replicated tensors are owned by one rank only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from protocols.params import Box, ParamMeta, box_shape
from sync_service.dtypes import torch_dtype, wire_dtype
from sync_service.sharding.rules import Piece, ShardSpec, local_shape, owns, shard_pieces

__all__ = ["LocalShard", "ShardedBase", "load_shard", "shard_tensors"]


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


@dataclass(frozen=True, slots=True)
class LocalShard:
    """A rank's local tensor of one global tensor, the pieces it holds, and whether it produces them."""

    meta: ParamMeta
    local: torch.Tensor
    pieces: tuple[Piece, ...]
    owned: bool


class ShardedBase:
    """BaseProvider over local shards (implements ``metas()`` / ``read(name, box)`` of the merge core).

    Args:
        shards: global name -> ``LocalShard``, in production (layer) order.
    """

    def __init__(self, shards: Mapping[str, LocalShard], *, layout: object | None = None,
                 tied_aliases: Mapping[str, str] | None = None) -> None:
        self._shards = dict(shards)
        self.layout = layout
        """The merge core's ``FamilyLayout`` of the model, when known (passed on to ``MergedSource``)."""
        self.tied_aliases = dict(tied_aliases or {})
        """Tied alias not listed (``lm_head.weight``) -> listed tensor it shares."""

    def with_locals(self, tensors: Mapping[str, torch.Tensor]) -> "ShardedBase":
        """A new ShardedBase with some local tensors replaced (same pieces and ownership); ``self``
        is unchanged, so a snapshot holding ``self`` keeps its values (copy on write).

        Raises:
            KeyError: unknown name. ValueError: a replacement of another shape or dtype.
        """
        shards = dict(self._shards)
        for name, t in tensors.items():
            old = shards[name]
            if t.shape != old.local.shape or t.dtype != old.local.dtype:
                raise ValueError(f"{name}: replacement {t.dtype}{list(t.shape)} != local {old.local.dtype}{list(old.local.shape)}")
            shards[name] = LocalShard(meta=old.meta, local=t, pieces=old.pieces, owned=old.owned)
        return ShardedBase(shards, layout=self.layout, tied_aliases=self.tied_aliases)

    def metas(self) -> list[ParamMeta]:
        """Every tensor of the model, whole (``box=None``), global shapes, in layer order."""
        return [s.meta for s in self._shards.values()]

    def owned(self) -> list[ParamMeta]:
        """The global boxes this rank produces, one ParamMeta per box, in layer order."""
        return [
            ParamMeta(name=s.meta.name, dtype=s.meta.dtype, shape=s.meta.shape, box=p.global_box)
            for s in self._shards.values() if s.owned for p in s.pieces
        ]

    @property
    def device(self) -> torch.device:
        """The device of the rank's local tensors (the first one's; ``cpu`` when it holds none): where a merge
        over this base runs."""
        first = next(iter(self._shards.values()), None)
        return torch.device("cpu") if first is None else first.local.device

    def local_tensors(self) -> dict[str, torch.Tensor]:
        """The rank's local tensors by global name (the training framework's view)."""
        return {n: s.local for n, s in self._shards.items()}

    def read(self, name: str, box: Box) -> torch.Tensor:
        """A read-only view of global ``box`` of ``name``; the box must lie inside one held piece.

        Raises:
            KeyError: unknown ``name``.
            ValueError: ``box`` is not inside any piece this rank holds.
        """
        shard = self._shards.get(name)
        if shard is None:
            raise KeyError(f"{name!r} is not a tensor of this base")
        for piece in shard.pieces:
            if len(box) == len(piece.global_box) and all(
                ga <= a and b <= gb for (a, b), (ga, gb) in zip(box, piece.global_box)
            ):
                local_box = tuple(
                    (la + a - ga, la + b - ga) for (a, b), (ga, _), (la, _) in zip(box, piece.global_box, piece.local_box)
                )
                view = shard.local[_slices(local_box)]
                assert tuple(view.shape) == box_shape(box)
                return view
        held = [p.global_box for p in shard.pieces]
        raise ValueError(f"box {box} of {name!r} is not held by this rank (holds {held})")


def shard_tensors(tensors: Mapping[str, torch.Tensor], spec: ShardSpec, *, layout: object | None = None) -> ShardedBase:
    """Cut full hf-fused tensors into the rank's local shards (copies the held pieces).

    Raises:
        ValueError: a split dimension is not divisible by its parallel size.
    """
    shards = {}
    for name, full in tensors.items():
        meta = ParamMeta(name=name, dtype=wire_dtype(full.dtype), shape=tuple(full.shape))
        shards[name] = _make_shard(meta, spec, lambda box, full=full: full[_slices(box)], layout)
    return ShardedBase(shards, layout=layout)


def load_shard(provider: object, spec: ShardSpec) -> ShardedBase:
    """Read only this rank's pieces from a BaseProvider (``metas()`` / ``read(name, box)``), e.g. the
    merge core's ``SafetensorsBase`` over a checkpoint directory in any on-disk naming.

    Raises:
        ValueError: a split dimension is not divisible by its parallel size.
    """
    shards = {}
    layout = getattr(provider, "layout", None)
    for meta in provider.metas():
        whole = ParamMeta(name=meta.name, dtype=meta.dtype, shape=tuple(meta.shape))
        shards[meta.name] = _make_shard(whole, spec, lambda box, n=meta.name: provider.read(n, box), layout)
    return ShardedBase(shards, layout=layout, tied_aliases=getattr(provider, "tied_aliases", None))


def _make_shard(meta: ParamMeta, spec: ShardSpec, read_global, layout: object | None = None) -> LocalShard:
    pieces = tuple(shard_pieces(meta, spec, layout))
    dtype = torch_dtype(meta.dtype)
    local = torch.empty(local_shape(meta, spec, layout), dtype=dtype)
    for piece in pieces:
        local[_slices(piece.local_box)].copy_(read_global(piece.global_box))
    return LocalShard(meta=meta, local=local, pieces=pieces, owned=owns(meta, spec, layout))
