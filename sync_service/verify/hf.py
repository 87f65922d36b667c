"""The commands' "verified" verdict for HF engines: every engine against PEFT's float64 merge.

``verify_version`` (``weightsync sync`` / ``demo``) checks each engine's weights against PEFT's
``merge_and_unload`` of the version's adapter (float64, cast once: ``verify.peft_oracle``), against the
``weightsync merge`` output of that version, and its greedy generations against the PEFT-merged model's
(up to near-ties: ``verify.tokens``). ``verify_weights`` (``weightsync run``) checks the weights only.
Each returns one dict per engine (``verify.verdict``: the ``engines`` rows of the commands' ``--json``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from sync_service.verify.verdict import TP_EXTRA_ATOL, Reference, verdict

__all__ = ["MAX_NEW_TOKENS", "PROMPTS", "TP_EXTRA_ATOL", "reference", "verify_version", "verify_weights"]

PROMPTS = ([1, 5, 9, 13, 17, 21], [2, 3, 5, 7, 11, 13, 17])
"""Token ids of the prompts every verdict generates from (greedy)."""
MAX_NEW_TOKENS = 8


def reference(base: Path, adapter: Path | None, *, tp: int, merge_dir: Path | None = None,
              prompts: Sequence[Sequence[int]] = PROMPTS, max_new_tokens: int = MAX_NEW_TOKENS,
              dtype: torch.dtype | None = None, table: Sequence | None = None) -> Reference:
    """The ``Reference`` of ``base`` + ``adapter`` (``None``: the base itself): PEFT's float64 merge cast
    once (into ``dtype``, the engines' dtype; default the base's) and its greedy decodes of ``prompts``; with
    ``merge_dir``, also the ``weightsync merge`` output written there (in the base's dtype) and read back, its
    floating tensors cast into ``dtype`` (exactly what an fp32-accumulated sync casts once into the engine's).
    ``table``: an engine's ``ParamMeta`` table that holds block-FP8 tensors: the oracle is ``verify.fp8_oracle``'s
    (transformers' quantizer of the float64 merge; decodes on transformers' dequantization; no merge output)."""
    from sync_service.fp8 import table_blocks
    from sync_service.merge.export import merge_checkpoint
    from sync_service.verify.peft_oracle import checkpoint_state, model_state, peft_merged_model
    from sync_service.verify.tokens import hf_decodes

    extra_atol = 0.0 if tp == 1 else TP_EXTRA_ATOL
    if table is not None and table_blocks(table):
        from sync_service.verify.fp8_oracle import compute_dtype, dequantized_, quantized_state

        model = peft_merged_model(base, adapter, dtype=torch.float64)
        oracle = quantized_state(model_state(model), table)
        model = dequantized_(model, oracle, table, compute_dtype(table))
        return Reference(oracle=oracle, decodes=hf_decodes(model, prompts, max_new_tokens), extra_atol=extra_atol)
    model = peft_merged_model(base, adapter, dtype=dtype)
    written = None
    if merge_dir is not None:
        if adapter is not None and not merge_dir.exists():  # one merge per version, whatever the engines' dtypes
            merge_checkpoint(base, adapter, merge_dir, target="hf", progress=False)
        written = checkpoint_state(base if adapter is None else merge_dir)
        if dtype is not None:
            written = {n: t.to(dtype) if t.is_floating_point() else t for n, t in written.items()}
    return Reference(oracle=model_state(model), written=written, decodes=hf_decodes(model, prompts, max_new_tokens),
                     extra_atol=extra_atol)


def verify_version(base: Path, vdir: Path, replay, engines: Sequence, *, tp: int, timeout_s: float) -> list[dict]:
    """Per engine (Ray actor handles of ``RolloutEngine``): weights vs PEFT's merge of the version
    (``replay``: the driver's ``AdapterReplay`` or ``None``, saved under ``vdir``), weights vs the
    ``weightsync merge`` output (written under ``vdir``), greedy generations vs the PEFT-merged model.
    Blocks up to ``timeout_s`` per engine call."""
    import ray

    from sync_service.fp8 import table_blocks
    from sync_service.verify.peft_oracle import engine_dtype

    adapter = None if replay is None else replay.save(vdir / "adapter")
    refs: dict[object, Reference] = {}  # per engine dtype (FP8: per table): the oracle cast once into it
    out = []
    for engine in engines:
        table = ray.get(engine.param_metas.remote(), timeout=timeout_s)
        fp8 = bool(table_blocks(table))
        key = tuple(sorted((m.name, m.dtype, tuple(m.shape)) for m in table)) if fp8 else engine_dtype(table)
        if key not in refs:
            refs[key] = reference(base, adapter, tp=tp, merge_dir=vdir / "merged", dtype=None if fp8 else key,
                                  table=table if fp8 else None)
        ref = refs[key]
        state = ray.get(engine.state.remote(), timeout=timeout_s)
        gens = [ray.get(engine.generate.remote(list(p), MAX_NEW_TOKENS), timeout=timeout_s) for p in PROMPTS]
        out.append(verdict(ref, state, [g[0] for g in gens], gens[0][1]))
    return out


def verify_weights(base: Path, engines: Sequence, replay, *, tp: int, timeout_s: float) -> list[dict]:
    """Per engine: its weights equal PEFT's ``merge_and_unload`` of the version's adapter (float64,
    cast once; up to the ulp bound of ``compare_state``, + ``TP_EXTRA_ATOL`` with TP blocks)."""
    import ray

    out = []
    oracles: dict[tuple, dict] = {}  # per engine table's dtypes: the oracle cast once (or quantized) into them
    with tempfile.TemporaryDirectory(prefix="wsoracle") as work:  # the replayed adapter, as PEFT reads it
        adapter = None if replay is None else replay.save(Path(work) / "adapter")
        for e in engines:
            table = ray.get(e.param_metas.remote(), timeout=timeout_s)
            dtypes = {m.name: m.dtype for m in table}
            key = tuple(sorted(dtypes.items()))
            if key not in oracles:
                oracles[key] = _weights_oracle(base, adapter, table)
            ref = Reference(oracle=oracles[key], extra_atol=0.0 if tp == 1 else TP_EXTRA_ATOL)
            out.append(verdict(ref, ray.get(e.state.remote(), timeout=timeout_s), None,
                               ray.get(e.weight_version.remote(), timeout=timeout_s)))
    return out


def _weights_oracle(base: Path, adapter: Path | None, table: Sequence) -> dict[str, torch.Tensor]:
    """PEFT's float64 merge in an engine's table (``ParamMeta``s): each tensor cast once into its dtype, block-FP8
    ones through transformers' quantizer (``verify.fp8_oracle``)."""
    from sync_service.fp8 import table_blocks
    from sync_service.verify.fp8_oracle import quantized_state
    from sync_service.verify.peft_oracle import model_state, peft_merged_model, peft_merged_state

    if not table_blocks(table):
        return peft_merged_state(base, adapter, dtypes={m.name: m.dtype for m in table})
    return quantized_state(model_state(peft_merged_model(base, adapter, dtype=torch.float64)), table)
