"""Megatron-Core parameter names → the HF checkpoint names of the model it was converted from.

The table is Megatron-Bridge 0.6.2's mapping for Qwen3-MoE (``megatron/bridge/models/qwen/qwen3_moe_bridge.py``,
``Qwen3MoEBridge.mapping_registry``: ``AutoMapping`` rows, ``QKVMapping`` for ``linear_qkv``, ``GatedMLPMapping``
for the experts' ``linear_fc1``) and Qwen2-MoE's shared expert (``qwen2_moe_bridge.py``), written as data
because the Bridge's module does not import without Transformer Engine and Python 3.12 (its
``megatron.bridge`` package imports ``transformer_engine`` and ``typing.override``); ``tests/megatron``
checks every row against the installed Bridge's ``mapping_registry()``. Names are per layer: ``{L}`` the
layer, ``{E}`` the expert; a ``torch_dist`` checkpoint stacks ``decoder.layers.<rest>`` over layers (dim 0)
and ``…experts.experts.<rest>`` over experts (dim 1), whatever TP / EP / PP it was saved with.

Kinds (``Row.kind``), the layouts as Megatron-Core holds them (TP = 1, or a ``torch_dist`` global tensor):

- ``"plain"``: the same tensor under another name.
- ``"qkv"``: ``linear_qkv`` [(nh + 2·ng)·d, H], rows per query group g: the group's nh/ng query heads, then
  its key head, then its value head (``split_qkv_weights`` in ``param_mapping.py``) → ``q_proj`` [nh·d, H],
  ``k_proj`` / ``v_proj`` [ng·d, H].
- ``"gated"``: ``linear_fc1`` [2·I, H] = [gate; up] → ``gate_proj``, ``up_proj`` [I, H] (at TP > 1 each rank's
  shard is [gate_r; up_r]; a ``torch_dist`` global tensor is [gate; up]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LAYER_ROWS", "EXPERT_ROWS", "TOP_ROWS", "Row", "split_qkv", "split_gated", "split"]


@dataclass(frozen=True, slots=True)
class Row:
    """One Megatron tensor (``megatron``, relative to its layer / expert) → its HF tensors (``hf``, in order)."""

    megatron: str
    hf: tuple[str, ...]
    kind: str = "plain"


TOP_ROWS: tuple[Row, ...] = (
    Row("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
    Row("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Row("output_layer.weight", ("lm_head.weight",)),
)
# decoder.layers.{L}.<megatron> → model.layers.{L}.<hf>
LAYER_ROWS: tuple[Row, ...] = (
    Row("self_attention.linear_qkv.layer_norm_weight", ("input_layernorm.weight",)),
    Row("input_layernorm.weight", ("input_layernorm.weight",)),
    Row("self_attention.linear_qkv.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                             "self_attn.v_proj.weight"), "qkv"),
    Row("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",)),
    Row("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",)),
    Row("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",)),
    Row("mlp.linear_fc1.layer_norm_weight", ("post_attention_layernorm.weight",)),
    Row("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",)),
    Row("mlp.router.weight", ("mlp.gate.weight",)),
    Row("mlp.shared_experts.linear_fc1.weight", ("mlp.shared_expert.gate_proj.weight",
                                                "mlp.shared_expert.up_proj.weight"), "gated"),
    Row("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_expert.down_proj.weight",)),
    Row("mlp.shared_experts.gate_weight", ("mlp.shared_expert_gate.weight",)),
)
# decoder.layers.{L}.mlp.experts.local_experts.{E}.<megatron> → model.layers.{L}.mlp.experts.{E}.<hf>
EXPERT_ROWS: tuple[Row, ...] = (
    Row("linear_fc1.weight", ("gate_proj.weight", "up_proj.weight"), "gated"),
    Row("linear_fc2.weight", ("down_proj.weight",)),
)


def split_qkv(qkv: torch.Tensor, *, heads: int, groups: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """``linear_qkv`` rows [(heads + 2·groups)·head_dim, ...] (per query group: its queries, key, value) →
    (q [heads·head_dim, ...], k, v [groups·head_dim, ...]); views where the layout allows. Works on the
    base weight and on the LoRA ``linear_out`` [rows, dim] alike.

    Raises:
        ValueError: the rows are not (heads + 2·groups)·head_dim, or heads is not a multiple of groups.
    """
    per = heads // groups if groups and heads % groups == 0 else 0
    if not per or qkv.shape[0] != (heads + 2 * groups) * head_dim:
        raise ValueError(f"linear_qkv has {qkv.shape[0]} rows; want (heads {heads} + 2 x groups {groups}) x "
                         f"head_dim {head_dim} with heads a multiple of groups")
    grouped = qkv.reshape(groups, per + 2, head_dim, *qkv.shape[1:])
    tail = qkv.shape[1:]
    return (grouped[:, :per].reshape(heads * head_dim, *tail), grouped[:, per].reshape(groups * head_dim, *tail),
            grouped[:, per + 1].reshape(groups * head_dim, *tail))


def split_gated(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear_fc1`` [2·I, ...] = [gate; up] → (gate [I, ...], up [I, ...]).

    Raises:
        ValueError: an odd number of rows."""
    if fc1.shape[0] % 2:
        raise ValueError(f"linear_fc1 has {fc1.shape[0]} rows; [gate; up] needs an even number")
    return tuple(fc1.chunk(2, dim=0))


def split(row: Row, tensor: torch.Tensor, *, heads: int, groups: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """``tensor`` (Megatron layout of ``row``) → the HF tensors of ``row.hf``, in order."""
    if row.kind == "qkv":
        return split_qkv(tensor, heads=heads, groups=groups, head_dim=head_dim)
    if row.kind == "gated":
        return split_gated(tensor)
    return (tensor,)
