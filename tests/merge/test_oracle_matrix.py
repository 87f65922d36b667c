"""``merge_checkpoint`` (target hf) against float64 oracles: every family × adapter kind × scaling × dtype.

Oracles (see conftest): PEFT ``merge_and_unload`` for PEFT-made adapters (dense, target_parameters),
the by-hand float64 merge for legacy per-expert adapters.
"""

from __future__ import annotations

import pytest

from sync_service.merge.export import merge_checkpoint
from sync_service.synthetic import ADAPTER_KINDS, FAMILIES, FamilySpec, make_adapter
from tests.merge.conftest import assert_matches, hand_oracle, peft_oracle, read_checkpoint


def _patterns(spec: FamilySpec, kind: str) -> dict:
    """rank_pattern / alpha_pattern per kind: some modules get their own rank, others their own alpha."""
    first_attn = spec.attention[0]
    if kind == "dense":
        return dict(rank_pattern={"o_proj": 4}, alpha_pattern={first_attn: 3, "lm_head": 10})
    if kind == "target_parameters":
        return dict(rank_pattern={"down_proj": 3, "o_proj": 4}, alpha_pattern={"gate_up_proj": 5, first_attn: 3})
    gate, up, down = spec.legacy_experts[1]
    return dict(rank_pattern={"o_proj": 4, down: 3}, alpha_pattern={first_attn: 3, up: 5})


SCALINGS = {
    "alpha": lambda spec, kind: dict(r=2, lora_alpha=6),
    "rslora": lambda spec, kind: dict(r=4, lora_alpha=6, use_rslora=True),
    "patterns": lambda spec, kind: dict(r=2, lora_alpha=6, **_patterns(spec, kind)),
}

# The first six families run every scaling; the families added from transformers' list skip plain "alpha"
# ("patterns" scales most modules by plain alpha / r too), to keep the matrix within a few minutes of CI.
_FIRST_SIX = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss")

CASES = [
    pytest.param(family, kind, scaling, dtype, id=f"{family}-{kind}-{scaling}-{dtype}")
    for family, spec in FAMILIES.items()
    for kind in ADAPTER_KINDS
    if not (kind == "legacy" and spec.legacy_experts is None)  # gpt_oss, llama4, ... experts were always fused
    for scaling in SCALINGS
    if family in _FIRST_SIX or scaling != "alpha"
    for dtype in ("float32", "bfloat16")
]

# A tensor name fragment the adapter of each kind must change (so a test cannot pass vacuously).
# Each entry: fragments of which one must name a changed tensor (granitemoe stores experts as input_linear/output_linear).
_MUST_CHANGE = {"dense": (("self_attn.",), ("lm_head",)), "target_parameters": (("experts.", "_linear."),),
                "legacy": (("experts.",),)}


@pytest.mark.parametrize("family,kind,scaling,dtype", CASES)
def test_merge_matches_oracle(base_factory, tmp_path, family, kind, scaling, dtype):
    spec = FAMILIES[family]
    base_dir = base_factory(family, dtype)
    adapter_dir = make_adapter(family, base_dir, tmp_path / "lora", kind=kind, seed=7, **SCALINGS[scaling](spec, kind))

    summary = merge_checkpoint(base_dir, adapter_dir, tmp_path / "merged", target="hf", progress=False)

    oracle = hand_oracle(base_dir, adapter_dir) if kind == "legacy" else peft_oracle(base_dir, adapter_dir, tmp_path / "oracle")
    base = read_checkpoint(base_dir)
    assert_matches(read_checkpoint(tmp_path / "merged"), oracle, base=base)
    changed = {name for name, w in oracle.items() if not (base[name] == w).all()}
    for fragments in _MUST_CHANGE[kind]:
        assert any(f in name for f in fragments for name in changed), f"oracle changed no {fragments} tensor: {sorted(changed)}"
    assert summary["tensors"] == len(oracle)
