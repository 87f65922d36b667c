"""Cases where the merge once disagreed with PEFT's ``merge_and_unload`` or wrote bad values: a
modules_to_save copy on a tied embedding, ``fan_in_fan_out`` on ``nn.Linear`` targets, non-finite
merged values, ``target_modules`` selecting nothing, and what ``"changed"`` counts. Inputs are
written by transformers + PEFT (``sync_service.synthetic``); the oracle is PEFT in float64, cast once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sync_service.entrypoints.cli import main
from sync_service.merge.adapter import load_adapter
from sync_service.merge.base import SafetensorsBase
from sync_service.merge.errors import MergeError
from sync_service.merge.export import merge_checkpoint
from sync_service.merge.source import MergeConfig, MergedSource
from sync_service.synthetic import make_adapter
from tests.merge.conftest import assert_matches, peft_oracle, read_checkpoint

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _edit_config(adapter: Path, **fields) -> Path:
    path = adapter / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return adapter


def _merge_cli_fails(capsys, tmp_path: Path, base: Path, adapter: Path, *extra: str) -> str:
    """``weightsync merge`` exits 2 with one error line and leaves nothing under ``tmp_path / 'out'``."""
    out = tmp_path / "out" / "merged"
    capsys.readouterr()  # drop the progress output of building the inputs
    rc = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--no-progress", *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("weightsync merge: error: "), repr(err)
    assert not (tmp_path / "out").exists(), list((tmp_path / "out").rglob("*"))
    return err


@pytest.mark.parametrize("saved", ["lm_head", "embed_tokens"])
def test_modules_to_save_on_a_tied_embedding_unties_as_peft(base_factory, tmp_path, saved):
    base = base_factory("qwen3_moe", "float32", tie_word_embeddings=True)
    adapter = make_adapter("qwen3_moe", base, tmp_path / "lora", kind="target_parameters", modules_to_save=[saved])
    merge_checkpoint(base, adapter, tmp_path / "merged", progress=False)
    oracle = peft_oracle(base, adapter, tmp_path / "oracle")
    got = read_checkpoint(tmp_path / "merged")
    assert_matches(got, oracle, base=read_checkpoint(base))
    base_embed = read_checkpoint(base)[EMBED]
    kept = EMBED if saved == "lm_head" else LM_HEAD  # the side PEFT did not wrap keeps the base values
    assert torch.equal(got[kept], base_embed) and not torch.equal(got[LM_HEAD], got[EMBED])
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert json.loads((tmp_path / "oracle" / "config.json").read_text())["tie_word_embeddings"] is False

    # a sync's owned boxes come from engines loaded from the tied base: refused, never half-applied
    provider = SafetensorsBase(base)
    lora = load_adapter(adapter, provider.layout, provider.metas(), tied_aliases=provider.tied_aliases)
    with pytest.raises(MergeError, match=r"ties .*untied copy of the base"):
        MergedSource(provider, lora, config=MergeConfig(), owned=provider.metas())


def test_fan_in_fan_out_is_ignored_on_linear_targets_as_peft(base_factory, tmp_path):
    base = base_factory("qwen3_moe", "float32")
    adapter = make_adapter("qwen3_moe", base, tmp_path / "lora", kind="dense")  # q/k/v/o: square and not
    _edit_config(adapter, fan_in_fan_out=True, target_parameters=None)  # (the router is a parameter target)
    weights = adapter / "adapter_model.safetensors"
    save_file({k: v for k, v in load_file(str(weights)).items() if ".mlp.gate." not in k}, str(weights))
    merge_checkpoint(base, adapter, tmp_path / "merged", progress=False)
    with pytest.warns(UserWarning, match="fan_in_fan_out is set to True but the target module is `torch.nn.Linear`"):
        oracle = peft_oracle(base, adapter, tmp_path / "oracle")
    assert_matches(read_checkpoint(tmp_path / "merged"), oracle, base=read_checkpoint(base))


def test_fan_in_fan_out_on_target_parameters_is_refused_as_peft(base_factory, tmp_path):
    base = base_factory("qwen3_moe", "float32")
    adapter = make_adapter("qwen3_moe", base, tmp_path / "lora", kind="target_parameters", target_modules=[])
    _edit_config(adapter, fan_in_fan_out=True, target_modules=None)
    with pytest.raises(ValueError, match="does not work with fan_in_fan_out"):
        peft_oracle(base, adapter, tmp_path / "oracle")
    with pytest.raises(MergeError, match=r"fan_in_fan_out=true does not work with target_parameters"):
        merge_checkpoint(base, adapter, tmp_path / "merged", progress=False)


def test_nan_in_a_modules_to_save_copy_is_refused(base_factory, tmp_path, capsys):
    base = base_factory("qwen3_moe", "float32")
    adapter = make_adapter("qwen3_moe", base, tmp_path / "lora", kind="target_parameters", modules_to_save=["lm_head"])
    weights = adapter / "adapter_model.safetensors"
    state = load_file(str(weights))
    key = next(k for k in state if k.endswith(LM_HEAD))
    state[key][3, 5] = float("nan")
    save_file(state, str(weights))
    err = _merge_cli_fails(capsys, tmp_path, base, adapter)
    assert f"merged {LM_HEAD} has NaN or Inf values" in err, err


def test_float16_overflow_is_refused(base_factory, tmp_path, capsys):
    base = base_factory("qwen3_moe", "float32")
    adapter = _edit_config(make_adapter("qwen3_moe", base, tmp_path / "lora", kind="target_parameters"), lora_alpha=1e30)
    err = _merge_cli_fails(capsys, tmp_path, base, adapter, "--dtype", "float16")
    assert "overflows float16" in err and "lora_alpha / r" in err, err


def test_target_modules_selecting_nothing_is_refused_as_peft(base_factory, tmp_path, capsys):
    base = base_factory("qwen3_moe", "float32")
    adapter = make_adapter("qwen3_moe", base, tmp_path / "lora", kind="dense")
    _edit_config(adapter, target_modules=r".*\.no_such_proj", target_parameters=None)
    save_file({}, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="Target modules .* not found in the base model"):
        peft_oracle(base, adapter, tmp_path / "oracle")
    err = _merge_cli_fails(capsys, tmp_path, base, adapter)
    assert str(adapter) in err and "select no module" in err and "fix target_modules" in err, err


@pytest.mark.parametrize("kind", ["target_parameters", "legacy"])
def test_changed_counts_tensors_as_written(base_factory, tmp_path, kind):
    base = base_factory("qwen3_moe", "float32")
    adapter = make_adapter("qwen3_moe", base, tmp_path / "lora", kind=kind)
    if kind == "legacy":  # keep LoRA on expert 1 only: 3 of the 12 per-expert tensors of a layer change
        state = load_file(str(adapter / "adapter_model.safetensors"))
        save_file({k: v for k, v in state.items() if ".experts." not in k or ".experts.1." in k},
                  str(adapter / "adapter_model.safetensors"))
    summary = merge_checkpoint(base, adapter, tmp_path / "merged", progress=False)
    before, after = read_checkpoint(base), read_checkpoint(tmp_path / "merged")
    differ = sum(not torch.equal(before[k], after[k]) for k in after)
    assert summary["tensors"] == len(after) and summary["changed"] == differ > 0
