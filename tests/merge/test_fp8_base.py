"""A block-FP8 checkpoint as the base of ``weightsync merge``: dequantize the block, merge, requantize.

Bases: a bf16 qwen3_moe (experts per expert on disk, fused in memory) written as block FP8 (16×16) by
``weightsync merge --quantize fp8`` of another adapter, with float32 and with ue8m0 scales. The adapter merged
over them targets q_proj / v_proj and the experts, so k_proj and o_proj are FP8 tensors it leaves unchanged.
Oracle: transformers loads the FP8 checkpoint with ``FineGrainedFP8Config(dequantize=True)`` in float64, PEFT
merges the adapter (``merge_and_unload``, float64), then transformers' own ``Fp8Quantize`` of each FP8 tensor
(``--quantize fp8``) or one cast to bfloat16 (no ``--quantize``). Nothing of weightsync's quantizer runs there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from protocols.params import full_box
from sync_service.entrypoints import merge_cli
from sync_service.merge.errors import MergeError
from sync_service.merge.export import merge_checkpoint
from sync_service.merge.export_fp8 import Fp8Options
from sync_service.merge.fp8_base import Fp8Base, open_base
from sync_service.merge.quantize import dequantize_blocks, quantize_blocks
from sync_service.synthetic import make_adapter, make_base
from sync_service.verify.fp8_oracle import transformers_dequantize, transformers_quantize
from sync_service.verify.peft_oracle import plain_float64

BLOCK = (16, 16)
FP8 = torch.float8_e4m3fn
SIZES = dict(hidden=32, intermediate=32, num_experts=4, vocab_size=64, num_layers=1)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fp8_base")
    base = make_base("qwen3_moe", root / "bf16", dtype="bfloat16", **SIZES)
    other = make_adapter("qwen3_moe", base, root / "other", kind="target_parameters", r=4, init_scale=0.3, seed=7)
    out = {"root": root, "lora": make_adapter("qwen3_moe", base, root / "lora", kind="target_parameters", r=4,
                                              lora_alpha=16, init_scale=0.3, seed=1, target_modules=["q_proj", "v_proj"])}
    for fmt in ("float", "ue8m0"):
        out[fmt] = root / f"fp8-{fmt}"
        merge_checkpoint(base, other, out[fmt], quantize="fp8", progress=False,
                         fp8=Fp8Options(weight_block_size=BLOCK, scale_fmt=fmt))
    return out


def oracle(fp8_dir: Path, adapter: Path | None, out: Path, fmt: str) -> dict[str, torch.Tensor]:
    """transformers' dequantize=True load, as a plain float64 model (``plain_float64``: the load keeps unquantized
    tensors in bf16), + PEFT's float64 merge, saved by ``save_pretrained``: disk name → float64 tensor."""
    from peft import PeftModel
    from transformers import FineGrainedFP8Config

    from sync_service.engines.hf import load_causal_lm

    config = FineGrainedFP8Config(weight_block_size=list(BLOCK), scale_fmt=fmt, dequantize=True)
    model = plain_float64(load_causal_lm(fp8_dir, dtype=torch.float64, quantization_config=config))
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    model.save_pretrained(str(out))
    return load_file(str(out / "model.safetensors"))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("fmt", ["float", "ue8m0"])
def test_reads_dequantized_as_transformers_loads_it(files, fmt, tmp_path):
    from transformers import FineGrainedFP8Config

    from sync_service.engines.hf import load_causal_lm

    base = open_base(files[fmt])
    assert isinstance(base, Fp8Base) and (base.block, base.scale_fmt, base.dequantized_dtype) == (BLOCK, fmt, "bfloat16")
    config = FineGrainedFP8Config(weight_block_size=list(BLOCK), scale_fmt=fmt, dequantize=True)
    want = dict(load_causal_lm(files[fmt], dtype=torch.float64, quantization_config=config).named_parameters())
    metas = {m.name: m for m in base.metas()}
    assert metas.keys() == want.keys() and not any(n.endswith("_scale_inv") for n in metas)
    fp8 = {n for n, m in metas.items() if m.dtype == "float32"}
    assert len(fp8) == 6 and all("proj" in n for n in fp8), sorted(fp8)  # q/k/v/o + fused gate_up / down
    for name, meta in metas.items():
        box = tuple((1, n - 3) if n > 4 else (0, n) for n in meta.shape)  # cuts blocks (and experts) anywhere
        for b in (full_box(meta.shape), box):
            got = base.read(name, b)
            assert got.dtype == torch.float32 if name in fp8 else got.dtype == torch.bfloat16, name
            assert torch.equal(got.double(), want[name].detach()[tuple(slice(*ab) for ab in b)]), (name, b)


@pytest.mark.parametrize("fmt", ["float", "ue8m0"])
def test_cli_merge_quantize_fp8_is_transformers_fp8_of_the_dequantized_merge(files, fmt, tmp_path):
    """Every FP8 tensor (those the adapter changes and k/o_proj, which it does not: requantized) bitwise
    transformers' Fp8Quantize of PEFT's float64 merge over transformers' dequantized load; the rest bf16."""
    want64 = oracle(files[fmt], files["lora"], tmp_path / "oracle", fmt)
    out = tmp_path / "out"
    args = _args(files[fmt], files["lora"], out, "--quantize", "fp8", "--weight-block-size", "16,16",
                 "--scale-fmt", fmt, "--accumulate-dtype", "float64")
    assert merge_cli.run(args) == 0
    got = load_file(str(out / "model.safetensors"))
    base = load_file(str(files[fmt] / "model.safetensors"))
    assert {k for k, t in got.items() if t.dtype == FP8} == {k for k, t in base.items() if t.dtype == FP8}
    want: dict[str, torch.Tensor] = {}
    for key, t in want64.items():
        want |= transformers_quantize(key, t.float(), BLOCK, fmt) if base[key].dtype == FP8 else {key: t.to(torch.bfloat16)}
    assert got.keys() == want.keys()
    for key, w in want.items():
        assert got[key].dtype == w.dtype and torch.equal(_bytes(got[key]), _bytes(w)), key
    fp8 = {k: k.replace(".weight", ".weight_scale_inv") for k in base if base[k].dtype == FP8}
    for key, scales in fp8.items():  # requantized, not passed through (test_requantizing_...): near the base's bytes
        if "q_proj" in key or "v_proj" in key:
            assert not torch.equal(_bytes(got[key]), _bytes(base[key])), key
        elif fmt == "float" and "experts" not in key:  # untouched: same FP8 codes, a scale at most two ulps away
            assert torch.equal(_bytes(got[key]), _bytes(base[key])), key
            assert int((got[scales].view(torch.int32) - base[scales].view(torch.int32)).abs().max()) <= 2, key
        elif "experts" not in key:  # ue8m0: a halved scale with doubled codes, the same values
            assert torch.equal(transformers_dequantize(got[key], got[scales], torch.float32),
                               transformers_dequantize(base[key], base[scales], torch.float32)), key
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["scale_fmt"] == fmt and config["dtype"] == "bfloat16"


def test_float32_accumulation_is_within_one_fp8_step(files, tmp_path):
    want64 = oracle(files["float"], files["lora"], tmp_path / "oracle", "float")
    merge_checkpoint(files["float"], files["lora"], tmp_path / "out", quantize="fp8", progress=False,
                     fp8=Fp8Options(weight_block_size=BLOCK))
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    equal = total = 0
    for key, t in got.items():
        if t.dtype != FP8:
            continue
        want = transformers_quantize(key, want64[key].float(), BLOCK)[key]
        codes = [x.contiguous().view(torch.uint8).to(torch.int32) for x in (t, want)]
        steps = (torch.where(codes[0] >= 128, 128 - codes[0], codes[0]) - torch.where(codes[1] >= 128, 128 - codes[1], codes[1])).abs()
        assert int(steps.max()) <= 1, key
        equal, total = equal + int((steps == 0).sum()), total + steps.numel()
    assert equal / total >= 0.999, f"{equal}/{total} FP8 bytes equal"


def test_merge_without_quantize_writes_the_dequantized_merge_in_bf16(files, tmp_path):
    want = oracle(files["float"], files["lora"], tmp_path / "oracle", "float")
    summary = merge_checkpoint(files["float"], files["lora"], tmp_path / "out", accumulate_dtype="float64", progress=False)
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert summary["tensors"] == len(got) and got.keys() == want.keys()
    for key, w in want.items():
        assert got[key].dtype == torch.bfloat16 and torch.equal(got[key], w.to(torch.bfloat16)), key
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())


def test_requantizing_a_dequantized_block_is_not_a_pass_through():
    """Why every FP8 tensor is requantized rather than passed through: transformers' Fp8Quantize of a dequantized
    block keeps its FP8 values but rounds some float32 scales an ulp or two away, and halves ue8m0 scales of blocks whose
    largest value is <= 224·scale (doubling the codes, the same values) — so only requantizing is its oracle."""
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    for fmt in ("float", "ue8m0"):
        q, s = quantize_blocks(x, BLOCK, fmt)
        deq = transformers_dequantize(q, s, torch.float32)
        assert torch.equal(deq, dequantize_blocks(q, s, torch.float32))
        again = transformers_quantize("w", deq, BLOCK, fmt)
        q2, s2 = again["w"], again["w_scale_inv"]
        assert torch.equal(transformers_dequantize(q2, s2, torch.float64), deq.double()) or fmt == "float"
        if fmt == "float":
            assert torch.equal(_bytes(q2), _bytes(q)) and not torch.equal(s2, s)
            assert int((s2.view(torch.int32) - s.view(torch.int32)).abs().max()) <= 2  # float32 ulps
        else:
            assert not torch.equal(_bytes(q2), _bytes(q))


def _args(base: Path, adapter: Path, out: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    merge_cli.add_arguments(parser)
    return parser.parse_args(["--base", str(base), "--adapter", str(adapter), "--out", str(out), "--no-progress", *extra])


def _broken(files, tmp_path: Path, change) -> Path:
    """A copy of the float FP8 base with its tensors changed by ``change(dict)``."""
    import shutil

    out = tmp_path / "broken"
    shutil.copytree(files["float"], out)
    tensors = load_file(str(out / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("model.layers.0.self_attn.o_proj.weight_scale_inv"),
     r"model\.layers\.0\.self_attn\.o_proj\.weight is float8_e4m3fn but its scales "
     r"model\.layers\.0\.self_attn\.o_proj\.weight_scale_inv are missing"),
    (lambda t: t.update({"model.layers.0.mlp.experts.2.up_proj.weight_scale_inv": torch.ones(2, 1)}),
     r"model\.layers\.0\.mlp\.experts\.2\.up_proj\.weight_scale_inv \(scales of model\.layers\.0\.mlp\.experts\."
     r"gate_up_proj\) is F32\[2, 1\]; block FP8 with weight_block_size \[16, 16\] needs F32 or F8_E8M0 \[2, 2\]"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(2, 2, dtype=torch.int32)}),
     r"q_proj\.weight_scale_inv \(scales of model\.layers\.0\.self_attn\.q_proj\.weight\) is I32\[2, 2\]"),
    (lambda t: t.update({"lm_head.weight_scale_inv": torch.ones(4, 2)}), r"lm_head\.weight_scale_inv has no "
                                                                         r"float8_e4m3fn values beside it"),
    # a checkpoint mixing scale formats: ue8m0 scales where the config says float
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight_scale_inv":
                         t["model.layers.0.self_attn.q_proj.weight_scale_inv"].to(torch.float8_e8m0fnu)}),
     r"q_proj\.weight_scale_inv \(scales of model\.layers\.0\.self_attn\.q_proj\.weight\) is F8_E8M0 but "
     r"quantization_config scale_fmt is 'float', whose scales are F32"),
    (lambda t: t["model.layers.0.self_attn.k_proj.weight_scale_inv"].fill_(float("inf")),
     r"k_proj\.weight_scale_inv \(scales of model\.layers\.0\.self_attn\.k_proj\.weight\) holds NaN or Inf"),
    # a zero scale dequantizes its block to zeros, a negative one flips its signs: refused as NaN / Inf are
    (lambda t: t["model.layers.0.self_attn.k_proj.weight_scale_inv"].__setitem__((0, 1), 0.0),
     r"k_proj\.weight_scale_inv \(scales of model\.layers\.0\.self_attn\.k_proj\.weight\) holds a scale <= 0 \(0\)"),
    (lambda t: t["model.layers.0.mlp.experts.1.down_proj.weight_scale_inv"].mul_(-1),
     r"experts\.1\.down_proj\.weight_scale_inv \(scales of model\.layers\.0\.mlp\.experts\.down_proj\) holds "
     r"a scale <= 0 \(-"),
])
def test_bad_scales_are_refused_in_one_line_naming_the_tensor(files, tmp_path, capsys, change, message):
    broken = _broken(files, tmp_path, change)
    with pytest.raises(MergeError, match=message):
        open_base(broken)
    capsys.readouterr()
    assert merge_cli.run(_args(broken, files["lora"], tmp_path / "out", "--quantize", "fp8")) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "weightsync merge --quantize fp8" in err, err
    assert not (tmp_path / "out").exists()


def test_other_quantization_methods_are_refused(files, tmp_path):
    import shutil

    shutil.copytree(files["float"], tmp_path / "mx")
    config = json.loads((tmp_path / "mx" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "mx" / "config.json").write_text(json.dumps(config))
    with pytest.raises(MergeError, match="quant_method 'mxfp4': a quantized base is read only as block FP8"):
        open_base(tmp_path / "mx")
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [0, 16]}
    (tmp_path / "mx" / "config.json").write_text(json.dumps(config))
    with pytest.raises(MergeError, match=r"weight_block_size \[0, 16\] is not two positive ints"):
        open_base(tmp_path / "mx")


def _with_config(src: Path, dst: Path, change) -> Path:
    """A copy of checkpoint ``src`` whose config.json is changed in place by ``change(dict)``."""
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    change(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_config_and_tensors_that_disagree_are_refused(files, tmp_path):
    """FP8 tensors without a quantization_config (read raw they would be merged as the weights), one without FP8
    tensors, a boolean block (JSON true is a Python int), an ue8m0 scale byte 0xFF (NaN) and a config naming the
    other scale format: each refused in one MergeError naming the file or tensor."""
    cases = {
        "no_quant": (lambda c: c.pop("quantization_config"), files["float"],
                     r"no quantization_config, but model\.layers\.0\.\S+ \(6 tensor\(s\)\) is float8_e4m3fn"),
        "bool_block": (lambda c: c["quantization_config"].update(weight_block_size=[True, True]), files["float"],
                       r"weight_block_size \[True, True\] is not two positive ints"),
        "says_float": (lambda c: c["quantization_config"].update(scale_fmt="float"), files["ue8m0"],
                       r"is F8_E8M0 but quantization_config scale_fmt is 'float'"),
    }
    for name, (change, src, message) in cases.items():
        with pytest.raises(MergeError, match=message):
            open_base(_with_config(src, tmp_path / name, change))
    merge_checkpoint(files["float"], files["lora"], tmp_path / "bf16", progress=False)  # bf16: no FP8 tensor
    quant = {"quant_method": "fp8", "weight_block_size": list(BLOCK)}
    with pytest.raises(MergeError, match="quantization_config says fp8 but no tensor is float8_e4m3fn"):
        open_base(_with_config(tmp_path / "bf16", tmp_path / "bf16-says-fp8", lambda c: c.update(quantization_config=quant)))
    nan = _with_config(files["ue8m0"], tmp_path / "0xff", lambda c: None)
    tensors = load_file(str(nan / "model.safetensors"))
    key = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    tensors[key] = torch.full(tensors[key].shape, 0xFF, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    save_file(tensors, str(nan / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(MergeError, match=r"o_proj\.weight_scale_inv \(scales of .*o_proj\.weight\) holds NaN or Inf"):
        open_base(nan)


def test_engines_load_an_fp8_checkpoint_only_if_it_reads_as_a_base(files, tmp_path):
    """The engines' loader (``read_fp8_checkpoint``, HF and memory engines) makes the FP8 base's checks: before, it
    served a stray scale, NaN scales and a block [8, 8] over 16x16 scales, and died in ZeroDivisionError /
    AttributeError on a block [0, 16] or a quantization_config string; ``is_fp8_checkpoint`` refuses other methods."""
    from sync_service.merge.fp8_checkpoint import is_fp8_checkpoint, read_fp8_checkpoint

    for name, change, message in (
        ("block0", lambda c: c["quantization_config"].update(weight_block_size=[0, 16]), r"\[0, 16\] is not two positive"),
        ("block8", lambda c: c["quantization_config"].update(weight_block_size=[8, 8]),
         r"weight_block_size \[8, 8\] needs F32 or F8_E8M0"),
        ("null_fmt", lambda c: c["quantization_config"].update(scale_fmt=None), "scale_fmt None: use 'float' or 'ue8m0'"),
    ):
        with pytest.raises(MergeError, match=message):
            read_fp8_checkpoint(_with_config(files["float"], tmp_path / name, change))
    for name, quant, message in (("string", "fp8", "quantization_config is 'fp8', not an object"),
                                 ("awq", {"quant_method": "awq"}, "quant_method 'awq' is not served")):
        with pytest.raises(MergeError, match=message):
            is_fp8_checkpoint(_with_config(files["float"], tmp_path / name, lambda c: c.update(quantization_config=quant)))
    stray = _broken(files, tmp_path, lambda t: t.update({"lm_head.weight_scale_inv": torch.ones(4, 2)}))
    with pytest.raises(MergeError, match=r"lm_head\.weight_scale_inv has no float8_e4m3fn values beside it"):
        read_fp8_checkpoint(stray)
    assert is_fp8_checkpoint(files["ue8m0"]) and read_fp8_checkpoint(files["ue8m0"])[1] == BLOCK


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_buffers())


@pytest.mark.parametrize("fmt", ["float", "bf16"])
def test_oracle_model_computes_as_the_engine_it_judges(files, fmt):
    """With the oracle's weights loaded bit for bit, the HF engine's forward is the oracle model's, bit for bit
    (a verdict accepts no token flip then: ``tokens.compare_tokens`` with bound 0). Before, the oracle cast its
    float64 model with ``model.to(bfloat16)``, which also rounded the rotary ``inv_freq`` (a float32 buffer in
    any model ``from_pretrained`` loads, the engine's): logits 0.03 apart, and ``weightsync sync --base <FP8>
    --accumulate-dtype float64`` (or ``--engine-base <bf16>``) failed on a greedy token at an exact top-2 tie."""
    from sync_service.engines.hf import HFEngine
    from sync_service.verify.fp8_oracle import compute_dtype, dequantized_, quantized_state
    from sync_service.verify.peft_oracle import model_state, peft_merged_model

    base = files["float"] if fmt == "float" else files["root"] / "bf16"
    engine = HFEngine.from_pretrained(base)
    table = engine.param_metas()
    if fmt == "float":  # FP8 engine: reference()'s oracle (transformers' Fp8Quantize / Fp8Dequantize of the merge)
        model = peft_merged_model(base, files["lora"], dtype=torch.float64)
        state = quantized_state(model_state(model), table)
        model = dequantized_(model, state, table, compute_dtype(table))
    else:  # bf16 engine (also --engine-base): PEFT's float64 merge cast once
        model = peft_merged_model(base, files["lora"])
        state = model_state(model)
    engine.begin_update(1, [m.name for m in table])
    for m in table:
        engine.apply(m.name, full_box(m.shape), state[m.name])
    engine.finish_update()
    engine.commit(1)
    served = engine._model
    want, got = _buffers(served), _buffers(model)
    assert want.keys() == got.keys() and "model.rotary_emb.inv_freq" in want
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    for name, p in served.named_parameters():
        assert torch.equal(p, dict(model.named_parameters())[name]), name
    ids = torch.tensor([[2, 3, 5, 7, 11, 13, 17]])
    with torch.no_grad():
        assert torch.equal(served(input_ids=ids).logits, model(input_ids=ids).logits)
