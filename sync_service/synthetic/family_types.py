"""Shared types of the synthetic family tables: sizes, the per-family spec, common config keywords.

Legend: H hidden, I expert (and dense) intermediate, E experts, L layers, r LoRA rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Sizes:
    """Sizes of a synthetic model.

    Attributes:
        hidden: H, the residual width; must be a multiple of 4.
        intermediate: I, the expert (and dense / shared expert) intermediate width.
        num_experts: E, routed experts per MoE layer.
        num_layers: decoder layers.
        vocab_size: tokens in the vocabulary (and the synthetic tokenizer).
        tie_word_embeddings: whether ``lm_head.weight`` is ``model.embed_tokens.weight``.
    """

    hidden: int
    intermediate: int
    num_experts: int
    num_layers: int
    vocab_size: int
    tie_word_embeddings: bool


@dataclass(frozen=True, slots=True)
class FamilySpec:
    """What the generators need to know about one model family.

    Attributes:
        model_type: transformers ``model_type`` (``AutoConfig.for_model`` key).
        config_kwargs: ``Sizes`` → family-specific config keywords.
        attention: leaf names of the attention projections (``nn.Linear``).
        dense_mlp: leaf names of the dense MLP / shared expert ``nn.Linear`` projections that PEFT can
            target on the fused model, empty if none.
        router: in-memory name of the router module under a layer (``mlp.gate``; gpt_oss ``mlp.router``).
        legacy_experts: on-disk per-expert module prefix under a layer and its (gate, up, down) leaf
            names, as a pre-fusion PEFT adapter names them; ``None`` where experts are stored fused.
        experts: in-memory path of the experts module under a layer (``target_parameters`` prefix).
        model_class: transformers class name the checkpoint is built and loaded with.
    """

    model_type: str
    config_kwargs: Callable[[Sizes], dict[str, Any]]
    attention: tuple[str, ...]
    dense_mlp: tuple[str, ...]
    router: str
    legacy_experts: tuple[str, tuple[str, str, str]] | None
    experts: str = "mlp.experts"
    model_class: str = "AutoModelForCausalLM"


def common(s: Sizes) -> dict[str, Any]:
    """Config keywords every family shares: sizes, two heads (one KV head), top-2 routing, token ids."""
    return dict(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden,
        num_hidden_layers=s.num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=s.hidden // 2,
        max_position_embeddings=128,
        num_experts_per_tok=2,
        tie_word_embeddings=s.tie_word_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
GUD = ("gate_proj", "up_proj", "down_proj")
