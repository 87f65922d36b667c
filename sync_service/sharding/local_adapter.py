"""The LoRA adapter of one EP rank's own experts, normalised once and refreshed in place per sync.

An EP rank produces only the boxes of its own expert block ``[off, off + E_local)`` (plus the
replicated tensors), and exactly its own factors feed them: PEFT's packing restricted to a block is
the same packing with ``E_local`` experts (A rows ``e·r + k``, B columns ``k·E_local + e``; see
``sharding/factors.py``). So the rank normalises its local factors against its base metas with
fused expert tensors shrunk to ``E_local`` (legacy per-expert keys renumbered to the block) and
shifts each expert term by ``off``. No collective, no full-size factor anywhere, and nothing is
normalised twice: ``LocalAdapter.update`` copies a snapshot's values into the buffers the adapter
views and re-derives its copies (``LoraAdapter.refresh``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import torch

from sync_service.merge.adapter import LoraAdapter, adapter_from_state_dict
from sync_service.merge.errors import MergeError
from sync_service.merge.finite import all_finite
from sync_service.sharding.base import ShardedBase
from sync_service.sharding.rules import ShardSpec

__all__ = ["LocalAdapter", "FUSED_EXPERTS"]

FUSED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
"""Fused expert tensors [E, ...] (hf-fused naming), EP-sharded along dim 0."""
_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.")


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
        for key, t in factors.items():
            if t.is_floating_point() and not all_finite(t):
                raise MergeError(f"adapter key {key}: holds NaN or Inf values on trainer rank {rank}; "
                                 f"training diverged — the sync is refused and no engine is changed")
        key = tuple(sorted((k, tuple(v.shape), v.dtype) for k, v in factors.items()))
        if key == self._key and self._adapter is not None:
            for k, t in factors.items():
                self._buffers[k].copy_(t)
            self._adapter.refresh()
            return self._adapter
        self._buffers = {k: t.clone() for k, t in factors.items()}
        self._adapter = self.normalise(self._buffers, base)
        self._key = key
        return self._adapter

    def normalise(self, factors: Mapping[str, torch.Tensor], base: ShardedBase) -> LoraAdapter:
        """Normalise ``factors`` (views kept) against ``base`` restricted to this rank's expert block;
        expert terms in global expert ids."""
        ep, e = self.spec.ep, self.num_experts
        if ep == 1 or e == 0:
            return adapter_from_state_dict(self.peft_config, factors, base.layout, base.metas(),
                                           tied_aliases=base.tied_aliases)
        e_local = e // ep
        off = self.spec.ep_rank * e_local
        metas = [dataclasses.replace(m, shape=(e_local, *m.shape[1:])) if FUSED_EXPERTS.search(m.name) else m
                 for m in base.metas()]
        renamed = {_PER_EXPERT.sub(lambda mt: f".experts.{int(mt.group(1)) - off}.", k, count=1): t
                   for k, t in factors.items()}
        adapter = adapter_from_state_dict(self.peft_config, renamed, base.layout, metas, tied_aliases=base.tied_aliases)
        for terms in adapter.terms.values():
            for term in terms:
                if term.experts is not None:
                    term.experts = (term.experts[0] + off, term.experts[1] + off)
        return adapter
