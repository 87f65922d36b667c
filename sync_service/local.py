"""The reference side of local runs (demo, ``weightsync sync``, end-to-end tests): replay training
steps on the full adapter and compute the merge a version must equal. The actors themselves are
started by ``actors.launch`` (``start_trainers``, ``start_engines``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from protocols.params import full_box

__all__ = ["AdapterReplay", "reference_state", "save_adapter"]


class AdapterReplay:
    """The full PEFT state dict of an adapter after replaying ``train_step``s (the reference side)."""

    def __init__(self, adapter_dir: str | Path) -> None:
        from peft import PeftConfig
        from safetensors.torch import load_file

        self.dir = Path(adapter_dir)
        self.peft_config = PeftConfig.from_pretrained(str(self.dir))
        self.state: dict[str, torch.Tensor] = load_file(str(self.dir / "adapter_model.safetensors"))

    def step(self, step: int, scale: float = 0.02) -> None:
        """Apply the same update as ``TrainerShard.train_step(step, scale)`` on every rank."""
        from sync_service.sharding.training import step_delta

        self.state = {k: v + step_delta(k, tuple(v.shape), step, scale).to(v.dtype) for k, v in self.state.items()}

    def save(self, out_dir: str | Path) -> Path:
        """Write this state as a PEFT adapter directory (safetensors + adapter_config.json)."""
        return save_adapter(self.dir, self.state, out_dir)


def save_adapter(template_dir: str | Path, state: Mapping[str, torch.Tensor], out_dir: str | Path) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text((Path(template_dir) / "adapter_config.json").read_text())
    return out


def reference_state(base_dir: str | Path, peft_config, adapter_state: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Every merged tensor (hf-fused naming) of the full base + ``adapter_state``: the values every
    engine must hold after a sync of that version (``MergedSource`` over the unsharded base)."""
    from sync_service.merge.adapter import adapter_from_state_dict
    from sync_service.merge.base import SafetensorsBase
    from sync_service.merge.source import MergeConfig, MergedSource

    base = SafetensorsBase(base_dir, as_loaded=True)
    adapter = None if adapter_state is None else adapter_from_state_dict(
        peft_config, dict(adapter_state), base.layout, base.metas(), tied_aliases=base.tied_aliases)
    source = MergedSource(base, adapter, config=MergeConfig())
    out = {}
    for m in source.param_metas():
        buf = torch.empty(m.shape, dtype=source.out_dtype(m.name))
        source.fill(m.name, full_box(m.shape), buf)
        out[m.name] = buf
    return out

