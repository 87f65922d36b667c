"""The LoRA adapter of one EP rank's own experts, normalised once and refreshed in place per sync.

An EP rank produces only the boxes of its own expert block ``[off, off + E_local)`` (plus the
replicated tensors), and exactly its own factors feed them: PEFT's packing restricted to a block is
the same packing with ``E_local`` experts (A rows ``e·r + k``, B columns ``k·E_local + e``; see
``sharding/ep_factors.py``). So the rank normalises its local factors against its base metas with
fused expert tensors shrunk to ``E_local`` and shifts each expert term by ``off`` (legacy
per-expert keys are already in global expert ids and need neither). No collective, no full-size
factor anywhere, and nothing is normalised twice: ``LocalAdapter.update`` copies a snapshot's values
into the buffers the adapter views and re-derives its copies (``LoraAdapter.refresh``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from sync_service.merge.adapter import adapter_from_state_dict
from sync_service.merge.errors import MergeError
from sync_service.merge.finite import nonfinite_keys
from sync_service.merge.layouts import expert_names
from sync_service.merge.terms import LoraAdapter
from sync_service.sharding.base import ShardedBase
from sync_service.sharding.ep_factors import factor_kind
from sync_service.sharding.rules import ShardSpec

__all__ = ["LocalAdapter"]


class LocalAdapter:
    """One rank's adapter over reused copies of its local factors (see the module docstring).

    Args:
        peft_config: the adapter's ``peft.LoraConfig``.
        spec: the rank's place in the ep × tp mesh.
        num_experts: E (global); 0 for a dense model.
    """

    def __init__(self, peft_config, spec: ShardSpec, num_experts: int) -> None:
        self.peft_config, self.spec, self.num_experts = peft_config, spec, num_experts
        self._key: tuple | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._adapter: LoraAdapter | None = None

    def update(self, factors: Mapping[str, torch.Tensor], base: ShardedBase, *, rank: int) -> LoraAdapter:
        """The adapter with ``factors``' values (this rank's PEFT keys). Normalised against ``base`` on
        the first call and whenever the key structure changes (the base's metas never change, only its
        values); otherwise refreshed in place, so the adapter returned before changes too (sends run
        one at a time).

        Raises:
            MergeError: a factor holds NaN or Inf (named), or the adapter does not fit the base.
        """
        for key in nonfinite_keys(factors)[:1]:  # device factors: one host synchronization for all of them
            raise MergeError(f"adapter key {key}: holds NaN or Inf values on trainer rank {rank}; "
                             f"training diverged — the sync is refused and no engine is changed")
        key = tuple(sorted((k, tuple(v.shape), v.dtype) for k, v in factors.items()))
        if key == self._key and self._adapter is not None:
            for k, t in factors.items():
                self._buffers[k].copy_(t)
            self._adapter.refresh()
            return self._adapter
        buffers = {k: t.clone() for k, t in factors.items()}
        adapter = self.normalise(buffers, base)  # kept only once it normalised
        self._buffers, self._adapter, self._key = buffers, adapter, key
        return adapter

    def normalise(self, factors: Mapping[str, torch.Tensor], base: ShardedBase) -> LoraAdapter:
        """Normalise ``factors`` (views kept) against ``base`` restricted to this rank's expert block;
        expert terms in global expert ids.

        Fused expert factors (``target_parameters``) are normalised against the fused tensors shrunk
        to E_local and shifted by the block offset; a modules_to_save copy of a fused expert tensor is
        cut to the block. Legacy per-expert keys keep their global names (so rank_pattern /
        alpha_pattern keyed on expert ids match as in PEFT) and the metas stay global.

        Raises:
            MergeError: as ``adapter_from_state_dict``; an adapter mixing fused and per-expert expert
                factors under ep > 1.
        """
        ep, e = self.spec.ep, self.num_experts
        kinds = {factor_kind(k) for k in factors}
        if ep == 1 or e == 0 or "expert" in kinds:
            if ep > 1 and kinds & {"rows", "rank_major"}:
                raise MergeError("the adapter has both fused (target_parameters) and per-expert expert factors; "
                                 "sync it with ep=1 or re-save it with one expert layout")
            return adapter_from_state_dict(self.peft_config, factors, base.layout, base.metas(),
                                           tied_aliases=base.tied_aliases)
        e_local = e // ep
        off = self.spec.ep_rank * e_local
        metas = [dataclasses.replace(m, shape=(e_local, *m.shape[1:])) if expert_names().fused.search(m.name) else m
                 for m in base.metas()]
        local = {k: _block_of_copy(k, t, e, off, e_local) for k, t in factors.items()}
        adapter = adapter_from_state_dict(self.peft_config, local, base.layout, metas, tied_aliases=base.tied_aliases)
        whole = {id(local[k]): t for k, t in factors.items() if local[k] is not t}
        for name, copy in adapter.replacements.items():  # the merge indexes replacements by global box
            adapter.replacements[name] = whole.get(id(copy), copy)
        for terms in adapter.terms.values():
            for term in terms:
                if term.experts is not None:
                    term.experts = (term.experts[0] + off, term.experts[1] + off)
        return adapter


def _block_of_copy(key: str, t: torch.Tensor, num_experts: int, off: int, e_local: int) -> torch.Tensor:
    """A modules_to_save copy of a fused expert tensor [E, ...] → this rank's block (a view, for the
    shape check against the shrunk metas); else ``t``."""
    if ".lora_" not in key and expert_names().fused.search(key) and t.dim() >= 1 and t.shape[0] == num_experts:
        return t[off:off + e_local]
    return t
