"""``weightsync sync --engine-base DIR``: engines load another checkpoint of the same model (here the fp32
base saved in bf16); the trainers merge in the accumulation dtype and cast once into the engines' dtype, and
the run verifies against PEFT's float64 merge cast once into bf16. Bad engine bases are refused before Ray
in one line (in process); the sync itself runs once through the console script, into bf16 engines and into
block-FP8 engines of each scale format, float32 and ue8m0 (``weightsync merge --quantize fp8 [--scale-fmt ue8m0]``
of another adapter: every FP8 byte and scale is judged against transformers' own quantizer of PEFT's float64
merge in that format, ``verify.fp8_oracle``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from protocols.params import ParamMeta
from sync_service.dtypes import wire_dtype
from sync_service.merge.export import merge_checkpoint
from sync_service.merge.export_fp8 import Fp8Options
from sync_service.merge.fp8_checkpoint import read_fp8_checkpoint
from sync_service.synthetic import make_adapter, make_base
from sync_service.verify.hf import PROMPTS, reference
from sync_service.verify.peft_oracle import save_peft_merged
from sync_service.verify.verdict import verdict
from tests.cli.test_cli_subprocess import one_error_line, weightsync
from tests.cli.test_preflight import fails


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine_base")
    base = make_base("qwen3_moe", root / "base", dtype="float32")
    lora = make_adapter("qwen3_moe", base, root / "lora", kind="target_parameters", r=2)
    bf16 = save_peft_merged(base, None, root / "bf16", dtype=torch.bfloat16)  # the same base, served in bf16
    other = make_base("qwen3_moe", root / "other", hidden=32)
    quantized = root / "quantized"
    shutil.copytree(bf16, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}
    (quantized / "config.json").write_text(json.dumps(config))
    variants = {"zero_block": lambda c: c["quantization_config"].update(weight_block_size=[0, 16]),
                "quant_string": lambda c: c.update(quantization_config="fp8")}
    out = {"base": base, "lora": lora, "bf16": bf16, "other": other, "quantized": quantized, "root": root}
    for name, change in variants.items():
        shutil.copytree(quantized, root / name)
        config = json.loads((root / name / "config.json").read_text())
        change(config)
        (root / name / "config.json").write_text(json.dumps(config))
        out[name] = root / name
    shutil.copytree(bf16, root / "bad_json")
    (root / "bad_json" / "config.json").write_text("{not json")
    shutil.copytree(bf16, root / "damaged")
    weights = root / "damaged" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return out | {"bad_json": root / "bad_json", "damaged": root / "damaged"}


@pytest.mark.parametrize("case, extra, message", [
    ("other size", ("--engine-base", "{other}"), "lm_head.weight is [64, 32] there and [64, 16] in --base; give the same model"),
    ("not a model", ("--engine-base", "{root}"), "not a model directory (no config.json)"),
    ("fp8 without fp8 tensors", ("--engine-base", "{quantized}"), "says fp8 but it holds no float8_e4m3fn tensor"),
    ("fp8 into vllm", ("--engine-base", "{quantized}", "--engine", "vllm"), "quantized checkpoint is served by --engine hf only"),
    ("vllm", ("--engine-base", "{bf16}", "--engine", "vllm"), "supported with --engine hf"),
    ("zero block", ("--engine-base", "{zero_block}"), "weight_block_size [0, 16] is not two positive ints"),
    ("quant string", ("--engine-base", "{quant_string}"), "quantization_config is 'fp8', not an object"),
    ("bad json", ("--engine-base", "{bad_json}"), "config.json is not a JSON object"),
    ("damaged", ("--engine-base", "{damaged}"), "model.safetensors is not a readable safetensors file"),
])
def test_a_bad_engine_base_is_refused_before_ray(files, capsys, case, extra, message):
    argv = ["sync", "--base", str(files["base"]), "--adapter", str(files["lora"]), "--ep", "1",
            *(a.format(**files) for a in extra)]
    fails(capsys, argv, message)


def test_fp32_trainer_into_bf16_engines_verifies_against_peft(files, tmp_path):
    out = tmp_path / "run.json"
    rc, err, _ = weightsync(["sync", "--base", str(files["base"]), "--adapter", str(files["lora"]),
                             "--engine-base", str(files["bf16"]), "--ep", "1", "--engines", "1", "--versions", "2",
                             "--accumulate-dtype", "float64", "--json", str(out)], ray_allowed=True)
    assert rc == 0, err[-3000:]
    doc = json.loads(out.read_text())
    assert doc["ok"] and doc["engine_base"] == str(files["bf16"]) and len(doc["versions"]) == 2
    for row in doc["versions"]:
        assert row["dtype_conversions"] and set(row["dtype_conversions"]) == {"float32->bfloat16"}, row
        (engine,) = row["engines"]
        assert engine["verified"] and engine["weights_equal_reference"], engine
        assert engine["max_abs_diff"] == 0.0, engine  # float64 accumulation: PEFT's merge cast once, bit for bit
        assert row["policy_kl_floor"] == 0.0 and 0.0 < engine["policy_kl"] < 0.1, (row, engine)  # an fp32 trainer


FP8_FORMATS = {fmt: Fp8Options(weight_block_size=(16, 16), scale_fmt=fmt) for fmt in ("float", "ue8m0")}
"""scale_fmt → the block-FP8 options of its engine base (16x16 blocks)."""


@pytest.fixture(scope="module")
def fp8_engine_bases(files) -> dict[str, Path]:
    """scale_fmt → the base with another adapter merged, written as block FP8 in that format (bf16 elsewhere)."""
    other = make_adapter("qwen3_moe", files["base"], files["root"] / "other-lora", kind="target_parameters", r=2, seed=5)
    for fmt, options in FP8_FORMATS.items():
        merge_checkpoint(files["base"], other, files["root"] / f"fp8-{fmt}", quantize="fp8", fp8=options, progress=False)
    return {fmt: files["root"] / f"fp8-{fmt}" for fmt in FP8_FORMATS}


@pytest.mark.parametrize("scale_fmt, scale_dtype", [("float", "float32"), ("ue8m0", "float8_e8m0fnu")])
def test_the_fp8_verifier_passes_the_adapters_fp8_merge_and_fails_another(files, fp8_engine_bases, tmp_path,
                                                                           scale_fmt, scale_dtype):
    merge_checkpoint(files["base"], files["lora"], tmp_path / "same", quantize="fp8", fp8=FP8_FORMATS[scale_fmt],
                     accumulate_dtype="float64", progress=False)
    for served_dir, want in ((tmp_path / "same", True), (fp8_engine_bases[scale_fmt], False)):
        state, _ = read_fp8_checkpoint(served_dir)
        table = [ParamMeta(n, wire_dtype(t.dtype), tuple(t.shape)) for n, t in state.items()]
        assert any(m.dtype == "float8_e4m3fn" for m in table)
        assert {m.dtype for m in table if m.name.endswith("_scale_inv")} == {scale_dtype}
        ref = reference(files["base"], files["lora"], tp=1, table=table, prompts=PROMPTS[:1])
        got = verdict(ref, state, None, None)
        assert got["verified"] is want and got["weights_equal_reference"] is want, (served_dir, got)
        assert got["weights_bitwise"] is want  # float64 accumulation: transformers' quantizer's bytes exactly
        assert got["weight_bound"].startswith("FP8 values and scales (float32 or ue8m0) against transformers' "
                                              "Fp8Quantize")


def _variant(src: Path, dst: Path, **quant) -> Path:
    """A copy of checkpoint ``src`` whose quantization_config is updated with ``quant``."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"].update(quant)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_ue8m0_engine_bases_are_checked_and_vllm_refuses_them_before_ray(files, fp8_engine_bases, tmp_path, capsys):
    argv = ["sync", "--base", str(files["base"]), "--adapter", str(files["lora"]), "--ep", "1", "--engine-base"]
    ue8m0 = fp8_engine_bases["ue8m0"]
    fails(capsys, [*argv, str(ue8m0), "--engine", "vllm"], "quantized checkpoint is served by --engine hf only")
    fails(capsys, [*argv, str(_variant(fp8_engine_bases["float"], tmp_path / "fp32-scales", scale_fmt="ue8m0"))],
          "needs float8_e8m0fnu scales", "got ('float32'")
    fails(capsys, [*argv, str(_variant(ue8m0, tmp_path / "e8m0-scales", scale_fmt="float"))],
          "needs float32 scales", "got ('float8_e8m0fnu'")
    fails(capsys, [*argv, str(_variant(ue8m0, tmp_path / "mxfp", scale_fmt="e4m3"))],
          "is not served; engines serve block FP8 (quant_method fp8, weight_block_size, scale_fmt float or ue8m0)")


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_fp32_trainer_into_block_fp8_engines_verifies_against_transformers_quantizer(files, fp8_engine_bases, tmp_path,
                                                                                     scale_fmt):
    out = tmp_path / "run.json"
    rc, err, _ = weightsync(["sync", "--base", str(files["base"]), "--adapter", str(files["lora"]),
                             "--engine-base", str(fp8_engine_bases[scale_fmt]), "--ep", "1", "--engines", "1",
                             "--versions", "2", "--accumulate-dtype", "float64", "--json", str(out)], ray_allowed=True)
    assert rc == 0, err[-3000:]
    doc = json.loads(out.read_text())
    assert doc["ok"] and len(doc["versions"]) == 2
    for row in doc["versions"]:
        assert {"float32->float8_e4m3fn", "float32->bfloat16"} <= set(row["dtype_conversions"]), row
        (engine,) = row["engines"]
        assert engine["verified"] and engine["weights_bitwise"] and engine["generations_equal"], engine
        assert engine["weights_equal_merge_output"] is None, engine  # compared with transformers' quantizer instead


def test_a_bad_fp8_base_is_named_before_the_engine_base_is_compared_with_it(files, fp8_engine_bases, tmp_path, capsys):
    """The base's own checks run first: an FP8 --base without its quantization_config, or with another quant method,
    is refused naming --base and the fix, not as a scale tensor missing from a bf16 --engine-base."""
    argv = ["sync", "--adapter", str(files["lora"]), "--ep", "1", "--engine-base", str(files["bf16"]), "--base"]
    no_quant = shutil.copytree(fp8_engine_bases["float"], tmp_path / "no-quant")
    config = json.loads((no_quant / "config.json").read_text())
    config.pop("quantization_config")
    (no_quant / "config.json").write_text(json.dumps(config))
    fails(capsys, [*argv, str(no_quant)], "--base: ", "no quantization_config, but", "is float8_e4m3fn; add the "
          "quantization_config it was written with")
    fails(capsys, [*argv, str(_variant(fp8_engine_bases["float"], tmp_path / "awq", quant_method="awq"))],
          "--base: ", "quant_method 'awq': a quantized base is read only as block FP8")


def test_a_scale_beside_unquantized_values_in_the_engine_base_is_refused(files, fp8_engine_bases, tmp_path, capsys):
    """Scales with no FP8 values beside them (here lm_head's, bf16) are refused by name, as the FP8 base's reader
    refuses them; before, the preflight dropped every *_scale_inv name and the engine served the file anyway."""
    from safetensors.torch import load_file, save_file

    stray = shutil.copytree(fp8_engine_bases["float"], tmp_path / "stray")
    tensors = load_file(str(stray / "model.safetensors"))
    tensors["lm_head.weight_scale_inv"] = torch.ones(4, 1)
    save_file(tensors, str(stray / "model.safetensors"), metadata={"format": "pt"})
    fails(capsys, ["sync", "--base", str(files["base"]), "--adapter", str(files["lora"]), "--ep", "1",
                   "--engine-base", str(stray)], "lm_head.weight_scale_inv has no float8_e4m3fn values beside it")
