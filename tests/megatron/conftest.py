"""Megatron-Core tests: skipped where the Megatron stack is not installed (``scripts/setup-megatron.sh``, a step
of ``scripts/setup.sh``). Inputs are generated: a tiny Qwen3-MoE (2 layers, 4 experts, 4 query heads in 2
groups: TP=2 splits it) that Megatron-Bridge converts."""

import importlib.util

import pytest

if importlib.util.find_spec("megatron.bridge") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("Megatron-Core / Megatron-Bridge not installed (scripts/setup-megatron.sh)", allow_module_level=True)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """The HF Qwen3-MoE the Megatron models are converted from (fp32, H=32, I=16, E=4, 4 heads / 2 KV heads)."""
    from sync_service.synthetic.base import make_base

    return make_base("qwen3_moe", tmp_path_factory.mktemp("hf") / "qwen3_moe", hidden=32, intermediate=16,
                     num_experts=4, vocab_size=64,
                     config_overrides={"num_key_value_heads": 2, "num_attention_heads": 4, "head_dim": 8})
