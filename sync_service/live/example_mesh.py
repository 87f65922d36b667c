"""Meshes of the example training rank: FSDP2 on any dim, HSDP, and FSDP2 (or HSDP) over TP (gloo, CPU).

``mesh_shape`` gives the data-parallel axes and, with ``tp=True``, a last TP axis: ``(n,)`` FSDP2;
``(r, s)`` HSDP (replicate × shard); ``(s, t)`` FSDP2 × TP; ``(r, s, t)`` HSDP × TP. Ranks are placed
row-major (``init_device_mesh``), so a TP group is ``tp`` consecutive ranks; they see the same batch.

TP as torchtitan applies it, on a PEFT model: ``ColwiseParallel`` on q/k/v (the base ``nn.Linear``
under PEFT's ``base_layer`` and the LoRA ``lora_B`` of a LoRA-wrapped projection: the output dim is
split, ``lora_A`` stays whole), ``RowwiseParallel`` on o; attention then computes its local heads
(transformers reshapes with ``-1`` heads), so the key/value heads must divide by ``tp``. FSDP2 then
shards every parameter over the data-parallel axes: TP parameters become ``(_StridedShard(0), Shard(0))``
or ``(Shard(0), Shard(1))`` on the whole mesh, the others DTensors on the data-parallel sub-mesh.
"""

from __future__ import annotations

__all__ = ["apply_tp", "data_rank", "tp_plan", "wrap_fsdp2"]


def data_rank(rank: int, mesh_shape: tuple[int, ...], tp: bool) -> int:
    """The batch index of ``rank``: the ranks of one TP group share it."""
    return rank // mesh_shape[-1] if tp else rank


def _names(ndim: int, tp: bool) -> tuple[str, ...]:
    data = {1: ("shard",), 2: ("replicate", "shard")}
    return data[ndim - tp] + (("tp",) if tp else ())


def tp_plan(attn, adapter_name: str) -> dict:
    """The ``parallelize_module`` plan of one attention module, PEFT LoRA wrappers included."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        style = RowwiseParallel if proj == "o_proj" else ColwiseParallel
        module = getattr(attn, proj)
        if hasattr(module, "base_layer"):  # a PEFT LoRA layer
            if proj == "o_proj":
                raise ValueError("tp_plan: a LoRA o_proj needs its lora_A split by rows and an all-reduce of its "
                                 "output; leave o_proj out of target_modules under TP")
            plan[f"{proj}.base_layer"] = style()
            plan[f"{proj}.lora_B.{adapter_name}"] = style()
        else:
            plan[proj] = style()
    return plan


def wrap_fsdp2(peft, *, mesh_shape: tuple[int, ...], shard_dim: int = 0, tp: bool = False):
    """Shard ``peft`` in place (TP first when ``tp``, then ``fully_shard`` per decoder layer and the root);
    returns the wrapped model.

    Raises:
        ValueError: a mesh of more than 2 data-parallel axes; key/value heads not divisible by the TP size.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    if not 1 <= len(mesh_shape) - tp <= 2:
        raise ValueError(f"mesh_shape={mesh_shape} (tp={tp}): 1 or 2 data-parallel axes (FSDP2 or HSDP), then TP")
    names = _names(len(mesh_shape), tp)
    mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=names)
    layers = peft.base_model.model.model.layers
    if tp:
        apply_tp(peft, layers, mesh["tp"])
    dp = mesh if not tp else mesh[names[0]] if len(names) == 2 else mesh[names[:2]]  # the data-parallel axes
    split = dp.size(dp.ndim - 1)  # FSDP2 shards on its last axis and refuses uneven splits of dim > 0
    place = None if shard_dim == 0 else (
        lambda p: Shard(shard_dim) if p.dim() > shard_dim and p.shape[shard_dim] % split == 0 else Shard(0))
    for layer in layers:
        fully_shard(layer, mesh=dp, shard_placement_fn=place)
    return fully_shard(peft, mesh=dp)


def apply_tp(peft, layers, tp_mesh) -> None:
    """``parallelize_module`` of every layer's attention over ``tp_mesh`` (``tp_plan``).

    Raises:
        ValueError: key/value heads not divisible by the TP size.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    config = peft.get_base_model().config
    if config.num_key_value_heads % tp_mesh.size():
        raise ValueError(f"wrap_fsdp2: {config.num_key_value_heads} key/value heads do not split over tp="
                         f"{tp_mesh.size()}; use a model whose key/value heads divide by the TP size")
    for layer in layers:
        parallelize_module(layer.self_attn, tp_mesh, tp_plan(layer.self_attn, peft.active_adapter))
