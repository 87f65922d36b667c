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


def run_both(model, *, versions: int = 3, experts_per_recipe: int = 1, engine: dict | None = None, **config):
    """Push ``versions`` versions (trained between them by ``train_step``) once merged and once as factors,
    through ``LocalSync`` runs into copies of ``engine`` (default: the model's base) with ``LocalSyncConfig(**config)``
    (``bucket_bytes`` 8 KiB unless given); asserts both engines hold the same bytes after every version.

    Returns ``(runs by mode, [(push stats by mode, merged engine state)] per version, last trained state)``; the
    runs are closed.
    """
    from sync_service.factor_stream.choose import FactorPolicy
    from sync_service.factor_stream.local import LocalSync, LocalSyncConfig

    config.setdefault("bucket_bytes", 8 << 10)
    runs = {mode: LocalSync(model.tensors, model.layout, model.peft_config, engine=engine, config=LocalSyncConfig(
        **config, policy=FactorPolicy(mode=mode, experts_per_recipe=experts_per_recipe))) for mode in ("merged", "factors")}
    state, log = dict(model.state), []
    try:
        for v in range(versions):
            if v:
                state = train_step(state, v)
            stats = {mode: run.push(v, state) for mode, run in runs.items()}
            merged, factors = runs["merged"].engine_state(), runs["factors"].engine_state()
            assert not differing(merged, factors), f"version {v}: factor engine differs in {differing(merged, factors)[:4]}"
            log.append((stats, merged))
        return runs, log, state
    finally:
        for run in runs.values():
            run.close()
