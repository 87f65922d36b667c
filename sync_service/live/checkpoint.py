"""One trainer rank's ``LiveState`` over its shard of a checkpoint (what a ``TrainerShard`` actor trains).

``load_rank(base_dir, adapter_dir, spec)`` reads only this rank's pieces of the base (its EP expert
block, its TP rows / columns: ``sharding/rules.py``) from a safetensors checkpoint in any on-disk
naming the merge core maps, and its part of the PEFT adapter (``local_factors``), and returns the
same ``LiveState`` a live training rank's endpoint runs — the rank's memory is its shard plus its
factors. The factor tensors are the rank's trained values: ``set_factors`` writes them in place, as
an optimizer step would, and the state reads them at each snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from sync_service.live.model import LiveParam
from sync_service.live.state import LiveState
from sync_service.live.structure import num_experts_of
from sync_service.sharding.ep_factors import local_factors
from sync_service.sharding.rules import ShardSpec

__all__ = ["load_rank", "set_factors"]


def load_rank(base_dir: str | Path, adapter_dir: str | Path | None, spec: ShardSpec, *, group=None,
              timeout_s: float = 60.0, device: str | torch.device = "cpu") -> LiveState:
    """The prepared state of rank ``spec.rank`` of an ``ep × tp`` trainer over a checkpoint shard.

    Args:
        base_dir: a transformers checkpoint directory (safetensors, any naming the merge core maps); a block-FP8
            one is held dequantized in float32 (``merge.fp8_base``), so the merge never adds to FP8 values.
        adapter_dir: a PEFT adapter directory (``adapter_model.safetensors``); ``None``: no adapter
            (full fine-tuning through ``LiveState.update_base``).
        spec: the rank's place in the mesh; ``group`` its process group (``None``: the default group).
        timeout_s: bound of each factor collective (factor streaming under EP).
        device: where the rank's base shard and factors live once read (read on the host, then moved; ``"cpu"``:
            not moved), hence where its merge runs (``transports.devices``).

    Raises:
        MergeError: a bad checkpoint or adapter. FileNotFoundError: no adapter_model.safetensors.
        ValueError: sizes not divisible by ep / tp.
    """
    from sync_service.merge.fp8_base import open_base
    from sync_service.sharding.base import load_shard

    base = load_shard(open_base(base_dir, as_loaded=True), spec)  # a block-FP8 base: dequantized, float32
    base = base.with_locals({n: t.to(device) for n, t in base.local_tensors().items()})
    peft_config, factors = None, {}
    if adapter_dir is not None:
        peft_config, full = _read_adapter(Path(adapter_dir))
        factors = {k: t.to(device) for k, t in local_factors(full, spec, num_experts=num_experts_of(base)).items()}
        del full
    params = {k: LiveParam(k, t, tuple(t.shape)) for k, t in factors.items()}
    state = LiveState(base, params, peft_config, spec=spec, group=group, rank=spec.rank, world=spec.world_size,
                      timeout_s=timeout_s)
    state.prepare()
    return state


def _read_adapter(adapter_dir: Path):
    from peft import PeftConfig
    from safetensors.torch import load_file

    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{adapter_dir}: no adapter_model.safetensors; save the adapter with safe_serialization=True")
    return PeftConfig.from_pretrained(str(adapter_dir)), load_file(str(weights))


def set_factors(state: LiveState, updates: Mapping[str, torch.Tensor]) -> None:
    """Write factor values in place (keys and shapes as this rank holds them), as an optimizer step would.

    Raises:
        KeyError: a key this rank does not hold. ValueError: a shape mismatch.
    """
    for key, value in updates.items():
        held = state.factors.get(key)
        if held is None:
            raise KeyError(f"{key!r} is not a factor held by trainer rank {state.rank}; held: {sorted(state.factors)[:4]}…")
        if tuple(value.shape) != tuple(held.param.shape):
            raise ValueError(f"{key!r}: shape {tuple(value.shape)} != held {tuple(held.param.shape)}")
    for key, value in updates.items():
        state.factors[key].param.copy_(value)
