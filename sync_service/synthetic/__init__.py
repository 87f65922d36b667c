"""Test-input generators (not on the sync path): tiny real MoE checkpoints and PEFT adapters, built offline.

Used by the tests (merge oracle matrix), the demo and the benchmarks. Nothing is downloaded: bases
are transformers models built from config with seeded random weights (``make_base``), adapters are
real PEFT LoRA adapters with random non-zero factors (``make_adapter``), tokenizers are word-level
``tokenizers`` models (``save_tokenizer``). See ``FAMILIES`` for the supported model families.

Example::

    base = make_base("qwen3_moe", tmp / "base", dtype="bfloat16")
    adapter = make_adapter("qwen3_moe", base, tmp / "lora", kind="target_parameters", r=4, lora_alpha=16)
"""

from sync_service.synthetic.adapters import (
    ADAPTER_KINDS,
    NON_LORA_TYPES,
    base_tensor_shapes,
    make_adapter,
    make_non_lora_adapter,
)
from sync_service.synthetic.base import build_config, make_base, randomize_, torch_dtype
from sync_service.synthetic.families import FAMILIES, FamilySpec, Sizes, family_spec
from sync_service.synthetic.tokenizer import save_tokenizer, vocabulary

__all__ = [
    "ADAPTER_KINDS",
    "FAMILIES",
    "NON_LORA_TYPES",
    "FamilySpec",
    "Sizes",
    "base_tensor_shapes",
    "build_config",
    "family_spec",
    "make_adapter",
    "make_base",
    "make_non_lora_adapter",
    "randomize_",
    "save_tokenizer",
    "torch_dtype",
    "vocabulary",
]
