"""The driver side of local runs (demo, ``weightsync sync``, end-to-end tests): replay training steps
on the full adapter and write it as a PEFT adapter, which PEFT's own merge turns into the weights a
version must equal (``verify.peft_oracle``). The actors themselves are started by ``actors.launch``
(``start_trainers``, ``start_engines``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

__all__ = ["AdapterReplay", "save_adapter"]


class AdapterReplay:
    """The full PEFT state dict of an adapter after replaying ``train_step``s (the driver's copy)."""

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
