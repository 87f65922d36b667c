"""One training rank's weight-sync state over its live PEFT model: snapshots and merged sources.

``snapshot(version)`` copies this rank's local factor values (r-thin; nothing of the base) so the
next optimizer step may change the live factors at once. ``source(version)`` turns a snapshot into a
``MergedSource`` over the live base views: under FSDP2 it first all-gathers the factor rows this rank
lacks (``ShardGather``, weightsync's own group, reused buffers); under expert parallelism
(``expert_range``) a rank's own factors feed its own experts and no collective runs
(``sharding/local_adapter.py``). The adapter is normalised once (at construction) and refreshed in
place per sync. The trainer's parameters, grads and optimizer state are only read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sync_service.live.base import ExpertBlock, live_base
from sync_service.live.gather import ShardGather
from sync_service.live.model import LiveModel
from sync_service.merge.derive import layout_for
from sync_service.merge.source import MergeConfig, MergedSource
from sync_service.sharding.local_adapter import LocalAdapter
from sync_service.sharding.rules import ShardSpec
from sync_service.sharding.snapshots import Snapshots
from sync_service.sharding.trainer_state import num_experts_of

__all__ = ["LiveState"]


@dataclass(frozen=True, slots=True)
class _Snapshot:
    version: int
    factors: dict[str, torch.Tensor]
    """This rank's local factor values at ``snapshot()`` (copies)."""


class LiveState:
    """Base views + factor snapshots of one training rank (see the module docstring).

    Args:
        live: the model's parameters (``read_live_model``).
        group: weightsync's process group (``None`` with ``world == 1``).
        rank, world: this rank's index in ``group`` and the group size.
        experts: this rank's expert block under expert parallelism, else ``None``.
        timeout_s: bound of each factor collective.

    ``prepare()`` (once, on every rank) normalises the adapter; with DTensor factors it is a collective.

    Raises:
        ValueError / MergeError: a sharding or adapter the endpoint cannot read (named, with the fix).
    """

    def __init__(self, live: LiveModel, *, group, rank: int, world: int, experts: ExpertBlock | None,
                 timeout_s: float) -> None:
        self.live, self.rank, self.world = live, rank, world
        self.merge = MergeConfig()
        self.base = live_base(live.base, layout=layout_for(live.config), tied_aliases=live.tied_aliases,
                              rank=rank, world=world, experts=experts)
        sharded = {k: p for k, p in live.factors.items() if p.sharded}
        if experts is not None and sharded:
            raise ValueError("attach_trainer: expert_range= is for modules holding plain expert blocks; these LoRA "
                             "factors are DTensors — drop expert_range (the DTensor placement gives the rows)")
        self._gather = ShardGather(sharded, group=group, rank=rank, world=world, timeout_s=timeout_s) if sharded else None
        self._local = LocalAdapter(live.peft_config, _spec(experts), num_experts_of(self.base))
        self._snapshots: Snapshots[_Snapshot] = Snapshots(f"training rank {rank}")
        self._full_next = True  # the first sync of an attached trainer is full
        self._changed: frozenset[str] | None = None

    def prepare(self) -> None:
        """Normalise the adapter once against the base (a collective on ``group`` with DTensor factors).

        Raises:
            MergeError: the adapter does not fit the base, or holds NaN/Inf (named).
        """
        self._changed = self._adapter(self._copy()).changed_names()

    @property
    def gathered_bytes(self) -> int:
        """Bytes of the reused factor gather buffers (0 without DTensor factors)."""
        return 0 if self._gather is None else self._gather.nbytes

    def owned(self):
        """The ParamMetas (global boxes) this rank produces."""
        return self.base.owned()

    def snapshot(self, version: int) -> frozenset[str] | None:
        """Copy this rank's factor values as ``version``; the names a delta needs (``None``: all)."""
        changed = None if self._full_next else self._changed
        self._snapshots.put(version, _Snapshot(version=version, factors=self._copy()))
        self._full_next = False
        return changed

    def force_full(self) -> None:
        """The next snapshot asks for a full sync (after a restart, or a failed push)."""
        self._full_next = True

    def source(self, version: int) -> MergedSource:
        """The merged source of ``version``'s snapshot over this rank's owned boxes (a collective under FSDP2).

        The snapshot is kept until the next ``source`` call, so a send retried to the surviving engines
        streams the same values.

        Raises:
            KeyError: no snapshot of ``version``. MergeError: a factor holds NaN or Inf (named).
        """
        snap = self._snapshots.take(version)
        return MergedSource(self.base, self._adapter(snap.factors), config=self.merge, owned=self.base.owned(),
                            layout=self.base.layout)

    def drop_snapshot(self, version: int) -> None:
        self._snapshots.drop(version)

    def _copy(self) -> dict[str, torch.Tensor]:
        return {k: p.local().to(device="cpu", copy=True) for k, p in self.live.factors.items()}

    def _adapter(self, factors: dict[str, torch.Tensor]):
        if self._gather is not None:
            whole = self._gather.gather({k: factors[k] for k in self._gather.full})
            factors = {**factors, **whole}
        return self._local.update(factors, self.base, rank=self.rank)


def _spec(experts: ExpertBlock | None) -> ShardSpec:
    """The expert-parallel place ``LocalAdapter`` shifts expert terms by (contiguous equal blocks)."""
    if experts is None:
        return ShardSpec()
    e_local = experts.stop - experts.start
    return ShardSpec(rank=experts.start // e_local, ep=experts.num_experts // e_local)
