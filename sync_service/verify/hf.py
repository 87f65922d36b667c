"""The commands' "verified" verdict for HF engines: every engine against PEFT's float64 merge.

``verify_version`` (``weightsync sync`` / ``demo``) checks each engine's weights against PEFT's
``merge_and_unload`` of the version's adapter (float64, cast once: ``verify.peft_oracle``), against the
``weightsync merge`` output of that version, and its greedy generations against the PEFT-merged model's.
``verify_weights`` (``weightsync run``) checks the weights only. Each returns one dict per engine (the
``engines`` rows of the commands' ``--json``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["MAX_NEW_TOKENS", "PROMPTS", "verify_version", "verify_weights"]

PROMPTS = ([1, 5, 9, 13, 17, 21], [2, 3, 5, 7, 11, 13, 17])
"""Token ids of the prompts every verdict generates from (greedy)."""
MAX_NEW_TOKENS = 8

TP_EXTRA_ATOL = 2.4e-7
"""TP blocks: the fp32 GEMM's rounding depends on the block shape (absolute, added to the ulp bound)."""


def verify_version(base: Path, vdir: Path, replay, engines: Sequence, *, tp: int, timeout_s: float) -> list[dict]:
    """Per engine (Ray actor handles of ``RolloutEngine``): weights vs PEFT's merge of the version
    (``replay``: the driver's ``AdapterReplay`` or ``None``, saved under ``vdir``), weights vs the
    ``weightsync merge`` output (written under ``vdir``), greedy generations vs the PEFT-merged model.
    Blocks up to ``timeout_s`` per engine call."""
    import ray

    from sync_service.engines.hf import HFEngine
    from sync_service.merge.export import merge_checkpoint
    from sync_service.verify.peft_oracle import checkpoint_state, compare_state, model_state, peft_merged_model

    adapter = None if replay is None else replay.save(vdir / "adapter")
    model = peft_merged_model(base, adapter)
    oracle = model_state(model)
    oracle_engine = HFEngine(model)
    expected = [oracle_engine.generate(p, MAX_NEW_TOKENS).tokens for p in PROMPTS]
    merged = base
    if adapter is not None:
        merged = vdir / "merged"
        merge_checkpoint(base, adapter, merged, target="hf", progress=False)
    written = checkpoint_state(merged)
    extra_atol = 0.0 if tp == 1 else TP_EXTRA_ATOL
    out = []
    for engine in engines:
        state = ray.get(engine.state.remote(), timeout=timeout_s)
        check = compare_state(state, oracle, extra_atol=extra_atol)
        merge_ok = compare_state(state, written, extra_atol=extra_atol).ok
        gens = [ray.get(engine.generate.remote(list(p), MAX_NEW_TOKENS), timeout=timeout_s) for p in PROMPTS]
        gen_ok = [g[0] for g in gens] == expected
        out.append({"verified": bool(check.ok and merge_ok and gen_ok),
                    "weights_equal_reference": check.ok, "max_abs_diff": check.max_abs_diff,
                    "weights_equal_merge_output": merge_ok, "generations_equal": bool(gen_ok),
                    "weight_version": gens[0][1]})
    return out


def verify_weights(base: Path, engines: Sequence, replay, *, tp: int, timeout_s: float) -> list[dict]:
    """Per engine: its weights equal PEFT's ``merge_and_unload`` of the version's adapter (float64,
    cast once; up to the ulp bound of ``compare_state``, + ``TP_EXTRA_ATOL`` with TP blocks)."""
    import ray

    from sync_service.verify.peft_oracle import compare_state, peft_merged_state

    with tempfile.TemporaryDirectory(prefix="wsoracle") as work:  # the replayed adapter, as PEFT reads it
        oracle = peft_merged_state(base, None if replay is None else replay.save(Path(work) / "adapter"))
    extra_atol = 0.0 if tp == 1 else TP_EXTRA_ATOL
    out = []
    for engine in engines:
        check = compare_state(ray.get(engine.state.remote(), timeout=timeout_s), oracle, extra_atol=extra_atol)
        out.append({"verified": check.ok, "weights_equal_reference": check.ok, "max_abs_diff": check.max_abs_diff,
                    "weight_version": ray.get(engine.weight_version.remote(), timeout=timeout_s)})
    return out
