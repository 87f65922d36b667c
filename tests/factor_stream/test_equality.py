"""Factor streaming leaves every engine tensor bitwise equal to a merged-mode sync of the same version.

In one process (``LocalSync``: real shards, real ``MergedSource``, real ``Sender`` / ``BucketReceiver``
over the shm transport), the same three versions are pushed once merged and once as factors, and
the two engines compared bit for bit after every version — and, under EP, bit for bit with weightsync's
merge of the unsharded base (``MergedSource`` of the whole model: sharding changes no bit) and within
fp32-merge rounding with PEFT's ``merge_and_unload`` in float64, cast once (``tests.oracle``: the value check).
"""

from __future__ import annotations

import pytest
import torch

from sync_service.entrypoints.local import AdapterReplay
from sync_service.merge.adapter import adapter_from_state_dict
from sync_service.merge.base import TensorDictBase
from sync_service.verify.peft_oracle import compare_state
from sync_service.merge.source import MergeConfig, MergedSource
from tests.factor_stream.conftest import differing, run_both
from tests.oracle import materialize


def reference(model, state) -> dict[str, torch.Tensor]:
    base = TensorDictBase(model.tensors)
    adapter = adapter_from_state_dict(model.peft_config, state, model.layout, base.metas())
    return materialize(MergedSource(base, adapter, config=MergeConfig()))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_factors_equal_merged_ep2_three_versions(model_factory, peft_oracle, family, dtype):
    model = model_factory(family, dtype)
    runs, log, state = run_both(model, ep=2)
    stats, merged = log[-1]
    # the engines changed (not a vacuous equality), under EP the merge is bitwise the unsharded merge
    assert differing(merged, model.tensors)
    assert not differing(merged, reference(model, state))
    replay = AdapterReplay(model.adapter_dir)
    replay.state = state
    check = compare_state(merged, peft_oracle.state(model.base_dir, replay))
    assert check.ok, f"differs from PEFT's merge in {check.mismatched[:4]} (max |diff| {check.max_abs_diff:.3g})"
    assert all(not s.full for s in stats.values())
    assert stats["factors"].bytes < stats["merged"].bytes
    engine = runs["factors"].engine
    pristine = sum(model.tensors[n].numel() * model.tensors[n].element_size() for n in runs["factors"].choice.factors)
    assert engine.resident_bytes() > pristine and engine.factor_ready()


@pytest.mark.parametrize("family,dtype", [("qwen3_moe", "float32"), ("gpt_oss", "bfloat16")])
def test_factors_equal_merged_under_tp2(model_factory, family, dtype):
    """The receiver merges the boxes the merged plan has (TP gate/up halves, down_proj columns): bitwise
    equal to merged mode even where box-shaped GEMMs round differently from a whole-tensor merge."""
    run_both(model_factory(family, dtype), ep=1, tp=2, versions=2)


@pytest.mark.parametrize("kind,extra", [
    ("dense", {}),                                            # 2D terms: attention, router, lm_head
    ("legacy", {}),                                           # per-expert terms, x travels transposed
    ("dense", {"use_dora": True}),                            # DoRA: streamed merged
    ("target_parameters", {"modules_to_save": ["lm_head"]}),  # replacement: streamed merged
])
def test_adapter_kinds_equal_merged(model_factory, kind, extra):
    model = model_factory("qwen3_moe", "bfloat16", kind, **extra)
    runs, _, _ = run_both(model, ep=2, versions=2)
    choice = runs["factors"].choice
    if extra.get("use_dora"):  # every dense target is DoRA here: nothing is factor-streamed, all still equal
        assert not choice.factors and set(choice.reasons.values()) == {"DoRA is not additive"}
        return
    if extra.get("modules_to_save"):
        assert choice.reasons["lm_head.weight"] == "modules_to_save replacement"
    assert choice.factors


def test_bf16_factors_travel_in_bf16_and_stay_bitwise_equal(model_factory):
    """A trainer holding bf16 factors ships them in bf16 (half the bytes of the fp32 terms), and the
    engine is still bitwise the merged-mode engine and the reference merge."""
    import dataclasses

    model = model_factory("qwen3_moe", "bfloat16")
    bf16 = dataclasses.replace(model, state={k: v.to(torch.bfloat16) for k, v in model.state.items()})
    runs, log, state = run_both(bf16, ep=2)
    recipes = [e for e in runs["factors"].plan.entries if e.recipe is not None]
    assert recipes and {e.dtype for e in recipes} == {"bfloat16"}
    stats, merged = log[-1]
    factor_bytes = sum(e.nbytes for e in recipes)  # 2 B per factor element; every block changed
    assert factor_bytes == sum(e.recipe.numel() for e in recipes) * 2
    assert factor_bytes <= stats["factors"].bytes < factor_bytes + 64 * len(recipes)  # + 64-byte entry alignment
    assert differing(merged, model.tensors) and not differing(merged, reference(bf16, state))
