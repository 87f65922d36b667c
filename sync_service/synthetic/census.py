"""Every MoE family transformers ships, as a tiny config: found by walking transformers' own class tables.

Legend: H hidden, I expert intermediate, E experts. A candidate is a ``model_type`` of transformers'
causal-LM or image-text-to-text auto mappings whose default config names routed experts
(``EXPERT_COUNT_KEYS``); it is an MoE family if the model built from its tiny config holds a module with
3D parameters (transformers' fused experts). Families of ``FAMILIES`` use their hand-tuned spec
(``build_config``); every other one gets its defaults shrunk by ``TINY`` (H=64, head_dim 32, I=32, E=4,
two layers; any vision / audio sub-config as small), so a new transformers release that adds a family is
found without anyone listing it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sync_service.synthetic.families import FAMILIES

# Config keys that count routed experts (one of them set ⇒ an MoE candidate).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")

# Tiny values for every size key a family's config may carry (set only where the config has the key).
TINY: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 32, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32, "ffn_hidden_size": 32, "intermediate_size_mlp": 32, "moe_ffn_hidden_size": 32,
    "num_hidden_layers": 2, "num_layers": 2, "depth": 1, "num_attention_heads": 2, "num_heads": 2,
    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 128, "max_position_embeddings": 128,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_k": 2, "moe_topk": 2, "n_shared_experts": 1, "num_shared_experts": 1,
    "moe_num_shared_experts": 1, "n_group": 1, "topk_group": 1, "num_expert_group": 1, "first_k_dense_replace": 1,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 32,
    "index_head_dim": 32, "index_n_heads": 2, "index_topk": 8, "expert_ffn_hidden_size": 32, "d_model": 64,
    "encoder_layers": 1, "encoder_ffn_dim": 32, "encoder_attention_heads": 2, "output_dim": 64,
    "downsample_hidden_size": 32, "num_mel_bins": 16, "out_hidden_size": 64, "projection_dim": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
def candidates() -> Iterator[tuple[str, str]]:
    """``(model_type, class name)`` of every causal-LM / image-text-to-text class whose default config
    names routed experts, in transformers' mapping order (a model_type once)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto

    seen: set[str] = set()  # class names and model types
    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                    modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        for model_type, cls in mapping.items():
            if cls in seen or model_type in seen or model_type not in CONFIG_MAPPING:
                continue  # llama4 / llama4_text name one class, llama4 two classes: one family each
            seen |= {cls, model_type}
            try:
                config = CONFIG_MAPPING[model_type]().to_dict()
            except Exception:  # noqa: BLE001 - a config without defaults (encoder-decoder wrappers) is no LM family
                continue
            if _names_experts(config):
                yield model_type, cls


def _names_experts(config: dict) -> bool:
    subs = [v for v in config.values() if isinstance(v, dict)]
    return any(config.get(k) for k in EXPERT_COUNT_KEYS) or any(_names_experts(s) for s in subs)


def _layers_kept(config: dict) -> list[int] | None:
    """Indices of the layers a tiny model keeps: the first layer of each distinct kind over every per-layer
    list (a list as long as ``num_hidden_layers``), at least two; ``None`` if the config has no layer count."""
    count = config.get("num_hidden_layers")
    if not isinstance(count, int) or isinstance(count, bool):
        return None
    lists = [v for v in config.values() if isinstance(v, list) and len(v) == count and count > 2]
    kinds = list(zip(*lists)) if lists else [()] * count
    kept = sorted({kinds.index(kind) for kind in kinds})
    return (kept + [i for i in range(count) if i not in kept])[:max(2, len(kept))]


def _shrink(config: dict) -> dict:
    """The keys of ``config`` (a ``to_dict``) that a tiny model changes: every ``TINY`` key it has, per-layer
    lists cut to the kept layers (``_layers_kept``), sub-configs likewise (with their ``model_type``)."""
    out: dict[str, Any] = {}
    kept = _layers_kept(config)
    count = config.get("num_hidden_layers")
    for key, value in config.items():
        if isinstance(value, dict) and ("model_type" in value or "hidden_size" in value):
            sub = _shrink(value)
            out[key] = sub | ({"model_type": value["model_type"]} if "model_type" in value else {})
        elif kept is not None and isinstance(value, list) and len(value) == count and count > 2:
            out[key] = [value[i] for i in kept]
        elif key in TINY and isinstance(value, int) and not isinstance(value, bool) and value != TINY[key]:
            out[key] = TINY[key]
    if kept is not None:
        out["num_hidden_layers"] = len(kept)
    return out


_SPEC_OF = {spec.model_type: family for family, spec in FAMILIES.items()}


def tiny_config(model_type: str, model_class: type | None = None):
    """The tiny transformers config of ``model_type`` for ``model_class``: the ``FAMILIES`` spec where one
    exists (a hand-tuned size), else the defaults shrunk by ``TINY``; the text config where the class takes
    that (a causal-LM class of a multimodal model type). Raises what transformers raises for a config it
    rejects."""
    from transformers import CONFIG_MAPPING

    from sync_service.synthetic.base import build_config

    family = model_type if model_type in FAMILIES else _SPEC_OF.get(model_type)
    if family is not None:
        return build_config(family)
    cls = CONFIG_MAPPING[model_type]
    shrunk = _shrink(cls().to_dict())
    first_error: Exception | None = None
    # the whole shrink first, then without one of its keys (a family that needs, e.g., as many KV heads as
    # heads, or one expert per token), top level or in a sub-config: the first config transformers accepts
    # and can build a model of
    drops = [()] + [(k,) for k, v in shrunk.items() if not isinstance(v, dict)] + [
        (k, sub) for k, v in shrunk.items() if isinstance(v, dict) for sub in v if sub != "model_type"]
    for drop in drops:
        try:
            config = _for_class(cls(**_without(shrunk, drop)), model_class)
            if model_class is not None:
                import torch

                with torch.device("meta"):
                    model_class._from_config(config)
            return config
        except Exception as err:  # noqa: BLE001 - transformers' validators raise many types
            first_error = first_error or err
    raise first_error


def _without(shrunk: dict, path: tuple[str, ...]) -> dict:
    """``shrunk`` less the key at ``path`` (``()``: all of it; ``(key,)`` or ``(sub-config, key)``)."""
    if not path:
        return shrunk
    if len(path) == 1:
        return {k: v for k, v in shrunk.items() if k != path[0]}
    return shrunk | {path[0]: {k: v for k, v in shrunk[path[0]].items() if k != path[1]}}


def _for_class(config, model_class: type | None):
    """``config``, or its text config where ``model_class`` takes that (a causal LM of a multimodal type)."""
    wanted = getattr(model_class, "config_class", None)
    if wanted is not None and not isinstance(config, wanted) and hasattr(config, "get_text_config"):
        text = config.get_text_config()
        if isinstance(text, wanted):
            return text
    return config
