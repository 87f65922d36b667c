"""Fixtures of the factor-streaming tests: tiny real checkpoints + PEFT adapters, built once per session."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from protocols.params import full_box


@dataclass
class Model:
    """A base (hf-fused tensors), its layout, an adapter's PEFT config and state dict, and their dirs."""

    tensors: dict
    layout: object
    peft_config: object
    state: dict
    base_dir: object
    adapter_dir: object


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """``model_factory(family, dtype, kind="target_parameters", **adapter_kw) -> Model`` (cached)."""
    from peft import PeftConfig
    from safetensors.torch import load_file

    from sync_service.merge.base import SafetensorsBase
    from sync_service.synthetic import make_adapter, make_base

    cache: dict = {}

    def build(family: str, dtype: str = "float32", kind: str = "target_parameters", **kw) -> Model:
        key = (family, dtype, kind, repr(sorted(kw.items())))
        if key not in cache:
            root = tmp_path_factory.mktemp(f"{family}-{dtype}-{kind}")
            base_dir = make_base(family, root / "base", dtype=dtype, num_experts=4)
            adapter_dir = make_adapter(family, base_dir, root / "lora", kind=kind, r=2, **kw)
            base = SafetensorsBase(base_dir)
            tensors = {m.name: base.read(m.name, full_box(m.shape)).clone() for m in base.metas()}
            cache[key] = Model(tensors, base.layout, PeftConfig.from_pretrained(str(adapter_dir)),
                               load_file(str(adapter_dir / "adapter_model.safetensors")), base_dir, adapter_dir)
        return cache[key]

    return build


def train_step(state: dict, step: int, scale: float = 0.02) -> dict:
    """Every factor moves (``sharding.training.step_delta``, as ``TrainerShard.train_step``)."""
    from sync_service.sharding.training import step_delta

    return {k: v + step_delta(k, tuple(v.shape), step, scale).to(v.dtype) for k, v in state.items()}


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ bitwise (dtype, shape or any bit), plus names on one side only."""
    assert set(a) == set(b), set(a) ^ set(b)
    return [n for n in a if a[n].dtype != b[n].dtype or not torch.equal(_bits(a[n]), _bits(b[n]))]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)
