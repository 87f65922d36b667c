"""One trainer rank's weight-sync state over its model's tensors: snapshots and merged sources.

The one state behind every ``TrainerEndpoint``: a live training rank (``LiveState.over_model``: views
of the user's PEFT model — plain, DDP, FSDP2, expert parallel) and the ``TrainerShard`` actor
(``live/checkpoint.py``: the rank's EP × TP shard of a checkpoint, built on the ``meta`` device and
materialized shard-only). ``snapshot(version)`` copies this rank's local factor values (r-thin;
nothing of the base) on their own device (no host copy: the merge reads them where the base lives, and a
transport that needs host bytes gets each merged bucket in one copy, ``transports.devices``) and pins the base object (replaced copy-on-write by ``update_base``, never
written in place), so the next optimizer step may change the factors at once. ``source(version)``
turns a snapshot into a ``MergedSource`` over the base views: with DTensor factors (any mesh) it first
all-gathers the factor boxes this rank lacks (``ShardGather``, weightsync's own group, reused buffers); under expert
parallelism a rank's own factors feed its own experts and no collective runs
(``sharding/local_adapter.py``); ``whole_adapter=True`` (factor streaming) all-gathers every
expert's factors (``FactorGather``). The adapter is normalised once and refreshed in place per sync.
The trainer's tensors are only read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from sync_service.live.base import ExpertBlock, live_base
from sync_service.live.gather import ShardGather
from sync_service.live.model import LiveModel, LiveParam
from sync_service.live.placement import group_ranks
from sync_service.live.replicas import factor_parts
from sync_service.live.structure import check_dora_rows, check_expert_ownership, num_experts_of, structural_adapter
from sync_service.merge.adapter import adapter_from_state_dict
from sync_service.merge.derive import layout_for
from sync_service.merge.source import MergeConfig, MergedSource
from sync_service.merge.terms import LoraAdapter
from sync_service.sharding.base import ShardedBase
from sync_service.sharding.ep_factors import FactorGather
from sync_service.sharding.local_adapter import LocalAdapter
from sync_service.sharding.replicas import ReplicaCheck
from sync_service.sharding.rules import ShardSpec
from sync_service.sharding.snapshots import Snapshots

__all__ = ["LiveState"]


@dataclass(frozen=True, slots=True)
class _Snapshot:
    version: int
    base: ShardedBase
    """The base at ``snapshot()`` (pinned: ``update_base`` replaces it, never writes it)."""
    factors: dict[str, torch.Tensor]
    """This rank's local factor values at ``snapshot()`` (copies, on the parameters' device)."""


class LiveState:
    """Base views + factor snapshots of one trainer rank (see the module docstring).

    Args:
        base: the rank's base shard (views; the boxes it produces are ``base.owned()``).
        factors: PEFT state-dict key → factor as this rank holds it (a DTensor on any mesh under FSDP2 /
            HSDP / TP, an expert block under EP, else whole); also DoRA magnitudes and modules_to_save copies.
        peft_config: the adapter's ``peft.LoraConfig`` (``None``: no adapter, full fine-tuning only).
        spec: the rank's place in the ep × tp mesh (``rank = ep_rank · tp + tp_rank``).
        group: weightsync's process group (``None``: the default group, or none with ``world == 1``).
        rank, world: this rank's index in ``group`` and the group size.
        timeout_s: bound of each factor collective.

    ``prepare()`` (once, on every rank) normalises the adapter's structure.

    Raises:
        ValueError / MergeError: a sharding or adapter the endpoint cannot read (named, with the fix).
    """

    def __init__(self, base: ShardedBase, factors: Mapping[str, LiveParam], peft_config, *, spec: ShardSpec, group,
                 rank: int, world: int, timeout_s: float) -> None:
        self.base, self.factors, self.peft_config, self.spec = base, dict(factors), peft_config, spec
        self.group, self.rank, self.world, self.timeout_s = group, rank, world, timeout_s
        self.merge = MergeConfig()
        self.num_experts = num_experts_of(base)
        check_expert_ownership(base, spec, self.num_experts)
        sharded = {k: p for k, p in self.factors.items() if p.sharded}
        self._gather = ShardGather(sharded, group=group, rank=rank, world=world, timeout_s=timeout_s) if sharded else None
        self._local = LocalAdapter(peft_config, spec, self.num_experts)
        self._whole: FactorGather | None = None  # whole-adapter sources (factor streaming) only
        self._snapshots: Snapshots[_Snapshot] = Snapshots(f"trainer rank {rank}")
        self._full_next = True  # the first sync of an attached trainer is full
        self._changed: frozenset[str] | None = None
        self._replicas: ReplicaCheck | None = None  # made by prepare()
        self._picks: list = []

    @classmethod
    def over_model(cls, live: LiveModel, *, group, rank: int, world: int, experts: ExpertBlock | None,
                   timeout_s: float) -> "LiveState":
        """The state over a live model's parameters (``read_live_model``), views only.

        Raises:
            ValueError: ``experts`` given with DTensor factors; a sharding ``live_base`` refuses.
        """
        base = live_base(live.base, layout=layout_for(live.config), tied_aliases=live.tied_aliases,
                         rank=rank, world=world, experts=experts, ranks=group_ranks(group, world))
        if experts is not None and any(p.sharded for p in live.factors.values()):
            raise ValueError("attach_trainer: expert_range= is for modules holding plain expert blocks; these LoRA "
                             "factors are DTensors — drop expert_range (the DTensor placement gives the rows)")
        return cls(base, live.factors, live.peft_config, spec=_spec(experts), group=group, rank=rank, world=world,
                   timeout_s=timeout_s)

    def prepare(self) -> None:
        """Exchange the DTensor factors' boxes (a collective on ``group``, with DTensor factors only), exchange
        which factor parts each rank holds and check that replicas agree now (collectives on ``group`` when
        ``world > 1``: ``live/replicas.py``), and normalise the adapter's structure once against the base (no
        values). Every rank calls it once.

        Raises:
            ValueError: the ranks' factor boxes do not tile a factor. ReplicasDisagreeError: ranks holding the
                same factor part hold different values (the same on every rank, naming the tensors and ranks).
                MergeError: the adapter does not fit the base; a DoRA tensor split by columns (named).
        """
        if self._gather is not None:
            self._gather.exchange()
        if self.world > 1 and self._has_group():
            parts = factor_parts(self.factors, self.spec, group_ranks(self.group, self.world))
            self._picks = [pick for _, pick in parts]
            self._replicas = ReplicaCheck([part for part, _ in parts], group=self.group, rank=self.rank,
                                          world=self.world, timeout_s=self.timeout_s, device=self._group_device())
            self.check_replicas({k: p.local() for k, p in self.factors.items()}, what="attach")
        structure = self.structure()
        check_dora_rows(structure, self.base, self.spec, self.rank)
        self._changed = structure.changed_names()

    def structure(self) -> LoraAdapter:
        """The whole adapter with zero factors: terms, selections, ranks, scalings (``structure.py``)."""
        shapes = {k: (p.global_shape, p.param.dtype) for k, p in self.factors.items()}
        return structural_adapter(self.peft_config, shapes, self.base, self.spec)

    @property
    def device(self) -> torch.device:
        """Where the base tensors live, hence where the merge runs (``ShardedBase.device``)."""
        return self.base.device

    @property
    def gathered_bytes(self) -> int:
        """Bytes of the reused factor gather buffers (0 without DTensor factors)."""
        return 0 if self._gather is None else self._gather.nbytes

    def owned(self):
        """The ParamMetas (global boxes) this rank produces."""
        return self.base.owned()

    def update_base(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace local base tensors (full fine-tuning; same shapes and dtypes), copy-on-write: a
        snapshot taken before keeps the old ones. The next snapshot asks for a full sync.

        Raises:
            KeyError: an unknown name. ValueError: a shape or dtype that differs from the held tensor.
        """
        self.base = self.base.with_locals(tensors)
        self._full_next = True

    def snapshot(self, version: int) -> frozenset[str] | None:
        """Copy this rank's factor values as ``version``; the names a delta needs (``None``: all)."""
        changed = None if self._full_next else self._changed
        self._snapshots.put(version, _Snapshot(version=version, base=self.base, factors=self._copy()))
        self._full_next = False
        return changed

    def force_full(self) -> None:
        """The next snapshot asks for a full sync (after a restart, or a failed push)."""
        self._full_next = True

    def source(self, version: int, *, whole_adapter: bool = False) -> MergedSource:
        """The merged source of ``version``'s snapshot over this rank's owned boxes (a collective under
        FSDP2). ``whole_adapter``: the source's adapter holds every expert's terms, as the factor-streaming
        recipes index them (a collective under EP).

        The snapshot is kept until the next ``source`` call, so a send retried to the surviving engines
        streams the same values.

        Raises:
            KeyError: no snapshot of ``version``. MergeError: a factor holds NaN or Inf (named).
            ReplicasDisagreeError: replicas of a factor differ in the snapshot (every rank raises it; named).
        """
        snap = self._snapshots.take(version)
        self.check_replicas(snap.factors, what=f"push of version {version}")
        adapter = self._whole_adapter(snap) if whole_adapter else self._adapter(snap)
        return MergedSource(snap.base, adapter, config=self.merge, owned=snap.base.owned(), layout=snap.base.layout)

    def drop_snapshot(self, version: int) -> None:
        self._snapshots.drop(version)

    def check_replicas(self, factors: Mapping[str, torch.Tensor], *, what: str) -> None:
        """Raise on every rank when ranks holding the same part of a factor hold different values of it
        (``factors``: this rank's local factors by PEFT key). Collective on ``group`` when ``world > 1``; one
        int64 per replicated part crosses.

        Raises:
            ReplicasDisagreeError: naming the tensors and the ranks (``sharding/replicas.py``).
        """
        if self._replicas is not None:
            self._replicas.check([pick(factors) for pick in self._picks], what=what)

    def _has_group(self) -> bool:
        """Whether this rank has peers to talk to: a group was given or the default group exists. A rank loaded
        alone (``load_rank`` in one process with no group: inspecting one rank's shard) has none, so it checks no
        replicas; every rank that pushes has one (``TrainerShard`` makes its group before ``load_rank``,
        ``attach_trainer`` runs in an initialized job)."""
        import torch.distributed as dist

        return self.group is not None or dist.is_initialized()

    def _group_device(self) -> torch.device:
        """Where ``group``'s collectives take their tensors (``transports.devices.group_device``)."""
        import torch.distributed as dist

        from sync_service.transports.devices import group_device

        return group_device(dist.get_backend(self.group))

    def _copy(self) -> dict[str, torch.Tensor]:
        return {k: p.local().clone() for k, p in self.factors.items()}  # on the parameters' device

    def _gathered(self, factors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._gather is None:
            return factors
        return {**factors, **self._gather.gather({k: factors[k] for k in self._gather.full})}

    def _adapter(self, snap: _Snapshot):
        if self.peft_config is None:
            return None
        return self._local.update(self._gathered(snap.factors), snap.base, rank=self.rank)

    def _whole_adapter(self, snap: _Snapshot):
        if self.peft_config is None:
            return None
        factors = self._gathered(snap.factors)
        if self.spec.ep > 1:
            if self._whole is None:
                self._whole = FactorGather(self.spec, num_experts=self.num_experts, group=self.group,
                                           timeout_s=self.timeout_s)
            factors = dict(self._whole.gather(factors))  # reused buffers: one source in use at a time
        return adapter_from_state_dict(self.peft_config, factors, snap.base.layout, snap.base.metas(),
                                       tied_aliases=snap.base.tied_aliases)


def _spec(experts: ExpertBlock | None) -> ShardSpec:
    """The expert-parallel place ``LocalAdapter`` shifts expert terms by (contiguous equal blocks)."""
    if experts is None:
        return ShardSpec()
    e_local = experts.stop - experts.start
    return ShardSpec(rank=experts.start // e_local, ep=experts.num_experts // e_local)
