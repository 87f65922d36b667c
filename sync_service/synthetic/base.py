"""Tiny real base checkpoints: a transformers model built from config, randomised, saved to safetensors.

Weights are drawn from a seeded ``torch.Generator`` (normal, std ``scale``; norm weights ``1 + scale·N``)
so that a LoRA merge changes the outputs visibly. Everything is built offline with transformers
(``AutoConfig.for_model`` + ``AutoModelForCausalLM.from_config``) and written by ``save_pretrained``,
so the on-disk names are exactly what a real checkpoint of the family uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from protocols.params import MERGE_DTYPES
from sync_service.dtypes import TORCH_DTYPES
from sync_service.synthetic.families import Sizes, family_spec
from sync_service.synthetic.tokenizer import save_tokenizer


def torch_dtype(name: str) -> torch.dtype:
    """A generated base's dtype: ``"float32"`` / ``"bfloat16"`` / ``"float16"`` / ``"float64"`` → torch dtype.

    Raises:
        ValueError: any other name.
    """
    if name not in MERGE_DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(MERGE_DTYPES)}")
    return TORCH_DTYPES[name]


def build_config(
    family: str,
    *,
    num_layers: int = 2,
    num_experts: int = 4,
    hidden: int = 16,
    intermediate: int = 8,
    vocab_size: int = 64,
    tie_word_embeddings: bool = False,
):
    """The transformers config of a tiny ``family`` model (a ``PretrainedConfig`` subclass).

    Raises:
        ValueError: unknown family, or ``hidden`` not a multiple of 4.
    """
    from transformers import AutoConfig

    spec = family_spec(family)
    if hidden % 4:
        raise ValueError(f"hidden={hidden} must be a multiple of 4 (two heads, head_dim hidden/2)")
    sizes = Sizes(
        hidden=hidden,
        intermediate=intermediate,
        num_experts=num_experts,
        num_layers=num_layers,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
    )
    return AutoConfig.for_model(spec.model_type, **spec.config_kwargs(sizes))


@torch.no_grad()
def randomize_(module: torch.nn.Module, *, seed: int, scale: float) -> None:
    """Overwrite every floating parameter of ``module`` in place with seeded random values.

    Parameters are visited in sorted name order, so the result depends only on ``seed``, ``scale``
    and the parameter names / shapes. Norm weights (names containing ``norm``) become
    ``1 + scale·N(0, 1)``; everything else ``scale·N(0, 1)``. Drawn in float32, then cast.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        if not param.is_floating_point():
            continue
        values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * scale
        if "norm" in (name.split(".")[-2:-1] or [""])[0]:
            values += 1.0
        param.copy_(values.to(param.dtype))


def make_base(
    family: str,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    num_layers: int = 2,
    num_experts: int = 4,
    hidden: int = 16,
    intermediate: int = 8,
    vocab_size: int = 64,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    scale: float = 0.1,
    max_shard_size: str | int = "5GB",
    with_tokenizer: bool = True,
    config_overrides: Mapping[str, Any] | None = None,
) -> Path:
    """Build, randomise and save a tiny ``family`` causal LM to ``out_dir``; returns ``out_dir``.

    Families: the keys of ``FAMILIES`` (``families.py``: qwen3_moe, qwen2_moe, mixtral, olmoe, deepseek_v3,
    gpt_oss; ``families_more.py``: qwen3_vl_moe, llama4, granitemoe, glm4_moe, qwen3_next, qwen3_5_moe,
    deepseek_v2, dots1, ernie4_5_moe, hunyuan_v1_moe, minimax, phimoe, jamba), built with the spec's
    ``model_class`` (a VL model is no causal LM). Writes
    ``model.safetensors`` (or shards + index if larger than ``max_shard_size``), ``config.json``,
    ``generation_config.json`` and, with ``with_tokenizer``, a word-level tokenizer whose ids match
    the config's pad/bos/eos ids. Weights: see ``randomize_``; stored in ``dtype`` (``"float32"`` or
    ``"bfloat16"``). With the defaults (H=16, I=8, E=4, 2 layers) a model has ~10k parameters and
    builds in well under a second after the first import.

    Raises:
        ValueError: unknown family or dtype, bad sizes.

    ``config_overrides``: config attributes set after the family's (e.g. ``{"num_key_value_heads": 2}``: attention
    that splits over tp=2; the family writes one KV head).
    """
    import transformers

    target_dtype = torch_dtype(dtype)
    config = build_config(
        family,
        num_layers=num_layers,
        num_experts=num_experts,
        hidden=hidden,
        intermediate=intermediate,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
    )
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)
    cls = getattr(transformers, family_spec(family).model_class)
    model = (cls.from_config if hasattr(cls, "from_config") else cls._from_config)(config, dtype=torch.float32)
    randomize_(model, seed=seed, scale=scale)
    model.to(target_dtype)
    model.config.dtype = target_dtype
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    if with_tokenizer:
        save_tokenizer(out, vocab_size)
    return out
