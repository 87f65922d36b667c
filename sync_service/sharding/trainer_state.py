"""What one trainer rank holds for weight sync: its base shard, its LoRA factors, and snapshots.

A snapshot (``snapshot(version)``) clones the rank's local factors and modules_to_save — small —
and pins the base shard object (the base is replaced copy-on-write, never written in place, so a
pinned shard keeps its values). ``source(version)`` then refreshes the rank's adapter with the
snapshot's factors — no collective: an EP rank produces only its own experts' boxes, which only its
own factors feed (``local_adapter.py``) — and returns a ``MergedSource`` over the rank's own base
shard that produces exactly the rank's owned boxes. A sync never modifies the trainer's tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from sync_service.merge.adapter import adapter_from_state_dict
from sync_service.merge.errors import MergeError
from sync_service.merge.layouts import expert_names
from sync_service.merge.source import MergeConfig, MergedSource
from sync_service.sharding.base import ShardedBase
from sync_service.sharding.ep_factors import FactorGather, local_factors
from sync_service.sharding.local_adapter import LocalAdapter
from sync_service.sharding.rules import ShardSpec
from sync_service.sharding.snapshots import Snapshots

__all__ = ["TrainerState", "Snapshot", "num_experts_of"]


def num_experts_of(base: ShardedBase) -> int:
    """E from the first fused experts tensor (dim 0); 0 for a dense model."""
    for m in base.metas():
        if expert_names().fused.search(m.name):
            return m.shape[0]
    return 0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The trained state of one weight version on one rank, frozen at ``snapshot()`` time."""

    version: int
    base: ShardedBase
    factors: dict[str, torch.Tensor]
    base_changed: bool


class TrainerState:
    """Base shard + local LoRA factors of one trainer rank.

    Args:
        base: the rank's base shard (``load_shard`` / ``shard_tensors``).
        spec: the rank's place in the ep × tp mesh.
        peft_config: the adapter's ``peft.LoraConfig`` (``None``: no adapter, full fine-tuning).
        factors: the rank's local part of the PEFT state dict (``local_factors``).
        group: trainer process group for the factor all-gather (``None``: default group).
        merge: merge settings (dtype, staging, finiteness check).
    """

    def __init__(self, base: ShardedBase, spec: ShardSpec, *, peft_config=None,
                 factors: Mapping[str, torch.Tensor] | None = None, group=None,
                 merge: MergeConfig | None = None, gather_timeout_s: float = 60.0) -> None:
        self.base, self.spec, self.peft_config, self.group = base, spec, peft_config, group
        self.factors = {k: v.detach().clone() for k, v in (factors or {}).items()}
        self.merge = merge or MergeConfig()
        self.gather_timeout_s = gather_timeout_s
        self.num_experts = num_experts_of(base)
        self._base_changed = True  # the first sync of a fresh trainer is full
        self._snapshots: Snapshots[Snapshot] = Snapshots(f"trainer rank {spec.rank}")
        # an EP rank merges only its own expert block: its own factors suffice, no collective per sync
        _check_expert_ownership(base, spec, self.num_experts)
        self._local = LocalAdapter(peft_config, spec, self.num_experts)
        self._gather: FactorGather | None = None  # whole-adapter sources (factor streaming) only
        self._changed = self._changed_names()

    @classmethod
    def from_checkpoint(cls, base_dir: str | Path, adapter_dir: str | Path | None, spec: ShardSpec, **kw) -> "TrainerState":
        """Read this rank's shard of a safetensors checkpoint (any on-disk naming the merge core
        maps) and its part of a PEFT adapter directory.

        Raises:
            MergeError: bad checkpoint or adapter. ValueError: sizes not divisible by ep / tp.
        """
        from sync_service.merge.base import SafetensorsBase
        from sync_service.sharding.base import load_shard

        base = load_shard(SafetensorsBase(base_dir, as_loaded=True), spec)
        if adapter_dir is None:
            return cls(base, spec, **kw)
        from peft import PeftConfig
        from safetensors.torch import load_file

        weights = Path(adapter_dir) / "adapter_model.safetensors"
        if not weights.is_file():
            raise FileNotFoundError(f"{adapter_dir}: no adapter_model.safetensors; save the adapter with safe_serialization=True")
        full = load_file(str(weights))
        peft_config = PeftConfig.from_pretrained(str(adapter_dir))
        return cls(base, spec, peft_config=peft_config,
                   factors=local_factors(full, spec, num_experts=num_experts_of(base)), **kw)

    # -- training-side hooks ---------------------------------------------------------------
    def set_factors(self, updates: Mapping[str, torch.Tensor]) -> None:
        """Replace local factor values (keys and shapes as held), as an optimizer step would.

        Raises:
            KeyError: a key this rank does not hold. ValueError: a shape mismatch.
        """
        for key, value in updates.items():
            if key not in self.factors:
                raise KeyError(f"{key!r} is not a factor held by trainer rank {self.spec.rank}; held: {sorted(self.factors)[:4]}…")
            if tuple(value.shape) != tuple(self.factors[key].shape):
                raise ValueError(f"{key!r}: shape {tuple(value.shape)} != held {tuple(self.factors[key].shape)}")
            self.factors[key].copy_(value)

    def update_base(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace local base tensors (full fine-tuning), copy-on-write; the next sync is full."""
        self.base = self.base.with_locals(tensors)
        self._base_changed = True

    # -- sync ------------------------------------------------------------------------------
    def owned(self):
        """The ParamMetas (global boxes) this rank produces."""
        return self.base.owned()

    def changed_names(self) -> frozenset[str] | None:
        """Names a delta sync must send (LoRA targets, modules_to_save); ``None``: everything
        (the base changed since the last snapshot)."""
        return None if self._base_changed else self._changed

    def snapshot(self, version: int) -> frozenset[str] | None:
        """Freeze this version's trained state; returns ``changed_names()`` as of the snapshot."""
        changed = self.changed_names()
        self._snapshots.put(version, Snapshot(version=version, base=self.base,
                                              factors={k: v.clone() for k, v in self.factors.items()},
                                              base_changed=changed is None))
        self._base_changed = False
        return changed

    def source(self, version: int, *, whole_adapter: bool = False) -> MergedSource:
        """Refresh the adapter with the snapshot's factors and build the merged source of the owned boxes.

        ``whole_adapter``: the source's adapter is the whole adapter (every expert's terms, as the
        factor-streaming recipes index them), all-gathered from the trainer group — a collective.

        The snapshot is kept until the next ``source`` call, so a send retried after a peer failure
        (to the surviving engines) streams the same values.

        Raises:
            KeyError: no snapshot of ``version``. MergeError: a factor holds NaN or Inf (named).
        """
        snap = self._snapshots.take(version)
        if self.peft_config is None:
            adapter = None
        elif whole_adapter:
            if self._gather is None:
                self._gather = FactorGather(self.spec, num_experts=self.num_experts, group=self.group,
                                            timeout_s=self.gather_timeout_s)
            full = self._gather.gather(snap.factors)  # reused buffers: one source in use at a time
            adapter = adapter_from_state_dict(self.peft_config, full, snap.base.layout, snap.base.metas(),
                                              tied_aliases=snap.base.tied_aliases)
        else:
            adapter = self._local.update(snap.factors, snap.base, rank=self.spec.rank)
        return MergedSource(snap.base, adapter, config=self.merge, owned=snap.base.owned(), layout=snap.base.layout)

    def drop_snapshot(self, version: int) -> None:
        self._snapshots.drop(version)

    def _changed_names(self) -> frozenset[str]:
        if self.peft_config is None:
            return frozenset()
        # structure only: normalise zero-filled full-size factors once (all ranks agree)
        full = {k: torch.zeros(_full_shape(k, v, self.spec, self.num_experts), dtype=v.dtype)
                for k, v in self.factors.items()}
        full.update(_peer_expert_keys(full, self.spec, self.num_experts))
        adapter = adapter_from_state_dict(self.peft_config, full, self.base.layout, self.base.metas(),
                                          tied_aliases=self.base.tied_aliases)
        _check_dora_rows(adapter, self.base, self.spec)
        return adapter.changed_names()


def _check_dora_rows(adapter, base: ShardedBase, spec: ShardSpec) -> None:
    """DoRA scales each output row by m / ‖W + ΔW‖ over the whole row, so a rank must hold whole rows
    of every DoRA tensor it produces (not so for row-parallel TP splits such as o_proj / down_proj).

    Raises:
        MergeError: a DoRA tensor split by columns on this rank, naming it and the fix.
    """
    for m in base.owned():
        if m.name in adapter.dora_magnitudes and m.box is not None and m.box[-1] != (0, m.shape[-1]):
            raise MergeError(
                f"adapter_config use_dora=true: {m.name} is split by columns on trainer rank {spec.rank} "
                f"(box {m.box}, tp={spec.tp}); DoRA needs the norm of whole rows — sync DoRA adapters with tp=1 "
                f"(EP and FSDP keep whole rows) or merge them with PEFT's merge_and_unload")


def _check_expert_ownership(base: ShardedBase, spec: ShardSpec, num_experts: int) -> None:
    """Every fused-expert box this rank produces lies in its own expert block (the factors of the
    other EP ranks' experts are never assembled here)."""
    if spec.ep == 1:
        return
    e_local = num_experts // spec.ep
    lo, hi = spec.ep_rank * e_local, (spec.ep_rank + 1) * e_local
    for m in base.owned():
        if expert_names().fused.search(m.name) and m.box is not None:
            if not (lo <= m.box[0][0] and m.box[0][1] <= hi):
                raise ValueError(f"trainer rank {spec.rank} owns {m.name} experts {m.box[0]} outside its block "
                                 f"[{lo}, {hi}); EP ranks produce only their own experts")


def _full_shape(key: str, t: torch.Tensor, spec: ShardSpec, num_experts: int) -> tuple[int, ...]:
    from sync_service.sharding.ep_factors import factor_kind

    kind = factor_kind(key)
    if kind == "rows":
        return (t.shape[0] * spec.ep, *t.shape[1:])
    if kind == "rank_major":
        return (t.shape[0], t.shape[1] * spec.ep)
    return tuple(t.shape)


def _peer_expert_keys(full: dict[str, torch.Tensor], spec: ShardSpec, num_experts: int) -> dict[str, torch.Tensor]:
    """Legacy per-expert keys of the other EP ranks' experts (zero-filled, same shapes)."""
    out = {}
    for key, t in full.items():
        if expert_names().per_expert.search(key) is None:
            continue
        for e in range(num_experts):
            out.setdefault(expert_names().with_expert(key, e), torch.zeros_like(t))
    return out
