"""Where a Megatron-Core rank's tensors sit in the global (TP = 1) layout, from Megatron's own parallel state and
parameter attributes — no recipe per model.

For every parameter of the rank's model chunks (Megatron-Bridge LoRA included) ``local_placements`` gives a
``Placement``: the global tensor it belongs to (``key``: the ``torch_dist`` key without the stacking, e.g.
``decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight``, layer and expert numbers global), its role
(``"base"``, ``"lora_in"``, ``"lora_out"``), the global shape, and the boxes — ``(start, stop)`` per dim — this
rank's tensor covers, each with the local rows that fill it. Read from:

- the layer: the pipeline stage's ``TransformerLayer.layer_number`` (1-based, global: pipeline offset applied);
- the expert: ``local_experts.<e>`` + this rank's expert-parallel rank × experts per rank (SequentialMLP);
- the split: ``param.tensor_model_parallel`` and ``param.partition_dim`` (Megatron's attributes), over the tensor-
  parallel group for dense parameters and the expert-tensor-parallel group for expert ones (``param.allreduce``
  is False on expert parameters);
- ``linear_fc1`` (gated): a TP shard holds [gate_r; up_r], the global tensor [gate; up]: two boxes, one per half
  (Megatron-Core's ``apply_swiglu_sharded_factory``; the same for the Bridge LoRA's ``linear_out``).

Replicated tensors (norms, the router, every tensor at TP = 1) cover the whole global tensor on every rank of
their group; ``Placement.replica`` says which rank of the group sends it (rank 0 of the tensor-parallel group,
and of the data-parallel group: one sender per box). Grouped-GEMM experts (Transformer Engine) are refused naming
the parameter (``PlacementError``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocols.params import Box

__all__ = ["Box", "Placement", "PlacementError", "local_placements"]



class PlacementError(ValueError):
    """A parameter whose placement weightsync cannot read from Megatron's attributes (the message names it)."""


@dataclass(frozen=True, slots=True)
class Placement:
    """One local parameter: ``pieces`` are (global box, local index) pairs, the local index a tuple of slices."""

    name: str
    key: str
    role: str
    global_shape: tuple[int, ...]
    pieces: tuple[tuple[Box, tuple[slice, ...]], ...]
    sender: bool
    """This rank sends these boxes (exactly one rank per box among the ranks that hold it)."""


_ROLES = ((".adapter.linear_in.weight", "lora_in"), (".adapter.linear_out.weight", "lora_out"))


def _role(name: str) -> tuple[str, str]:
    """(role, the base tensor's local name) of a parameter name."""
    for suffix, role in _ROLES:
        if name.endswith(suffix):
            return role, name[: -len(suffix)] + ".weight"
    return "base", name.replace(".to_wrap.", ".")


def _layer_numbers(chunk) -> dict[str, int]:
    """Local name prefix ``decoder.layers.<i>.`` → global 0-based layer, from each layer's ``layer_number``."""
    layers = getattr(getattr(chunk, "decoder", None), "layers", None) or []
    return {f"decoder.layers.{i}.": int(layer.layer_number) - 1 for i, layer in enumerate(layers)}


def local_placements(chunks) -> list[Placement]:
    """The ``Placement`` of every parameter of this rank's model chunks (``provide_distributed_model``'s list, or one
    ``GPTModel``), in order. Collective-free: reads Megatron's ``parallel_state`` and parameter attributes.

    Raises:
        PlacementError: a grouped-GEMM expert weight, a split on a dim that does not divide, a parameter outside
            the decoder layers' naming that is split.
    """
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    etp, etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    edp_rank = ps.get_expert_data_parallel_rank()
    out = []
    for chunk in (chunks if isinstance(chunks, (list, tuple)) else [chunks]):
        chunk = getattr(chunk, "module", chunk)
        layers = _layer_numbers(chunk)
        for name, param in chunk.named_parameters():
            role, base_name = _role(name)
            expert = ".mlp.experts." in name
            if expert and ".local_experts." not in name:
                raise PlacementError(f"{name}: grouped-GEMM experts (Transformer Engine) are not read yet; build the "
                                     f"model with moe_grouped_gemm=False (SequentialMLP)")
            key = _global_key(base_name, layers, (ep, ep_rank), chunk.config.num_moe_experts, expert)
            size, rank = (etp, etp_rank) if expert else (tp, tp_rank)
            split = bool(getattr(param, "tensor_model_parallel", False)) and size > 1
            dim = int(getattr(param, "partition_dim", -1))
            local = tuple(param.shape)
            shape = list(local)
            if split:
                if dim not in (0, 1):
                    raise PlacementError(f"{name}: tensor_model_parallel with partition_dim {dim}")
                shape[dim] *= size
            full = tuple((0, n) for n in local)
            gated = split and dim == 0 and base_name.endswith("linear_fc1.weight") and role != "lora_in"
            if gated:  # [gate_r; up_r] locally, [gate; up] globally
                half = local[0] // 2
                pieces = tuple((((g * shape[0] // 2 + rank * half, g * shape[0] // 2 + (rank + 1) * half), *full[1:]),
                                (slice(g * half, (g + 1) * half),)) for g in range(2))
            elif split:
                box = list(full)
                box[dim] = (rank * local[dim], (rank + 1) * local[dim])
                pieces = ((tuple(box), ()),)
            else:
                pieces = ((full, ()),)
            sender = (edp_rank if expert else dp_rank) == 0 and (split or rank == 0)
            out.append(Placement(name=name, key=key if role == "base" else key.removesuffix(".weight") + {
                "lora_in": ".adapter.linear_in.weight", "lora_out": ".adapter.linear_out.weight"}[role],
                role=role, global_shape=tuple(shape), pieces=pieces, sender=sender))
    return out


def _global_key(base_name: str, layers: dict[str, int], ep: tuple[int, int], experts: int | None, expert: bool) -> str:
    """``base_name`` with its layer and expert numbers global (``ep``: expert-parallel size, rank)."""
    for prefix, layer in layers.items():
        if base_name.startswith(prefix):
            rest = base_name[len(prefix):]
            if expert:
                head, _, tail = rest.partition("local_experts.")
                local, _, leaf = tail.partition(".")
                rest = f"{head}local_experts.{ep[1] * (experts // ep[0]) + int(local)}.{leaf}"
            return f"decoder.layers.{layer}.{rest}"
    return base_name


def assemble(pieces: list[tuple[Placement, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Global tensors from every rank's (placement, local tensor) pairs: each box filled once, by its sender.

    Raises:
        PlacementError: a global tensor whose boxes leave elements unset or fill one twice."""
    tensors: dict[str, torch.Tensor] = {}
    filled: dict[str, torch.Tensor] = {}
    for placement, local in pieces:
        if not placement.sender:
            continue
        glob = tensors.setdefault(placement.key, torch.zeros(placement.global_shape, dtype=local.dtype))
        mask = filled.setdefault(placement.key, torch.zeros(placement.global_shape, dtype=torch.int8))
        for box, index in placement.pieces:
            region = tuple(slice(a, b) for a, b in box)
            glob[region] = local[index] if index else local
            mask[region] += 1
    bad = sorted(k for k, m in filled.items() if not bool((m == 1).all()))
    if bad:
        raise PlacementError(f"boxes of {bad[:3]} do not tile their global tensors once")
    return tensors
