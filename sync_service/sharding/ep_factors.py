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

from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from sync_service.merge.layouts import expert_names
from sync_service.sharding.rules import ShardSpec

__all__ = ["FactorGather", "factor_kind", "local_factors", "gather_factors"]

_NAMES = expert_names()


def factor_kind(key: str) -> str:
    """``"rows"`` (fused A), ``"rank_major"`` (fused B), ``"expert"`` (legacy per-expert) or ``"replicated"``."""
    if _NAMES.lora_a.search(key):
        return "rows"
    if _NAMES.lora_b.search(key):
        return "rank_major"
    if _NAMES.per_expert.search(key):
        return "expert"
    return "replicated"


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
            if int(_NAMES.per_expert.search(key).group(1)) // e_local == er:
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
    ``timeout_s`` per collective. With ``spec.ep == 1`` no communication happens (returns copies).
    A trainer that syncs every step keeps a ``FactorGather`` instead (buffers reused).

    Raises:
        RuntimeError: a collective did not complete within ``timeout_s``.
    """
    return dict(FactorGather(spec, num_experts=num_experts, group=group, timeout_s=timeout_s).gather(local))


class FactorGather:
    """All-gathers one trainer rank's EP-sharded factors into full-size PEFT factors, in reused buffers.

    Per ``gather``: the rank's fused expert factors are packed into one flat buffer and all-gathered
    in one collective (per dtype), then copied into the full factors; legacy per-expert factors are
    broadcast from their owners; replicated factors are copied. Buffers are allocated on the first
    call and whenever the key structure (keys, shapes, dtypes) changes. (A trainer merging its own
    expert block needs none of this: ``local_adapter.py``. Factor streaming uses it: its recipes
    index the whole adapter.)

    Collective (``ep > 1``): every rank of ``group`` calls ``gather`` with the same key structure.
    """

    def __init__(self, spec: ShardSpec, *, num_experts: int, group: dist.ProcessGroup | None, timeout_s: float) -> None:
        if spec.ep > 1 and num_experts % spec.ep:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep={spec.ep}")
        self.spec, self.num_experts, self.group = spec, num_experts, group
        self.timeout = timedelta(seconds=timeout_s)
        self._structure: tuple | None = None
        self._full: dict[str, torch.Tensor] = {}
        self._flat: dict[torch.dtype, tuple[list[str], torch.Tensor, torch.Tensor]] = {}  # dtype → (keys, send, recv [world, n])

    def gather(self, local: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The full factors of ``local`` (this rank's part); the returned tensors are overwritten by the
        next call. Blocks at most ``timeout_s`` per collective.

        Raises:
            RuntimeError: a collective did not complete within ``timeout_s``.
        """
        structure = tuple(sorted((k, tuple(v.shape), v.dtype) for k, v in local.items()))
        if structure != self._structure:
            self._allocate(local)
            self._structure = structure
        if self.spec.ep > 1:
            for keys, send, recv in self._flat.values():
                self._all_gather(keys, send, recv, local)
            for key, buf in _broadcast_expert_keys(local, self.spec, self.num_experts // self.spec.ep, self.group,
                                                   self.timeout).items():
                self._full[key].copy_(buf)
        for key, t in local.items():
            if self.spec.ep == 1 or factor_kind(key) == "replicated":
                self._full[key].copy_(t)
        return self._full

    def _place(self, key: str, ep_rank: int, part: torch.Tensor) -> None:
        """Copy EP rank ``ep_rank``'s part of the fused factor ``key`` into the full factor."""
        shape = part.shape
        if factor_kind(key) == "rows":
            self._full[key][ep_rank * shape[0]:(ep_rank + 1) * shape[0]].copy_(part)
        else:
            e_local = self.num_experts // self.spec.ep
            r = shape[1] // e_local
            dst = self._full[key].view(shape[0], r, self.num_experts)[:, :, ep_rank * e_local:(ep_rank + 1) * e_local]
            dst.copy_(part.view(shape[0], r, e_local))

    def _allocate(self, local: Mapping[str, torch.Tensor]) -> None:
        spec, e = self.spec, self.num_experts
        full, flat = {}, {}
        for key in sorted(local):
            t, kind = local[key], factor_kind(key) if spec.ep > 1 else "replicated"
            if kind == "rows":
                full[key] = torch.empty((t.shape[0] * spec.ep, *t.shape[1:]), dtype=t.dtype, device=t.device)
            elif kind == "rank_major":
                full[key] = torch.empty((t.shape[0], t.shape[1] * spec.ep), dtype=t.dtype, device=t.device)
            elif kind == "replicated":
                full[key] = torch.empty_like(t)
            if kind in ("rows", "rank_major"):
                flat.setdefault(t.dtype, []).append(key)
        if spec.ep > 1:
            full.update({k: torch.empty_like(v) for k, v in _expert_key_shapes(local, spec, e // spec.ep).items()})
        self._full = full
        self._flat = {}
        for dtype, keys in flat.items():
            n, device = sum(local[k].numel() for k in keys), local[keys[0]].device  # the factors' device (the group's)
            self._flat[dtype] = (keys, torch.empty(n, dtype=dtype, device=device),
                                 torch.empty((spec.world_size, n), dtype=dtype, device=device))

    def _all_gather(self, keys: list[str], send: torch.Tensor, recv: torch.Tensor, local) -> None:
        spec = self.spec
        offset = 0
        for key in keys:
            n = local[key].numel()
            send[offset:offset + n].view(local[key].shape).copy_(local[key])
            offset += n
        dist.all_gather(list(recv.unbind(0)), send, group=self.group, async_op=True).wait(self.timeout)
        offset = 0
        for key in keys:
            shape, n = local[key].shape, local[key].numel()
            for er in range(spec.ep):  # one part per EP rank (TP ranks of one EP rank hold equal factors)
                self._place(key, er, recv[er * spec.tp, offset:offset + n].view(shape))
            offset += n


def _expert_keys_by_rank(local, spec: ShardSpec, e_local: int) -> list[tuple[int, str, str]]:
    """Legacy per-expert keys: ``(ep_rank, own key, that rank's key)`` for every EP rank, in one order
    on all ranks. Every EP rank holds the same per-expert key set for its own experts, so a peer's
    keys are this rank's renumbered into the peer's block."""
    mine = sorted(k for k in local if factor_kind(k) == "expert")
    if not mine:
        return []
    first = min(int(_NAMES.per_expert.search(k).group(1)) for k in mine)
    return [(er, key, _NAMES.with_expert(key, int(_NAMES.per_expert.search(key).group(1)) - first + er * e_local))
            for er in range(spec.ep) for key in mine]


def _expert_key_shapes(local, spec: ShardSpec, e_local: int) -> dict[str, torch.Tensor]:
    """Legacy per-expert keys of every EP rank's experts → a local factor of the same shape."""
    return {peer: local[own] for _, own, peer in _expert_keys_by_rank(local, spec, e_local)}


def _broadcast_expert_keys(local, spec, e_local, group, timeout) -> dict[str, torch.Tensor]:
    """Legacy per-expert factors: each broadcast from the first rank of its owning EP block."""
    out = {}
    for er, own, peer in _expert_keys_by_rank(local, spec, e_local):
        buf = local[own].clone() if er == spec.ep_rank else torch.empty_like(local[own])
        src = er * spec.tp
        dist.broadcast(buf, src=dist.get_global_rank(group, src) if group is not None else src,
                       group=group, async_op=True).wait(timeout)
        out[peer] = buf
    return out
