"""Which parts of its LoRA factors a trainer rank holds, as the replica check names them (``sharding/replicas.py``).

The parts of one rank's factors (PEFT keys, as ``LiveState`` holds them), each named so that ranks holding
the same part name it alike:

- a ``DTensor`` factor (FSDP2, HSDP, FSDP2 × TP / EP, TP × EP): one part per global box it holds
  (``placement.dtensor_pieces``), so HSDP's replicate axis and a sub-mesh's copies compare their common boxes;
- a plain factor of an expert-parallel rank that is its own expert block (fused ``lora_A`` rows, fused
  ``lora_B`` rank-major columns, legacy per-expert keys: ``sharding/ep_factors.factor_kind``): the part
  ``"ep block i/ep"``, shared by the TP ranks of that block only;
- any other plain factor (one process, plain replicated ranks, DDP, the non-expert factors under EP or TP,
  modules_to_save copies): the whole tensor, shared by every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from sync_service.live.model import LiveParam
from sync_service.live.placement import dtensor_pieces
from sync_service.sharding.ep_factors import factor_kind
from sync_service.sharding.replicas import ReplicaPart
from sync_service.sharding.rules import ShardSpec

__all__ = ["factor_parts"]

Pick = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]
"""This rank's values of one part, from its local factors by key (a snapshot's copies, or the live views)."""


def _slices(box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def factor_parts(factors: Mapping[str, LiveParam], spec: ShardSpec, ranks: list[int]) -> list[tuple[ReplicaPart, Pick]]:
    """Each part of ``factors`` this rank holds (see the module docstring) and how to pick its values.

    Args:
        factors: PEFT key → the rank's factor (a DTensor on any mesh, an expert block, or whole).
        spec: the rank's place in the ep × tp mesh (``ShardSpec()`` when not expert parallel over plain blocks).
        ranks: the global ranks of weightsync's group, in group order.

    Raises:
        ValueError: a DTensor placement ``placement.dtensor_pieces`` refuses (named).
    """
    out: list[tuple[ReplicaPart, Pick]] = []
    for key, p in factors.items():
        if p.sharded:
            for piece in dtensor_pieces(key, p.param, ranks):
                at = _slices(piece.local_box)
                out.append((ReplicaPart(key, str(piece.global_box)), lambda f, key=key, at=at: f[key][at]))
        elif spec.ep > 1 and factor_kind(key) != "replicated":
            out.append((ReplicaPart(key, f"ep block {spec.ep_rank}/{spec.ep}"), lambda f, key=key: f[key]))
        else:
            out.append((ReplicaPart(key), lambda f, key=key: f[key]))
    return out
