"""``weightsync merge --quantize fp8`` against transformers' own FP8 checkpoint of PEFT's float64 merge.

Reference: PEFT's ``merge_and_unload`` in float64 (``verify.peft_oracle``), saved, then
- names, dtypes, the set of quantized tensors and ``quantization_config``: transformers' own checkpoint of it,
  loaded with ``FineGrainedFP8Config`` (quantized on load) and written by ``save_pretrained``. transformers
  refuses on-the-fly FP8 quantization without a GPU in ``validate_environment`` only (its quantization ops
  are plain torch), so that checkpoint is built with the check switched off.
- bytes and scales: transformers' ``Fp8Quantize._quantize_one`` of each of those tensors of PEFT's merge cast
  to float32. Not the on-load checkpoint's bytes: transformers 5.19's loader casts a weight to the FP8
  parameter's dtype *before* its quantize op runs (``core_model_loading``: ``_dtype = empty_param.dtype``), so
  on-load quantization rounds the raw values to FP8 first and quantizes those (a few % off in the scales).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sync_service.merge.errors import MergeError
from sync_service.merge.export import merge_checkpoint
from sync_service.merge.export_fp8 import Fp8Options
from sync_service.synthetic import make_adapter, make_base
from sync_service.verify.fp8_oracle import transformers_quantize
from sync_service.verify.peft_oracle import peft_merged_model

FP8 = torch.float8_e4m3fn
CASES = {  # id: (family, base dtype, block, scale_fmt)
    "qwen3_moe-bf16-16": ("qwen3_moe", "bfloat16", (16, 16), "float"),
    "qwen3_moe-fp32-32-ue8m0": ("qwen3_moe", "float32", (32, 32), "ue8m0"),  # k/v_proj [16, 32]: passed through
    "granitemoe-bf16-16": ("granitemoe", "bfloat16", (16, 16), "float"),  # experts fused on disk
}
_BUILT: dict[str, dict] = {}


def _transformers_fp8(src: Path, out: Path, block, scale_fmt: str) -> Path:
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None)
        config = FineGrainedFP8Config(weight_block_size=list(block), scale_fmt=scale_fmt)
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, quantization_config=config)
    model.save_pretrained(str(out))
    return out


def _case(case_id: str, root: Path) -> dict:
    """Base, adapter, PEFT's float64 merge on disk and transformers' FP8 checkpoint of it (built once)."""
    if case_id not in _BUILT:
        family, dtype, block, scale_fmt = CASES[case_id]
        base = make_base(family, root / "base", dtype=dtype, hidden=32, intermediate=32, num_experts=4, vocab_size=64)
        adapter = make_adapter(family, base, root / "lora", kind="target_parameters", r=4, lora_alpha=16,
                               init_scale=0.3, seed=1)
        peft_merged_model(base, adapter, dtype=torch.float64).save_pretrained(str(root / "peft64"))
        on_load = _transformers_fp8(root / "peft64", root / "reference", block, scale_fmt)
        peft64 = load_file(str(root / "peft64" / "model.safetensors"))
        reference = {}
        for key, tensor in load_file(str(on_load / "model.safetensors")).items():
            if tensor.dtype == FP8:
                reference |= transformers_quantize(key, peft64[key].to(torch.float32), block, scale_fmt)
            elif not key.endswith("_scale_inv"):
                reference[key] = peft64[key].to(torch.float32)
        save_file(reference, str(on_load / "model.safetensors"), metadata={"format": "pt"})
        _BUILT[case_id] = {"base": base, "adapter": adapter, "block": block, "scale_fmt": scale_fmt, "root": root,
                           "peft64": peft64, "reference": reference}
    return _BUILT[case_id]


@pytest.fixture(params=list(CASES))
def case(request, tmp_path_factory):
    return _case(request.param, tmp_path_factory.mktemp(request.param))


def _merge(case: dict, out: Path, accumulate_dtype: str) -> dict[str, torch.Tensor]:
    fp8 = Fp8Options(weight_block_size=case["block"], scale_fmt=case["scale_fmt"])
    summary = merge_checkpoint(case["base"], case["adapter"], out, quantize="fp8", fp8=fp8,
                               accumulate_dtype=accumulate_dtype, progress=False)
    tensors = load_file(str(out / "model.safetensors"))
    assert summary["tensors"] == len(tensors) and summary["quantized"] == sum(t.dtype == FP8 for t in tensors.values())
    return tensors


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_float64_accumulation_writes_transformers_fp8_bitwise(case, tmp_path):
    ours, reference = _merge(case, tmp_path / "out", "float64"), case["reference"]
    assert ours.keys() == reference.keys()
    quantized = {k for k, t in ours.items() if t.dtype == FP8}
    assert quantized == {k for k, t in reference.items() if t.dtype == FP8}
    assert quantized and not any(("embed" in k or "lm_head" in k or "norm" in k or "router" in k or ".mlp.gate." in k)
                                 for k in quantized), sorted(quantized)
    if case["block"] == (32, 32):
        assert not any("k_proj" in k or "v_proj" in k for k in quantized)  # [16, 32]: passed through, as transformers
    for key, want in reference.items():
        got = ours[key]
        if want.dtype == FP8 or key.endswith("_scale_inv"):
            assert got.dtype == want.dtype and torch.equal(_bytes(got), _bytes(want)), key
        else:  # left unquantized: bfloat16, PEFT's float64 merge cast once
            assert got.dtype == torch.bfloat16 and torch.equal(got, case["peft64"][key].to(torch.bfloat16)), key
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    want_config = json.loads((case["root"] / "reference" / "config.json").read_text())
    assert config["quantization_config"] == want_config["quantization_config"] and config["dtype"] == "bfloat16"


def _fp8_steps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Distance of two float8_e4m3fn tensors in representable steps (sign-magnitude codes → ordinals)."""
    def ordinal(t):
        code = _bytes(t).to(torch.int32)
        return torch.where(code >= 128, -(code - 128), code)
    return (ordinal(got) - ordinal(want)).abs()


def test_float32_accumulation_is_within_one_fp8_step(tmp_path, tmp_path_factory):
    case = _case("qwen3_moe-bf16-16", tmp_path_factory.mktemp("qwen3_moe-bf16-16"))
    ours, reference = _merge(case, tmp_path / "out", "float32"), case["reference"]
    equal = total = 0
    for key, want in reference.items():
        if want.dtype == FP8:
            steps = _fp8_steps(ours[key], want)
            assert int(steps.max()) <= 1, key
            equal, total = equal + int((steps == 0).sum()), total + steps.numel()
        elif key.endswith("_scale_inv"):
            torch.testing.assert_close(ours[key], want, rtol=2e-7, atol=0)
    assert equal / total >= 0.999, f"{equal}/{total} FP8 bytes equal"


def test_transformers_loads_ours_as_fp8(case, tmp_path):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    _merge(case, tmp_path / "out", "float64")
    config = FineGrainedFP8Config(weight_block_size=list(case["block"]), scale_fmt=case["scale_fmt"], dequantize=True)
    ours = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), quantization_config=config).state_dict()
    config = FineGrainedFP8Config(weight_block_size=list(case["block"]), scale_fmt=case["scale_fmt"], dequantize=True)
    reference = AutoModelForCausalLM.from_pretrained(str(case["root"] / "reference"), quantization_config=config).state_dict()
    assert ours.keys() == reference.keys()
    for name, want in reference.items():  # dequantized: equal; unquantized: ours bf16, the reference's float32
        torch.testing.assert_close(ours[name].float(), want.float(), rtol=2**-8, atol=0, msg=name)


def test_refused_before_anything_is_written(tmp_path):
    base = make_base("gpt_oss", tmp_path / "gpt_oss", hidden=32, intermediate=32, num_experts=4, vocab_size=64)
    adapter = make_adapter("gpt_oss", base, tmp_path / "lora", kind="target_parameters", r=2)
    with pytest.raises(MergeError, match="gpt_oss: transformers cannot FP8-quantize it .*bias"):
        merge_checkpoint(base, adapter, tmp_path / "out", quantize="fp8")
    with pytest.raises(MergeError, match="--quantize mxfp4 is not supported: .*triton kernels fetched from the Hub"):
        merge_checkpoint(base, adapter, tmp_path / "out", quantize="mxfp4")
    with pytest.raises(MergeError, match="need --quantize fp8"):
        merge_checkpoint(base, adapter, tmp_path / "out", fp8=Fp8Options(scale_fmt="ue8m0"))
    for block in ((True, True), (16.0, 16), (0, 16)):  # bool is an int, but config.json would say [true, true]
        with pytest.raises(MergeError, match=r"--weight-block-size .*: give two positive integers"):
            merge_checkpoint(base, adapter, tmp_path / "out", quantize="fp8", fp8=Fp8Options(weight_block_size=block))
    assert not (tmp_path / "out").exists()


def test_a_block_that_divides_nothing_is_refused_naming_one_that_does(tmp_path, capsys):
    """The demo-sized model (H=16, I=8: no dim divides the default 128 x 128) would get no FP8 tensor at all."""
    from sync_service.entrypoints import merge_cli
    import argparse

    base = make_base("qwen3_moe", tmp_path / "base", hidden=32, intermediate=16, num_experts=4, vocab_size=64)
    adapter = make_adapter("qwen3_moe", base, tmp_path / "lora", kind="target_parameters", r=2)
    with pytest.raises(MergeError, match=r"--weight-block-size 128,128 divides none of the tensors transformers "
                                         r"quantizes \(e\.g\. .*\); nothing would be FP8 .* e\.g\. --weight-block-size 16,16"):
        merge_checkpoint(base, adapter, tmp_path / "out", quantize="fp8")
    assert not (tmp_path / "out").exists()
    capsys.readouterr()  # the generators' progress bars
    parser = argparse.ArgumentParser()
    merge_cli.add_arguments(parser)
    args = parser.parse_args(["--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "o"),
                              "--quantize", "fp8", "--no-progress"])
    assert merge_cli.run(args) == 2 and not (tmp_path / "o").exists()
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "e.g. --weight-block-size 16,16" in err, err
    assert merge_checkpoint(base, adapter, tmp_path / "ok", quantize="fp8", fp8=Fp8Options(weight_block_size=(16, 16)),
                            progress=False)["quantized"] > 0


def test_cli_refuses_mxfp4_in_one_line(tmp_path, capsys):
    from sync_service.entrypoints import merge_cli
    import argparse

    parser = argparse.ArgumentParser()
    merge_cli.add_arguments(parser)
    args = parser.parse_args(["--base", str(tmp_path), "--adapter", str(tmp_path), "--out", str(tmp_path / "o"),
                              "--quantize", "mxfp4", "--no-progress"])
    assert merge_cli.run(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--quantize mxfp4 is not supported" in err, err
