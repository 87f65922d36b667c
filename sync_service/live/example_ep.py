"""Expert parallelism over DTensors, as torchtitan builds it: FSDP2 × EP and TP × EP (gloo, CPU).

Legend: T tokens of this rank, E experts, E_local = E / ep, H hidden, I expert intermediate, r LoRA
rank, k experts per token.

Meshes (``init_device_mesh``, row-major ranks):

- FSDP2 × EP, ``("dp", "ep")``: every fused expert tensor — base ``gate_up_proj`` [E, 2I, H] /
  ``down_proj`` [E, H, I] and their LoRA factors — is a DTensor on the ``ep`` sub-mesh holding its
  expert block, then ``fully_shard`` over ``dp`` (torchtitan's ``dp_shard_mod_ep``) on dim 0: the
  experts end up ``(_StridedShard(0), Shard(0))`` on the whole mesh. Every other parameter is
  ``fully_shard``-ed over the flattened ``dp × ep`` mesh (all ranks: torchtitan's ``dp_shard``); every
  rank reads its own batch.
- TP × EP, ``("ep", "tp")``: attention TP on ``tp`` (``example_mesh.tp_plan``), the experts on the
  ``ep`` sub-mesh as above (the ``tp`` ranks of an ep rank hold the same experts); the ranks of one TP
  group read the same batch, and the non-expert gradients are averaged over ``ep`` by hand.

Expert factors follow PEFT's ``target_parameters`` layout (``lora_A`` [r·E, in]: rows expert-major, so
``Shard(0)``; ``lora_B`` [out, r·E]: columns rank-major, k·E + e, so an expert block's columns are r
strided runs: ``_StridedShard(1, split_factor=r)``); each rank's local tensors are exactly PEFT's
factors of a module holding E_local experts.

The forward over local experts (``ep_experts_forward``, replacing the experts module's forward): the
ep group's tokens, routes and router weights are all-gathered, each rank applies its E_local experts
(base + LoRA from its local tensors) to the tokens routed to them, weighted by the router, and an
all-reduce sums the experts' contributions; every collective a gradient flows through is
``torch.distributed.nn.functional`` (autograd-aware), so the router, attention and every expert
learn. No all-to-all dispatch: every rank of the group sees the group's tokens (small and clear,
not fast). An expert's gradient sums the ep group's batches, so the
forward scales it by 1/ep (a hook on the effective weight: FSDP2's ``set_gradient_divide_factor``
needs PREMUL_SUM, which gloo lacks); data parallelism then averages it like any other.
"""

from __future__ import annotations

import torch

__all__ = ["EP_MESHES", "average_grads_over_ep", "build_ep", "ep_data_rank"]

EP_MESHES = {"fsdp2": ("dp", "ep"), "tp": ("ep", "tp")}
"""The example's EP meshes: ``ep_kind`` → mesh axis names."""


def ep_data_rank(rank: int, mesh_shape: tuple[int, ...], ep_kind: str) -> int:
    """The batch index of ``rank``: every rank under FSDP2 × EP, the TP group under TP × EP."""
    return rank // mesh_shape[-1] if ep_kind == "tp" else rank


def _wrappers(experts) -> dict[str, torch.nn.Module]:
    """PEFT's nested ``ParamWrapper``s of one experts module, by the parameter each adapts."""
    out = {}
    module = experts
    while hasattr(module, "parameter_name"):
        out[module.parameter_name] = module
        module = module.base_layer
    return out


def _distribute(wrapper, adapter: str, ep_mesh) -> None:
    """The wrapped base [E, out, in] and its factors → DTensors of this rank's expert block on ``ep_mesh``."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    ep, j = ep_mesh.size(), ep_mesh.get_local_rank()
    r = wrapper.r[adapter]
    holder, name = wrapper.get_base_layer(), wrapper.parameter_name
    base = getattr(holder, name)
    e_local = base.shape[0] // ep
    a, b = wrapper.lora_A[adapter], wrapper.lora_B[adapter]
    out = b.weight.shape[0]
    block = slice(j * e_local, (j + 1) * e_local)
    locals_ = {
        (holder, name, (Shard(0),)): base.detach()[block],
        (a, "weight", (Shard(0),)): a.weight.detach()[j * r * e_local:(j + 1) * r * e_local],
        (b, "weight", (_StridedShard(1, split_factor=r),)): b.weight.detach().view(out, r, -1)[:, :, block]
        .reshape(out, r * e_local),
    }
    for (module, leaf, placements), local in locals_.items():
        whole = getattr(module, leaf)
        dt = DTensor.from_local(local.contiguous().clone(), ep_mesh, placements, run_check=False,
                                shape=whole.shape, stride=whole.stride())
        setattr(module, leaf, torch.nn.Parameter(dt, requires_grad=whole.requires_grad))


def _local_weight(wrapper, adapter: str, ep: int) -> torch.Tensor:
    """This rank's experts' effective weight [E_local, out, in] in the base's dtype: base + s·B[:, :, e] @ A[e]
    (PEFT's delta, cast to the base's dtype as ``ParamWrapper.get_delta_weight`` does);
    its gradient is scaled by 1/ep (the module docstring)."""
    base = getattr(wrapper.get_base_layer(), wrapper.parameter_name).to_local()
    a = wrapper.lora_A[adapter].weight.to_local()
    b = wrapper.lora_B[adapter].weight.to_local()
    e_local = base.shape[0]
    delta = torch.einsum("ore,eri->eoi", b.view(b.shape[0], -1, e_local), a.view(e_local, -1, a.shape[-1]))
    weight = base + (delta * wrapper.scaling[adapter]).to(base.dtype)  # PEFT's order and cast (fp32 factors, bf16 base)
    if weight.requires_grad:
        weight.register_hook(lambda grad: grad / ep)
    return weight


def _gather_rows(x: torch.Tensor, j: int, ep: int, group) -> torch.Tensor:
    """The ep group's ``x`` stacked by rank ([ep·T, ...]), autograd-aware: an all-reduce of ``x`` placed in
    zero rows (its backward sums the gradient over the group and keeps this rank's rows). torch's
    ``functional.all_gather`` is not used: its gloo backward scatters from global ranks, which fails
    on a sub-group."""
    import torch.distributed.nn.functional as fdist

    return fdist.all_reduce(torch.cat([x if i == j else torch.zeros_like(x) for i in range(ep)]), group=group)


def ep_experts_forward(experts, adapter: str, ep_mesh):
    """The forward of one experts module over its local experts (see the module docstring):
    ``(hidden [T, H], top_k_index [T, k] int64, top_k_weights [T, k]) → [T, H]``; every rank of the ep
    group calls it with the same T."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as fdist

    group, ep, j = ep_mesh.get_group(), ep_mesh.size(), ep_mesh.get_local_rank()
    wrappers = _wrappers(experts)
    act = experts.get_base_layer().act_fn

    def forward(hidden, top_k_index, top_k_weights):
        n = hidden.shape[0]
        hs = _gather_rows(hidden, j, ep, group)  # [ep·T, H]
        weights = _gather_rows(top_k_weights, j, ep, group)  # [ep·T, k]
        index = [torch.empty_like(top_k_index) for _ in range(ep)]
        dist.all_gather(index, top_k_index.contiguous(), group=group)
        gate_up = _local_weight(wrappers["gate_up_proj"], adapter, ep)  # [E_local, 2I, H]
        down = _local_weight(wrappers["down_proj"], adapter, ep)  # [E_local, H, I]
        e0, routes = j * gate_up.shape[0], torch.cat(index)
        out = torch.zeros_like(hs)
        for e in range(gate_up.shape[0]):
            token, pos = torch.where(routes == e0 + e)
            gate, up = torch.nn.functional.linear(hs[token], gate_up[e]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(act(gate) * up, down[e]) * weights[token, pos, None]
            out = out.index_add(0, token, y.to(out.dtype))
        return fdist.all_reduce(out, group=group)[j * n:(j + 1) * n]

    return forward


def build_ep(peft, *, mesh_shape: tuple[int, int], ep_kind: str = "fsdp2"):
    """Shard ``peft`` in place for expert parallelism on a 2-D mesh (``EP_MESHES[ep_kind]`` axes of
    ``mesh_shape``); returns ``(model, mesh)``: the wrapped model and the mesh.

    Raises:
        ValueError: an unknown ``ep_kind``; LoRA not on both fused expert tensors; experts or key/value heads
            that do not split over the mesh.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if ep_kind not in EP_MESHES or len(mesh_shape) != 2:
        raise ValueError(f"build_ep: ep_kind={ep_kind!r}, mesh_shape={mesh_shape}; use one of {sorted(EP_MESHES)} "
                         f"with a 2-D mesh_shape")
    mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=EP_MESHES[ep_kind])
    layers = peft.base_model.model.model.layers
    ep_mesh, adapter = mesh["ep"], peft.active_adapter
    for layer in layers:
        experts = layer.mlp.experts
        _check_experts(experts, ep_mesh.size())
        for wrapper in _wrappers(experts).values():
            _distribute(wrapper, adapter, ep_mesh)
        experts.forward = ep_experts_forward(experts, adapter, ep_mesh)
    return (_fsdp2_ep if ep_kind == "fsdp2" else _tp_ep)(peft, layers, mesh), mesh


def _check_experts(experts, ep: int) -> None:
    """Raises ValueError unless PEFT wraps both fused expert tensors and their experts split over ``ep``."""
    wrapped = sorted(_wrappers(experts))
    if wrapped != ["down_proj", "gate_up_proj"]:
        raise ValueError(f"build_ep: LoRA wraps {wrapped} of the fused experts; the example's EP forward needs "
                         f"target_parameters on both mlp.experts.gate_up_proj and mlp.experts.down_proj")
    if experts.get_base_layer().num_experts % ep:
        raise ValueError(f"build_ep: {experts.get_base_layer().num_experts} experts do not split over ep={ep}; use "
                         f"a model whose expert count divides by the ep size")


def _fsdp2_ep(peft, layers, mesh):
    from torch.distributed.fsdp import fully_shard

    flat = mesh["dp", "ep"]._flatten("dp_ep")  # torchtitan's dp_shard: every rank
    for layer in layers:
        fully_shard(layer.mlp.experts, mesh=mesh["dp"])
        fully_shard(layer, mesh=flat)
    return fully_shard(peft, mesh=flat)


def _tp_ep(peft, layers, mesh):
    from sync_service.live.example_mesh import apply_tp

    apply_tp(peft, layers, mesh["tp"])
    return peft


def average_grads_over_ep(peft, mesh) -> None:
    """TP × EP, after ``backward``: the non-expert gradients averaged over the ``ep`` axis (data parallel
    there; gloo has no AVG), local tensors of DTensors alike."""
    import torch.distributed as dist

    group, ep = mesh["ep"].get_group(), mesh["ep"].size()
    for name, p in peft.named_parameters():
        if p.grad is not None and ".experts." not in name:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(grad, group=group)
            grad.div_(ep)
