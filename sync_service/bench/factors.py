"""``factor_streaming_row``: one benchmark row of factor streaming against merged streaming.

Builds a synthetic model (``sync_service.synthetic``), pushes the same versions once merged and once
as factors through ``LocalSync`` (one process, shm channel), and reports the last (delta) version.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from protocols.params import full_box

__all__ = ["factor_streaming_row"]


def factor_streaming_row(family: str = "qwen3_moe", *, dtype: str = "bfloat16", num_experts: int = 8, hidden: int = 64,
                         intermediate: int = 32, num_layers: int = 2, r: int = 4, ep: int = 1, tp: int = 1,
                         versions: int = 3, mode: str = "factors", experts_per_recipe: int = 8,
                         bucket_bytes: int = 1 << 20, work_dir: str | Path | None = None) -> dict:
    """Push ``versions`` versions of a ``family`` model with a ``target_parameters`` LoRA of rank ``r``.

    Returns ``{"bytes", "merged_bytes", "seconds", "bitwise_equal", "engine_extra_bytes"}``: payload
    bytes of the last (delta) version in ``mode`` and in merged mode, wall seconds of that push in
    ``mode``, whether the engines were bitwise equal after every version, and the bytes the receiver
    keeps beyond the engine (pristine copies + factors).

    Raises:
        ValueError: unknown family / mode, sizes not divisible by ``ep`` / ``tp``.
    """
    from peft import PeftConfig
    from safetensors.torch import load_file

    from sync_service.factor_stream.choose import FactorPolicy
    from sync_service.factor_stream.local import LocalSync, LocalSyncConfig
    from sync_service.merge.base import SafetensorsBase
    from sync_service.sharding.training import step_delta
    from sync_service.synthetic import make_adapter, make_base

    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        root = Path(tmp)
        base_dir = make_base(family, root / "base", dtype=dtype, num_experts=num_experts, hidden=hidden,
                             intermediate=intermediate, num_layers=num_layers, with_tokenizer=False)
        adapter_dir = make_adapter(family, base_dir, root / "lora", kind="target_parameters", r=r)
        base = SafetensorsBase(base_dir)
        tensors = {m.name: base.read(m.name, full_box(m.shape)).clone() for m in base.metas()}
        peft_config = PeftConfig.from_pretrained(str(adapter_dir))
        state = load_file(str(adapter_dir / "adapter_model.safetensors"))
    runs = {m: LocalSync(tensors, base.layout, peft_config, config=LocalSyncConfig(
        ep=ep, tp=tp, bucket_bytes=bucket_bytes, policy=FactorPolicy(mode=m, experts_per_recipe=experts_per_recipe)))
        for m in dict.fromkeys(("merged", mode))}
    equal, last = True, {}
    try:
        for v in range(versions):
            if v:
                state = {k: t + step_delta(k, tuple(t.shape), v, 0.02).to(t.dtype) for k, t in state.items()}
            last = {m: run.push(v, state) for m, run in runs.items()}
            a, b = runs["merged"].engine_state(), runs[mode].engine_state()
            equal &= all(torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8)) for n in a)
        engine = runs[mode].engine
        return {"bytes": last[mode].bytes, "merged_bytes": last["merged"].bytes, "seconds": last[mode].seconds,
                "bitwise_equal": bool(equal),
                "engine_extra_bytes": engine.resident_bytes() if hasattr(engine, "resident_bytes") else 0}
    finally:
        for run in runs.values():
            run.close()
