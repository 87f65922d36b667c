"""LoRA factors under expert parallelism: which part a rank trains, and the all-gather before a merge.

Factors are small (r ≪ H), so each rank gathers the *factors* it needs — never the base — and merges
its own base shard locally. Keys are PEFT state-dict keys (``get_peft_model_state_dict`` /
``adapter_model.safetensors``). Layouts (PEFT ``target_parameters`` on a fused 3D param [E, out, in]):

- ``experts[.base_layer].lora_A.weight`` [r·E, in], rows expert-major (e·r + k): an EP rank holds the
  contiguous rows of its experts; gathered by concatenating dim 0.
- ``experts[.base_layer].lora_B.weight`` [out, r·E], columns rank-major (k·E + e): an EP rank holds
  ``B.view(out, r, E)[:, :, its experts]`` as [out, r·E_local]; gathered along the expert dim.
- legacy per-expert keys (``experts.N.gate_proj.lora_A.weight``, Mixtral ``experts.N.w1...``): held by
  the EP rank of expert N; broadcast from it.
- everything else (attention / dense LoRA, modules_to_save) is replicated across ranks, as data
  parallel training keeps it; under TP the factors are replicated too (they are r-thin), so a TP
  group needs no gather.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from sync_service.sharding.rules import ShardSpec

__all__ = ["factor_kind", "local_factors", "gather_factors"]

_FUSED_A = re.compile(r"\.experts\.(base_layer\.)?lora_A\.weight$")
_FUSED_B = re.compile(r"\.experts\.(base_layer\.)?lora_B\.weight$")
_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def factor_kind(key: str) -> str:
    """``"rows"`` (fused A), ``"rank_major"`` (fused B), ``"expert"`` (legacy per-expert) or ``"replicated"``."""
    if _FUSED_A.search(key):
        return "rows"
    if _FUSED_B.search(key):
        return "rank_major"
    if _PER_EXPERT.search(key):
        return "expert"
    return "replicated"


def _num_experts(state: Mapping[str, torch.Tensor]) -> int:
    ids = [int(m.group(1)) for k in state if (m := _PER_EXPERT.search(k))]
    return max(ids) + 1 if ids else 0


def local_factors(full: Mapping[str, torch.Tensor], spec: ShardSpec, *, num_experts: int) -> dict[str, torch.Tensor]:
    """The part of a full PEFT state dict that EP rank ``spec.ep_rank`` trains (copies).

    Raises:
        ValueError: a fused factor's expert dim is not ``r·num_experts`` or not divisible by ``spec.ep``.
    """
    ep, er = spec.ep, spec.ep_rank
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep={ep}")
    e_local = num_experts // ep
    out = {}
    for key, t in full.items():
        kind = factor_kind(key)
        if kind == "rows":
            r = _rank_of(key, t.shape[0], num_experts)
            out[key] = t[er * e_local * r:(er + 1) * e_local * r].clone()
        elif kind == "rank_major":
            r = _rank_of(key, t.shape[1], num_experts)
            view = t.reshape(t.shape[0], r, num_experts)[:, :, er * e_local:(er + 1) * e_local]
            out[key] = view.reshape(t.shape[0], r * e_local).clone()
        elif kind == "expert":
            if int(_PER_EXPERT.search(key).group(1)) // e_local == er:
                out[key] = t.clone()
        else:
            out[key] = t.clone()
    return out


def _rank_of(key: str, n: int, num_experts: int) -> int:
    if n % num_experts:
        raise ValueError(f"{key!r}: expert dim {n} is not r·E for E={num_experts}")
    return n // num_experts


def gather_factors(local: Mapping[str, torch.Tensor], spec: ShardSpec, *, num_experts: int,
                   group: dist.ProcessGroup | None, timeout_s: float) -> dict[str, torch.Tensor]:
    """All-gather the EP-sharded factors into a full PEFT state dict (new tensors; ``local`` untouched).

    Collective: every rank of ``group`` calls it with the same key structure. Blocks at most
    ``timeout_s`` per collective. With ``spec.ep == 1`` no communication happens (returns clones).

    Raises:
        RuntimeError: a collective did not complete within ``timeout_s``.
    """
    if spec.ep == 1:
        return {k: v.clone() for k, v in local.items()}
    ep, e_local, tp = spec.ep, num_experts // spec.ep, spec.tp
    timeout = timedelta(seconds=timeout_s)
    out: dict[str, torch.Tensor] = {}
    for key in sorted(k for k in local if factor_kind(k) in ("rows", "rank_major")):
        t = local[key].contiguous()
        parts = [torch.empty_like(t) for _ in range(spec.world_size)]
        dist.all_gather(parts, t, group=group, async_op=True).wait(timeout)
        parts = parts[::tp]  # one per EP rank (TP ranks of one EP rank hold equal factors)
        if factor_kind(key) == "rows":
            out[key] = torch.cat(parts, dim=0)
        else:
            r = t.shape[1] // e_local
            out[key] = torch.cat([p.reshape(t.shape[0], r, e_local) for p in parts], dim=2).reshape(t.shape[0], r * num_experts)
    out.update(_broadcast_expert_keys(local, spec, e_local, group, timeout))
    for key, t in local.items():
        if factor_kind(key) == "replicated":
            out[key] = t.clone()
    return out


def _broadcast_expert_keys(local, spec, e_local, group, timeout) -> dict[str, torch.Tensor]:
    """Legacy per-expert factors: each broadcast from the first rank of its owning EP block."""
    mine = {k: v for k, v in local.items() if factor_kind(k) == "expert"}
    if not mine:
        return {}
    # every EP rank holds the same per-expert key set for its own experts: rename to find peers' keys
    first = min(int(_PER_EXPERT.search(k).group(1)) for k in mine)
    out = {}
    for er in range(spec.ep):
        for key, t in sorted(mine.items()):
            e = int(_PER_EXPERT.search(key).group(1))
            peer_e = e - first + er * e_local
            peer_key = _PER_EXPERT.sub(f".experts.{peer_e}.", key, count=1)
            buf = t.clone() if er == spec.ep_rank else torch.empty_like(t)
            src = er * spec.tp
            dist.broadcast(buf, src=dist.get_global_rank(group, src) if group is not None else src,
                           group=group, async_op=True).wait(timeout)
            out[peer_key] = buf
    return out
