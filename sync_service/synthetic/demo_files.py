"""The demo's checkpoint: a small real Qwen3-MoE and a PEFT LoRA adapter, generated once and cached.

Used by ``weightsync demo`` (``sync_service.entrypoints.demo``), its ``--rl`` loop (``sync_service.entrypoints.rl.run``) and the examples.
"""

from __future__ import annotations

import json
from pathlib import Path

from sync_service.synthetic.adapters import make_adapter
from sync_service.synthetic.base import make_base

# the demo model: qwen3_moe, E=8 experts, H=64, I=32, 2 layers (≈ 0.4 M parameters)
DEMO_MODEL = {"family": "qwen3_moe", "num_experts": 8, "hidden": 64, "intermediate": 32, "num_layers": 2,
              "vocab_size": 128, "dtype": "float32", "seed": 0}
DEMO_ADAPTER = {"kind": "target_parameters", "r": 4, "lora_alpha": 16, "seed": 1}


def ensure_files(cache_dir: Path) -> tuple[Path, Path]:
    """The cached demo base + adapter; regenerated when missing or made with other settings."""
    stamp = cache_dir / "settings.json"
    settings = {"model": DEMO_MODEL, "adapter": DEMO_ADAPTER}
    base, adapter = cache_dir / "base", cache_dir / "lora"
    if stamp.is_file() and json.loads(stamp.read_text()) == settings and (adapter / "adapter_config.json").is_file():
        return base, adapter
    cache_dir.mkdir(parents=True, exist_ok=True)
    model = dict(DEMO_MODEL)
    family = model.pop("family")
    make_base(family, base, **model)
    make_adapter(family, base, adapter, **DEMO_ADAPTER)
    stamp.write_text(json.dumps(settings, indent=2) + "\n")
    return base, adapter


TP_OVERRIDES = {"num_key_value_heads": 2}
"""The TP demo base's config change: two key/value heads, so attention splits over tp=2."""


def ensure_tp_base(cache_dir: Path) -> Path:
    """The cached demo base with ``TP_OVERRIDES`` (``<cache_dir>/base-tp``, for ``weightsync demo --trainer
    fsdp2-tp`` / ``tp-ep``); regenerated when missing or made with other settings."""
    base, stamp = cache_dir / "base-tp", cache_dir / "settings-tp.json"
    settings = {"model": DEMO_MODEL, "config": TP_OVERRIDES}
    if stamp.is_file() and json.loads(stamp.read_text()) == settings and (base / "config.json").is_file():
        return base
    cache_dir.mkdir(parents=True, exist_ok=True)
    model = dict(DEMO_MODEL)
    make_base(model.pop("family"), base, config_overrides=TP_OVERRIDES, **model)
    stamp.write_text(json.dumps(settings, indent=2) + "\n")
    return base
