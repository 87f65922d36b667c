"""Synthetic specs of the MoE families beyond the first six (config keywords and module names).

Legend: H hidden, I expert intermediate, E experts, L layers. Every config is as small as the family
allows (two layers; hybrid families get one layer of each kind). Names are transformers 5.19 in-memory
names; ``legacy_experts`` is the on-disk per-expert naming where the family's checkpoints have one.
"""

from __future__ import annotations

from sync_service.synthetic.family_types import GUD, QKVO, FamilySpec, Sizes, common

_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _deepseek_like(s: Sizes) -> dict:
    """Routed + shared experts, layer 0 dense, group-limited routing with one group."""
    return dict(n_routed_experts=s.num_experts, moe_intermediate_size=s.intermediate, intermediate_size=s.intermediate,
                n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)


def _qwen3_vl_moe(s: Sizes) -> dict:
    # moe_intermediate_size I + 4: gate_up_proj [E, 2I, H] must not be square, or transformers'
    # Transpose(check_dims=True) could not tell a hub checkpoint's orientation (the merge refuses it too)
    text = common(s) | dict(num_experts=s.num_experts, moe_intermediate_size=s.intermediate + 4,
                            intermediate_size=s.intermediate,
                            rope_parameters=_ROPE | {"rope_type": "default", "mrope_section": [2, 1, 1]})
    text.pop("tie_word_embeddings")
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=s.hidden,
                  patch_size=4, temporal_patch_size=1, spatial_merge_size=1, deepstack_visual_indexes=[])
    return dict(text_config=text, vision_config=vision, tie_word_embeddings=s.tie_word_embeddings)


def _qwen3_hybrid(s: Sizes) -> dict:
    """qwen3_next / qwen3_5_moe text: one linear-attention layer, one full-attention layer."""
    return common(s) | dict(
        num_experts=s.num_experts, moe_intermediate_size=s.intermediate, shared_expert_intermediate_size=s.intermediate,
        intermediate_size=s.intermediate, layer_types=["linear_attention", "full_attention"][: s.num_layers],
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=2, rope_parameters=_ROPE | {"partial_rotary_factor": 0.5})


MORE_FAMILIES: dict[str, FamilySpec] = {
    "qwen3_vl_moe": FamilySpec(  # language model under model.language_model.; experts fused on disk
        model_type="qwen3_vl_moe", config_kwargs=_qwen3_vl_moe, attention=QKVO, dense_mlp=(), router="mlp.gate",
        legacy_experts=None, model_class="Qwen3VLMoeForConditionalGeneration"),
    "llama4": FamilySpec(  # experts fused on disk [E, H, 2I]; shared expert + nn.Linear router
        model_type="llama4_text",
        config_kwargs=lambda s: common(s) | dict(num_local_experts=s.num_experts, intermediate_size=s.intermediate,
                                                 intermediate_size_mlp=s.intermediate, num_experts_per_tok=1,
                                                 interleave_moe_layer_step=1, rope_parameters=_ROPE),
        attention=QKVO, dense_mlp=GUD, router="feed_forward.router", legacy_experts=None,
        experts="feed_forward.experts"),
    "granitemoe": FamilySpec(  # on disk block_sparse_moe.input_linear / output_linear / router.layer
        model_type="granitemoe",
        config_kwargs=lambda s: common(s) | dict(num_local_experts=s.num_experts, intermediate_size=s.intermediate),
        attention=QKVO, dense_mlp=(), router="block_sparse_moe.router", legacy_experts=None,
        experts="block_sparse_moe.experts"),
    "glm4_moe": FamilySpec(
        model_type="glm4_moe", config_kwargs=lambda s: common(s) | _deepseek_like(s) | dict(rope_parameters=_ROPE),
        attention=QKVO, dense_mlp=(), router="mlp.gate", legacy_experts=("mlp.experts", GUD)),
    "qwen3_next": FamilySpec(
        model_type="qwen3_next", config_kwargs=_qwen3_hybrid, attention=QKVO, dense_mlp=GUD, router="mlp.gate",
        legacy_experts=("mlp.experts", GUD)),
    "qwen3_5_moe": FamilySpec(
        model_type="qwen3_5_moe_text", config_kwargs=_qwen3_hybrid, attention=QKVO, dense_mlp=GUD,
        router="mlp.gate", legacy_experts=("mlp.experts", GUD)),
    "deepseek_v2": FamilySpec(  # MLA attention without q LoRA (q_proj)
        model_type="deepseek_v2",
        config_kwargs=lambda s: common(s) | _deepseek_like(s) | dict(
            num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=s.hidden // 2, qk_rope_head_dim=s.hidden // 4,
            head_dim=s.hidden // 4, qk_nope_head_dim=s.hidden // 4, v_head_dim=s.hidden // 2, topk_method="greedy",
            rope_parameters=_ROPE),
        attention=("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"), dense_mlp=(), router="mlp.gate",
        legacy_experts=("mlp.experts", GUD)),
    "dots1": FamilySpec(
        model_type="dots1", config_kwargs=lambda s: common(s) | _deepseek_like(s) | dict(rope_parameters=_ROPE),
        attention=QKVO, dense_mlp=(), router="mlp.gate", legacy_experts=("mlp.experts", GUD)),
    "ernie4_5_moe": FamilySpec(
        model_type="ernie4_5_moe",
        config_kwargs=lambda s: common(s) | dict(moe_num_experts=s.num_experts, moe_intermediate_size=s.intermediate,
                                                 intermediate_size=s.intermediate, moe_k=2, moe_layer_start_index=1,
                                                 moe_num_shared_experts=1, rope_parameters=_ROPE),
        attention=QKVO, dense_mlp=(), router="mlp.gate", legacy_experts=("mlp.experts", GUD)),
    "hunyuan_v1_moe": FamilySpec(
        model_type="hunyuan_v1_moe",
        config_kwargs=lambda s: common(s) | dict(num_experts=s.num_experts, moe_intermediate_size=s.intermediate,
                                                 intermediate_size=s.intermediate, moe_topk=2, num_shared_expert=1,
                                                 rope_parameters=_ROPE),
        attention=QKVO, dense_mlp=(), router="mlp.gate", legacy_experts=("mlp.experts", GUD)),
    "minimax": FamilySpec(  # lightning (linear) attention + full attention; Mixtral-style experts on disk
        model_type="minimax",
        config_kwargs=lambda s: common(s) | dict(num_local_experts=s.num_experts, intermediate_size=s.intermediate,
                                                 layer_types=["linear_attention", "full_attention"][: s.num_layers],
                                                 block_size=4, rope_parameters=_ROPE),
        attention=QKVO, dense_mlp=(), router="mlp.gate", legacy_experts=("block_sparse_moe.experts", ("w1", "w3", "w2"))),
    "phimoe": FamilySpec(  # router mlp.router (on disk block_sparse_moe.gate)
        model_type="phimoe",
        config_kwargs=lambda s: common(s) | dict(num_local_experts=s.num_experts, intermediate_size=s.intermediate,
                                                 rope_parameters=_ROPE),
        attention=QKVO, dense_mlp=(), router="mlp.router", legacy_experts=("block_sparse_moe.experts", ("w1", "w3", "w2"))),
    "jamba": FamilySpec(  # mamba layer 0, attention layer 1, experts on every layer
        model_type="jamba",
        config_kwargs=lambda s: common(s) | dict(num_experts=s.num_experts, intermediate_size=s.intermediate,
                                                 expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2,
                                                 attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=2, mamba_expand=1,
                                                 mamba_dt_rank=4),
        attention=QKVO, dense_mlp=(), router="feed_forward.router", legacy_experts=("feed_forward.experts", GUD),
        experts="feed_forward.experts"),
}
