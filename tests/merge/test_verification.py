"""What ``weightsync sync`` / ``demo`` call "verified": engines compared with PEFT's own
``merge_and_unload`` (``verify.peft_oracle``, float64, cast once), never only with weightsync's merge.

Without Ray: the comparison accepts weightsync's merge and rejects the wrong rules a merge can have
(a term missing, a wrong scaling, a tied pair left tied). With Ray (one session): real trainers and
engines are verified against the oracle version by version, and a sync whose adapter would untie
the engines' tied embeddings is refused before anything is applied.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sync_service.entrypoints.local import AdapterReplay
from sync_service.verify.peft_oracle import compare_state, peft_merged_state, values_match
from sync_service.synthetic import make_adapter, make_base
from tests.oracle import our_merge

Q = "model.layers.0.self_attn.q_proj.weight"


def _ours(base, adapter):
    """weightsync's merge (``MergedSource`` over the whole base) of an adapter directory: the thing verified."""
    return our_merge(base, AdapterReplay(adapter))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_oracle_accepts_our_merge_and_rejects_wrong_rules(base_factory, tmp_path, dtype):
    base = base_factory("qwen3_moe", dtype)
    adapter = make_adapter("qwen3_moe", base, tmp_path / "lora", kind="target_parameters", r=4, lora_alpha=16)
    oracle = peft_merged_state(base, adapter)
    ours = _ours(base, adapter)
    assert {t.dtype for t in oracle.values()} == {getattr(torch, dtype)}
    check = compare_state({n: t.float().numpy() for n, t in ours.items()}, oracle)  # as engines report (bf16 widened)
    assert check.ok, check.mismatched
    assert check.max_abs_diff < (1e-6 if dtype == "float32" else 1e-2)

    base_q = load_file(str(base / "model.safetensors"))[Q]
    missing_term = {**ours, Q: base_q}
    double_scaling = {**ours, Q: (2 * ours[Q].double() - base_q.double()).to(base_q.dtype)}
    for wrong in (missing_term, double_scaling):
        check = compare_state(wrong, oracle)
        assert not check.ok and check.mismatched == (Q,)
    assert compare_state({**ours, "lm_head.weight": ours["model.embed_tokens.weight"]}, oracle).mismatched != ()


def test_values_match_tolerates_rounding_only():
    torch.manual_seed(0)
    w = torch.randn(64, 64, dtype=torch.float64)
    delta = 0.05 * torch.randn(64, 4, dtype=torch.float64) @ torch.randn(4, 64, dtype=torch.float64)
    oracle = (w + delta).float()
    fp32 = (w.float() + delta.float())  # fp32 accumulation, as the merge kernel does
    assert values_match(fp32, oracle)[0]
    assert not values_match(w.float() + delta.T.float(), oracle)[0]  # a transposed ΔW
    bf16 = (w.float() + delta.float()).bfloat16()
    assert values_match(bf16, (w + delta).bfloat16())[0]
    assert not values_match(w.bfloat16(), (w + delta).bfloat16())[0]  # the term dropped


def test_sync_cli_refuses_an_untying_adapter_before_ray(base_factory, tmp_path, capsys):
    import ray

    from sync_service.entrypoints.cli import main

    tied = base_factory("qwen3_moe", "float32", tie_word_embeddings=True)
    untying = make_adapter("qwen3_moe", tied, tmp_path / "untying", kind="target_parameters", modules_to_save=["lm_head"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["sync", "--base", str(tied), "--adapter", str(untying), "--ep", "1"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("weightsync sync: error: --adapter: ") and "untied copy of the base" in err, err
    assert not ray.is_initialized()


def test_sync_verified_against_peft_and_untying_adapter_refused(ray_local, tmp_path):
    import ray

    from sync_service.api import SyncConfig, WeightSync
    from actors.launch import start_engines, start_trainers
    from sync_service.verify.hf import verify_version

    base = make_base("qwen3_moe", tmp_path / "base", num_experts=4)
    adapter = make_adapter("qwen3_moe", base, tmp_path / "lora", kind="target_parameters", r=2)
    trainers = start_trainers(base, adapter, ep=2, timeout_s=90)
    engines = start_engines(base, 1, timeout_s=90)
    sync = WeightSync(trainers=trainers, engines=engines, config=SyncConfig(bucket_bytes=8 << 10, timeout_s=90))
    replay = AdapterReplay(adapter)
    for v in range(2):
        if v:
            ray.get([t.train_step.remote(v) for t in trainers], timeout=90)
            replay.step(v)
        sync.push(v)
        (row,) = verify_version(base, tmp_path / f"v{v}", replay, engines, tp=1, timeout_s=90)
        assert row["verified"] and row["weights_equal_reference"] and row["weight_version"] == v, row
    sync.close()

    tied = make_base("qwen3_moe", tmp_path / "tied", tie_word_embeddings=True)
    untying = make_adapter("qwen3_moe", tied, tmp_path / "untying", kind="target_parameters", modules_to_save=["lm_head"])
    trainers_t = start_trainers(tied, untying, ep=1, timeout_s=90)
    engines_t = start_engines(tied, 1, timeout_s=90, prefix="tied")
    sync_t = WeightSync(trainers=trainers_t, engines=engines_t, config=SyncConfig(bucket_bytes=8 << 10, timeout_s=90))
    with pytest.raises(Exception, match=r"lm_head\.weight / model\.embed_tokens\.weight.*untied copy of the base"):
        sync_t.push(0)
    state = ray.get(engines_t[0].state.remote(), timeout=90)
    assert ray.get(engines_t[0].weight_version.remote(), timeout=90) is None
    assert sorted(state) == sorted(peft_merged_state(tied, None))  # still the tied base's table, untouched
    np.testing.assert_array_equal(state["model.embed_tokens.weight"],
                                  load_file(str(tied / "model.safetensors"))["model.embed_tokens.weight"].numpy())
    sync_t.close()
