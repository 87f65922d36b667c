"""Merge-core cases beyond the matrix: DoRA, modules_to_save, tied embeddings, a VL-prefixed
checkpoint, the hf-fused target, loading the output with ``from_pretrained``, and the oracles
checked against each other."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from sync_service.merge.export import merge_checkpoint
from sync_service.synthetic import FAMILIES, make_adapter
from tests.merge.conftest import (
    assert_matches,
    base_dtype,
    hand_oracle,
    peft_merged_model,
    peft_oracle,
    read_checkpoint,
)

DTYPES = ("float32", "bfloat16")


def _merge_and_compare(base_dir, adapter_dir, tmp_path, **merge_kwargs):
    merge_checkpoint(base_dir, adapter_dir, tmp_path / "merged", progress=False, **merge_kwargs)
    oracle = peft_oracle(base_dir, adapter_dir, tmp_path / "oracle")
    base = read_checkpoint(base_dir)
    assert_matches(read_checkpoint(tmp_path / "merged"), oracle, base=base)
    return oracle, base


def _changed(oracle, base):
    return {n for n, w in oracle.items() if not torch.equal(base[n], w)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_dora_on_dense_modules(base_factory, tmp_path, family, dtype):
    base_dir = base_factory(family, dtype)
    adapter = make_adapter(family, base_dir, tmp_path / "lora", kind="dense", r=2, lora_alpha=6, use_dora=True)
    assert any("lora_magnitude_vector" in k for k in load_file(adapter / "adapter_model.safetensors"))
    oracle, base = _merge_and_compare(base_dir, adapter, tmp_path)
    assert any("self_attn.o_proj" in n for n in _changed(oracle, base))


@pytest.mark.parametrize("dtype", DTYPES)
def test_modules_to_save_replaces_the_module(base_factory, tmp_path, dtype):
    base_dir = base_factory("qwen3_moe", dtype)
    adapter = make_adapter(
        "qwen3_moe", base_dir, tmp_path / "lora", kind="target_parameters", modules_to_save=["lm_head"]
    )
    oracle, base = _merge_and_compare(base_dir, adapter, tmp_path)
    assert "lm_head.weight" in _changed(oracle, base)


@pytest.mark.parametrize("save_embedding_layers", [False, True], ids=["factors-only", "with-embedding-copy"])
@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_tied_embeddings_with_lora_on_embedding(base_factory, tmp_path, target, save_embedding_layers):
    base_dir = base_factory("qwen3_moe", "float32", tie_word_embeddings=True)
    assert "lm_head.weight" not in read_checkpoint(base_dir)
    adapter = make_adapter(
        "qwen3_moe", base_dir, tmp_path / "lora", kind="dense", target_modules=["q_proj", target],
        save_embedding_layers=save_embedding_layers,
    )
    oracle, base = _merge_and_compare(base_dir, adapter, tmp_path)
    assert "model.embed_tokens.weight" in _changed(oracle, base)


def test_untied_lm_head_with_saved_embedding_copy(base_factory, tmp_path):
    base_dir = base_factory("mixtral", "bfloat16")
    adapter = make_adapter("mixtral", base_dir, tmp_path / "lora", kind="dense", save_embedding_layers=True)
    assert any("lm_head.base_layer" in k for k in load_file(adapter / "adapter_model.safetensors"))
    _merge_and_compare(base_dir, adapter, tmp_path)


def _to_vl(text_dir, vl_dir):
    """A VL-style checkpoint: the language model's keys under ``model.language_model.``, the text
    config under ``text_config`` of an outer config (how Qwen-VL-style checkpoints nest it)."""
    vl_dir.mkdir()
    tensors = {(f"model.language_model.{k.removeprefix('model.')}" if k.startswith("model.") else k): v
               for k, v in read_checkpoint(text_dir).items()}
    save_file(tensors, str(vl_dir / "model.safetensors"), metadata={"format": "pt"})
    text_config = json.loads((text_dir / "config.json").read_text())
    config = {"model_type": "synthetic_vl", "architectures": ["SyntheticVLForConditionalGeneration"],
              "dtype": text_config["dtype"], "text_config": text_config, "vision_config": {"hidden_size": 8}}
    (vl_dir / "config.json").write_text(json.dumps(config))


def _adapter_to_vl(adapter_dir, vl_adapter_dir):
    vl_adapter_dir.mkdir()
    prefix = "base_model.model.model."
    tensors = {k.replace(prefix, f"{prefix}language_model.", 1): v
               for k, v in load_file(adapter_dir / "adapter_model.safetensors").items()}
    save_file(tensors, str(vl_adapter_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (vl_adapter_dir / "adapter_config.json").write_text((adapter_dir / "adapter_config.json").read_text())


@pytest.mark.parametrize("kind", ["target_parameters", "legacy"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_vl_prefixed_checkpoint(base_factory, tmp_path, family, kind):
    text_dir = base_factory(family, "bfloat16")
    adapter = make_adapter(family, text_dir, tmp_path / "lora", kind=kind, r=2, lora_alpha=6)
    oracle = hand_oracle(text_dir, adapter) if kind == "legacy" else peft_oracle(text_dir, adapter, tmp_path / "oracle")
    _to_vl(text_dir, tmp_path / "vl-base")
    _adapter_to_vl(adapter, tmp_path / "vl-lora")

    merge_checkpoint(tmp_path / "vl-base", tmp_path / "vl-lora", tmp_path / "merged", progress=False)

    want = {(f"model.language_model.{k.removeprefix('model.')}" if k.startswith("model.") else k): v
            for k, v in oracle.items()}
    assert_matches(read_checkpoint(tmp_path / "merged"), want, base=read_checkpoint(tmp_path / "vl-base"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_hf_fused_target_has_in_memory_names(base_factory, tmp_path, family, dtype):
    base_dir = base_factory(family, dtype)
    adapter = make_adapter(family, base_dir, tmp_path / "lora", kind="target_parameters", r=2, lora_alpha=6)

    merge_checkpoint(base_dir, adapter, tmp_path / "merged", target="hf-fused", progress=False)

    merged = peft_merged_model(base_dir, adapter).to(base_dtype(base_dir))
    want = {k: v.contiguous() for k, v in merged.state_dict().items()}
    assert_matches(read_checkpoint(tmp_path / "merged"), want)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_output_loads_with_from_pretrained_and_matches_peft_logits(base_factory, tmp_path, family):
    from transformers import AutoModelForCausalLM

    base_dir = base_factory(family, "float32")
    adapter = make_adapter(family, base_dir, tmp_path / "lora", kind="target_parameters", r=2, lora_alpha=6)
    summary = merge_checkpoint(base_dir, adapter, tmp_path / "merged", max_shard_bytes=8_000, progress=False)
    assert summary["shards"] > 1 and (tmp_path / "merged" / "model.safetensors.index.json").exists()

    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    # float64 merge cast once to float32, run in float32 (grouped expert matmuls take no float64)
    want_model = peft_merged_model(base_dir, adapter).float().eval()
    base_model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        got, want, before = loaded(ids).logits, want_model(ids).logits, base_model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (want - before).abs().max() > 1e-3, "the adapter does not change the logits: test is vacuous"


def test_hand_oracle_agrees_with_peft_where_peft_is_right(base_factory, tmp_path):
    """Checks the oracles against each other: a legacy Mixtral adapter with α/r scaling (PEFT's
    block-diagonal conversion is exact there) and a dense adapter with shared-expert LoRA."""
    mixtral = base_factory("mixtral", "float32")
    legacy = make_adapter("mixtral", mixtral, tmp_path / "legacy", kind="legacy", r=2, lora_alpha=6)
    assert_matches(hand_oracle(mixtral, legacy), peft_oracle(mixtral, legacy, tmp_path / "o1"))
    qwen2 = base_factory("qwen2_moe", "float32")
    dense = make_adapter("qwen2_moe", qwen2, tmp_path / "dense", kind="dense", r=2, lora_alpha=6, use_rslora=True)
    assert_matches(hand_oracle(qwen2, dense), peft_oracle(qwen2, dense, tmp_path / "o2"))


def test_peft_is_not_the_oracle_for_legacy_rslora(base_factory, tmp_path):
    """PEFT fuses legacy gate/up LoRA to rank 2r, alpha 2α: with rsLoRA the scaling becomes
    2α/√(2r) = √2·α/√r, so its merged experts differ from the per-expert definition."""
    mixtral = base_factory("mixtral", "float32")
    legacy = make_adapter("mixtral", mixtral, tmp_path / "legacy", kind="legacy", r=2, lora_alpha=6, use_rslora=True)
    by_hand, by_peft = hand_oracle(mixtral, legacy), peft_oracle(mixtral, legacy, tmp_path / "o")
    name = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    assert not torch.allclose(by_hand[name], by_peft[name])
    name = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(by_hand[name], by_peft[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_comparison_catches_one_wrong_element(dtype):
    want = {"w": torch.linspace(-1, 1, 64, dtype=dtype).reshape(8, 8)}
    assert_matches({"w": want["w"].clone()}, want)
    off = want["w"].clone()
    off[3, 3] = off[3, 3] * 1.05 + 0.01
    with pytest.raises(AssertionError):
        assert_matches({"w": off}, want)
    with pytest.raises(AssertionError, match="missing"):
        assert_matches({"w": want["w"], "extra": want["w"]}, {"w": want["w"], "other": want["w"]})
