"""Model-family table for the synthetic checkpoints: config keywords and module names per family.

Legend: H hidden, I expert (and dense) intermediate, E experts, L layers, r LoRA rank.
Names are the transformers v5 in-memory names (``model.layers.L.<...>``); the on-disk names of the
per-expert families are the pre-fusion ones that ``save_pretrained`` writes
(``mlp.experts.N.gate_proj.weight``, Mixtral ``block_sparse_moe.experts.N.w1.weight``).
Verified against transformers 5.19 and PEFT 0.21.
"""

from __future__ import annotations

from sync_service.synthetic.family_types import GUD as _GUD
from sync_service.synthetic.family_types import QKVO as _QKVO
from sync_service.synthetic.family_types import FamilySpec, Sizes, common as _common
from sync_service.synthetic.families_more import MORE_FAMILIES


FAMILIES: dict[str, FamilySpec] = {
    "qwen3_moe": FamilySpec(
        model_type="qwen3_moe",
        config_kwargs=lambda s: _common(s)
        | dict(num_experts=s.num_experts, moe_intermediate_size=s.intermediate, intermediate_size=s.intermediate),
        attention=_QKVO,
        dense_mlp=(),
        router="mlp.gate",
        legacy_experts=("mlp.experts", _GUD),
    ),
    "qwen2_moe": FamilySpec(  # shared expert: mlp.shared_expert.{gate,up,down}_proj
        model_type="qwen2_moe",
        config_kwargs=lambda s: _common(s)
        | dict(
            num_experts=s.num_experts,
            moe_intermediate_size=s.intermediate,
            shared_expert_intermediate_size=s.intermediate,
            intermediate_size=s.intermediate,
        ),
        attention=_QKVO,
        dense_mlp=_GUD,
        router="mlp.gate",
        legacy_experts=("mlp.experts", _GUD),
    ),
    "mixtral": FamilySpec(
        model_type="mixtral",
        config_kwargs=lambda s: _common(s) | dict(num_local_experts=s.num_experts, intermediate_size=s.intermediate),
        attention=_QKVO,
        dense_mlp=(),
        router="mlp.gate",
        legacy_experts=("block_sparse_moe.experts", ("w1", "w3", "w2")),
    ),
    "olmoe": FamilySpec(
        model_type="olmoe",
        config_kwargs=lambda s: _common(s) | dict(num_experts=s.num_experts, intermediate_size=s.intermediate),
        attention=_QKVO,
        dense_mlp=(),
        router="mlp.gate",
        legacy_experts=("mlp.experts", _GUD),
    ),
    # MLA attention; layer 0 dense MLP; shared experts mlp.shared_experts.*. dense_mlp is empty: PEFT 0.21
    # remaps gate_proj/up_proj/down_proj targets of this family to the fused experts (its transformers-v4
    # adapter conversion), so LoRA on the dense / shared-expert MLP is produced by the "legacy" kind only.
    "deepseek_v3": FamilySpec(
        model_type="deepseek_v3",
        config_kwargs=lambda s: _common(s)
        | dict(
            num_key_value_heads=2,
            n_routed_experts=s.num_experts,
            moe_intermediate_size=s.intermediate,
            intermediate_size=s.intermediate,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            q_lora_rank=s.hidden // 2,
            kv_lora_rank=s.hidden // 2,
            qk_rope_head_dim=s.hidden // 4,
            head_dim=s.hidden // 4,  # the rotary embedding's width: must equal qk_rope_head_dim
            qk_nope_head_dim=s.hidden // 4,
            v_head_dim=s.hidden // 2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        attention=("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
        dense_mlp=(),
        router="mlp.gate",
        legacy_experts=("mlp.experts", _GUD),
    ),
    "gpt_oss": FamilySpec(  # experts stored fused on disk: gate_up_proj [E, H, 2I] interleaved, down_proj [E, I, H]
        model_type="gpt_oss",
        config_kwargs=lambda s: _common(s)
        | dict(
            num_local_experts=s.num_experts,
            intermediate_size=s.intermediate,
            layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(s.num_layers)],
            sliding_window=16,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        attention=_QKVO,
        dense_mlp=(),
        router="mlp.router",
        legacy_experts=None,
    ),
    **MORE_FAMILIES,
}


def family_spec(family: str) -> FamilySpec:
    """The table entry of ``family``.

    Raises:
        ValueError: ``family`` is not a key of ``FAMILIES``.
    """
    try:
        return FAMILIES[family]
    except KeyError:
        raise ValueError(f"unknown model family {family!r}; use one of {sorted(FAMILIES)}") from None
