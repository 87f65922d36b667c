"""``weightsync merge`` says what ``--quantize fp8`` did (how many weights became FP8 of those transformers
quantizes; a warning naming a block that divides them all when the block leaves most unquantized: a small model
once had 4 of 56 quantized without a word), and writes an FP8 copy of a base without ``--adapter`` (a no-op
adapter had to be made), byte for byte transformers' ``Fp8Quantize`` of the base. In process (``main``)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from sync_service.entrypoints.cli import main
from sync_service.synthetic import make_adapter, make_base
from sync_service.verify.fp8_oracle import transformers_quantize

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge_cli")
    base = make_base("qwen3_moe", root / "base", num_layers=1)  # H=16, I=8: q/o_proj [16, 16], k/v_proj [8, 16]
    return {"base": base, "lora": make_adapter("qwen3_moe", base, root / "lora", kind="target_parameters")}


def merge(capsys, *argv: str) -> tuple[dict, list[str]]:
    capsys.readouterr()
    assert main(["merge", "--no-progress", *argv]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    return json.loads(out), err.strip().splitlines()


def test_quantize_reports_how_many_weights_became_fp8_and_warns_when_most_did_not(files, tmp_path, capsys):
    summary, err = merge(capsys, "--base", str(files["base"]), "--adapter", str(files["lora"]), "--out",
                         str(tmp_path / "b16"), "--quantize", "fp8", "--weight-block-size", "16,16")
    # 1 layer: q/k/v/o_proj and 4 experts x (gate, up, down) on disk = 16 weights; 16x16 divides q_proj and o_proj
    assert (summary["quantized"], summary["quantizable"]) == (2, 16), summary
    assert err == ["weightsync merge: --quantize fp8: 2 of 16 weights transformers quantizes are FP8 "
                   "(--weight-block-size 16,16); the other 14 stay bfloat16: the block does not divide their last "
                   "two dims (e.g. model.layers.0.self_attn.k_proj.weight [8, 16])",
                   "weightsync merge: warning: the block leaves most weights unquantized; --weight-block-size 8,8 "
                   "divides them all"], err
    written = load_file(str(tmp_path / "b16" / "model.safetensors"))
    assert sum(t.dtype == FP8 for t in written.values()) == 2
    summary, err = merge(capsys, "--base", str(files["base"]), "--adapter", str(files["lora"]), "--out",
                         str(tmp_path / "b8"), "--quantize", "fp8", "--weight-block-size", "8,8")
    assert err == ["weightsync merge: --quantize fp8: 16 of 16 weights transformers quantizes are FP8 "
                   "(--weight-block-size 8,8)"], err
    assert "unquantized" not in summary


def test_quantize_without_an_adapter_writes_an_fp8_copy_of_the_base(files, tmp_path, capsys):
    from sync_service.merge.fp8_base import open_base

    summary, _ = merge(capsys, "--base", str(files["base"]), "--out", str(tmp_path / "fp8"), "--quantize", "fp8",
                       "--weight-block-size", "8,8")
    assert summary["changed"] == 0 and summary["quantized"] == 16
    base = load_file(str(files["base"] / "model.safetensors"))
    got = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    fp8 = sorted(k for k, t in got.items() if t.dtype == FP8)
    assert len(fp8) == 16
    for key in fp8:
        want = transformers_quantize(key, base[key].to(torch.float32), (8, 8))
        for name, tensor in want.items():  # values and scales, byte for byte
            assert tensor.dtype == got[name].dtype, name
            assert torch.equal(tensor.contiguous().view(torch.uint8), got[name].contiguous().view(torch.uint8)), name
    for key, tensor in got.items():  # the rest: the base cast once to bfloat16, as FP8 checkpoints ship
        if tensor.dtype != FP8 and not key.endswith("_scale_inv"):
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, base[key].to(torch.bfloat16)), key
    assert open_base(tmp_path / "fp8").block == (8, 8)  # reads back as a block-FP8 base
