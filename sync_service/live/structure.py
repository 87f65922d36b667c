"""The adapter's structure on one rank, and the checks a rank's shard must pass before any sync.

``structural_adapter`` normalises zero-filled, full-size factors (every expert's terms, PEFT keys as
saved) against the rank's base metas: the terms, selections, ranks and scalings, without values —
what a delta sync's changed names and factor streaming's recipes are planned from. Full sizes come
from the factors this rank holds: a DTensor factor has its global shape; a fused expert factor of an
expert-parallel rank is its block of ``ep`` equal blocks (``sharding/ep_factors.py``); legacy
per-expert keys of the other ranks' experts are filled in with the same shapes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from sync_service.merge.adapter import adapter_from_state_dict
from sync_service.merge.errors import MergeError
from sync_service.merge.layouts import expert_names
from sync_service.merge.terms import LoraAdapter
from sync_service.sharding.base import ShardedBase
from sync_service.sharding.ep_factors import factor_kind
from sync_service.sharding.rules import ShardSpec

__all__ = ["check_dora_rows", "check_expert_ownership", "num_experts_of", "structural_adapter"]


def num_experts_of(base: ShardedBase) -> int:
    """E from the first fused experts tensor (dim 0); 0 for a dense model."""
    for m in base.metas():
        if expert_names().fused.search(m.name):
            return m.shape[0]
    return 0


def structural_adapter(peft_config, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], base: ShardedBase,
                       spec: ShardSpec) -> LoraAdapter:
    """The adapter of zero factors of the full sizes of ``shapes`` (PEFT key → (held shape, dtype)).

    Raises:
        MergeError: no adapter tensors, or the adapter does not fit the base (as ``adapter_from_state_dict``).
    """
    if peft_config is None:
        return LoraAdapter()
    if not shapes:
        raise MergeError("the adapter holds no tensors on this rank (no lora_A/lora_B, trained copy or token "
                         "rows), so there is nothing to merge; attach the model without its adapter config "
                         "(full fine-tuning) or check that get_peft_model targeted its modules")
    num_experts = num_experts_of(base)
    full = {k: torch.zeros(_full_shape(k, shape, spec), dtype=dtype) for k, (shape, dtype) in shapes.items()}
    full.update(_peer_expert_keys(full, num_experts))
    return adapter_from_state_dict(peft_config, full, base.layout, base.metas(), tied_aliases=base.tied_aliases)


def _full_shape(key: str, shape: tuple[int, ...], spec: ShardSpec) -> tuple[int, ...]:
    kind = factor_kind(key)
    if kind == "rows":
        return (shape[0] * spec.ep, *shape[1:])
    if kind == "rank_major":
        return (shape[0], shape[1] * spec.ep)
    return tuple(shape)


def _peer_expert_keys(full: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Legacy per-expert keys of the other EP ranks' experts (zero-filled, same shapes)."""
    out = {}
    for key, t in full.items():
        if expert_names().per_expert.search(key) is None:
            continue
        for e in range(num_experts):
            out.setdefault(expert_names().with_expert(key, e), torch.zeros_like(t))
    return out


def check_dora_rows(adapter: LoraAdapter, base: ShardedBase, spec: ShardSpec, rank: int) -> None:
    """DoRA scales each output row by m / ‖W + ΔW‖ over the whole row, so a rank must hold whole rows
    of every DoRA tensor it produces (not so for row-parallel TP splits such as o_proj / down_proj).

    Raises:
        MergeError: a DoRA tensor split by columns on this rank, naming it and the fix.
    """
    for m in base.owned():
        if m.name in adapter.dora_magnitudes and m.box is not None and m.box[-1] != (0, m.shape[-1]):
            raise MergeError(
                f"adapter_config use_dora=true: {m.name} is split by columns on trainer rank {rank} "
                f"(box {m.box}, tp={spec.tp}); DoRA needs the norm of whole rows — sync DoRA adapters with tp=1 "
                f"(EP and FSDP keep whole rows) or merge them with PEFT's merge_and_unload")


def check_expert_ownership(base: ShardedBase, spec: ShardSpec, num_experts: int) -> None:
    """Every fused-expert box this rank produces lies in its own expert block (the factors of the
    other EP ranks' experts are never assembled here).

    Raises:
        ValueError: a fused-expert box outside the rank's block (named); EP over a family whose experts are
            modules of one 3D weight (``FamilyLayout.weight_experts``, jetmoe) or whose fused expert tensors hold
            different expert counts (longcat_flash's zero-compute experts in ``gate_up_proj`` only).
    """
    if spec.ep == 1:
        return
    layout = getattr(base, "layout", None)
    if getattr(layout, "weight_experts", ()):
        raise ValueError(f"model family {layout.family}: its experts are modules of one 3D weight "
                         f"({', '.join(layout.weight_experts)}); expert parallelism over them is not supported: "
                         f"sync with ep=1")
    counts = dict(sorted((m.name.rpartition(".")[2], m.shape[0]) for m in base.metas() if expert_names().fused.search(m.name)))
    if len(set(counts.values())) > 1:
        raise ValueError(f"fused expert tensors hold different expert counts ({counts}): expert parallelism needs "
                         f"one E on every expert tensor; sync with ep=1")
    e_local = num_experts // spec.ep
    lo, hi = spec.ep_rank * e_local, (spec.ep_rank + 1) * e_local
    for m in base.owned():
        if expert_names().fused.search(m.name) and m.box is not None:
            if not (lo <= m.box[0][0] and m.box[0][1] <= hi):
                raise ValueError(f"trainer rank {spec.rank} owns {m.name} experts {m.box[0]} outside its block "
                                 f"[{lo}, {hi}); EP ranks produce only their own experts")
