"""Bad merge input: a ``MergeError`` (CLI: non-zero exit) naming the key and the fix; no output written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sync_service.merge.errors import MergeError
from sync_service.merge.export import merge_checkpoint
from sync_service.synthetic import make_adapter, make_non_lora_adapter

WEIGHTSYNC = Path(sys.executable).with_name("weightsync")
_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _rewrite_adapter(adapter_dir: Path, edit) -> Path:
    path = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return adapter_dir


def _expect_merge_error(base_dir, adapter_dir, out_dir, *fragments):
    with pytest.raises(MergeError) as info:
        merge_checkpoint(base_dir, adapter_dir, out_dir, progress=False)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in error message: {message}"
    assert not out_dir.exists(), f"{out_dir} created although the merge failed"
    assert not list(out_dir.parent.glob(f".{out_dir.name}*")), "temporary output left behind"
    return message


@pytest.fixture
def qwen3(base_factory):
    return base_factory("qwen3_moe", "float32")


def test_adapter_key_matching_no_base_tensor(qwen3, tmp_path):
    adapter = make_adapter("qwen3_moe", qwen3, tmp_path / "lora", kind="dense")

    def add_layer_7(t):
        t[_A.replace("layers.0", "layers.7")] = t[_A].clone()
        t[_A.replace("layers.0", "layers.7").replace("lora_A", "lora_B")] = t[_A.replace("lora_A", "lora_B")].clone()

    _rewrite_adapter(adapter, add_layer_7)
    _expect_merge_error(qwen3, adapter, tmp_path / "out", "layers.7.self_attn.q_proj")


def test_shape_mismatch_names_the_key(qwen3, tmp_path):
    adapter = make_adapter("qwen3_moe", qwen3, tmp_path / "lora", kind="dense")
    _rewrite_adapter(adapter, lambda t: t.__setitem__(_A, torch.ones(2, 12)))
    _expect_merge_error(qwen3, adapter, tmp_path / "out", "layers.0.self_attn.q_proj")


def test_expert_factor_shape_mismatch(qwen3, tmp_path):
    adapter = make_adapter("qwen3_moe", qwen3, tmp_path / "lora", kind="target_parameters")
    key = "base_model.model.model.layers.1.mlp.experts.lora_A.weight"  # down_proj: [r·E, I]
    _rewrite_adapter(adapter, lambda t: t.__setitem__(key, torch.ones(t[key].shape[0] + 1, t[key].shape[1])))
    _expect_merge_error(qwen3, adapter, tmp_path / "out", "layers.1.mlp.experts")


def test_lora_bias_rejected(base_factory, tmp_path):
    qwen2 = base_factory("qwen2_moe", "float32")  # q_proj has a bias
    adapter = make_adapter("qwen2_moe", qwen2, tmp_path / "lora", kind="dense", target_modules=["q_proj"], lora_bias=True)
    assert any("lora_B.bias" in k for k in load_file(adapter / "adapter_model.safetensors"))
    _expect_merge_error(qwen2, adapter, tmp_path / "out", "lora_bias")


def test_loha_adapter_rejected(qwen3, tmp_path):
    adapter = make_non_lora_adapter("qwen3_moe", qwen3, tmp_path / "loha", peft_type="loha")
    _expect_merge_error(qwen3, adapter, tmp_path / "out", "LOHA", "LoRA")


def test_config_of_another_family_is_refused_naming_it(qwen3, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    for file in qwen3.iterdir():
        (base / file.name).write_bytes(file.read_bytes())
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps(config | {"model_type": "granitemoe"}))
    adapter = make_adapter("qwen3_moe", qwen3, tmp_path / "lora", kind="dense")
    _expect_merge_error(base, adapter, tmp_path / "out", "model family granitemoe", "cannot build", "num_experts")


def test_existing_non_empty_out_dir_is_left_alone(qwen3, tmp_path):
    adapter = make_adapter("qwen3_moe", qwen3, tmp_path / "lora", kind="dense")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(MergeError, match="--out"):
        merge_checkpoint(qwen3, adapter, out, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(WEIGHTSYNC), "merge", *map(str, args)], capture_output=True, text=True, timeout=120)


def test_cli_merges_and_rejects_ia3(qwen3, tmp_path):
    lora = make_adapter("qwen3_moe", qwen3, tmp_path / "lora", kind="target_parameters")
    ia3 = make_non_lora_adapter("qwen3_moe", qwen3, tmp_path / "ia3", peft_type="ia3")

    ok = _cli("--base", qwen3, "--adapter", lora, "--out", tmp_path / "merged", "--dtype", "bfloat16", "--no-progress")
    assert ok.returncode == 0, ok.stderr
    summary = json.loads(ok.stdout.strip().splitlines()[-1])
    assert summary["changed"] > 0 and summary["shards"] == 1
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["dtype"] == "bfloat16"
    assert {v.dtype for v in load_file(str(tmp_path / "merged" / "model.safetensors")).values()} == {torch.bfloat16}

    bad = _cli("--base", qwen3, "--adapter", ia3, "--out", tmp_path / "bad")
    assert bad.returncode != 0
    assert "IA3" in bad.stderr and "LoRA" in bad.stderr, bad.stderr
    assert not (tmp_path / "bad").exists()
