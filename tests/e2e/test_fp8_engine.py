"""Serving in the engine's precision, block FP8: trainers merge and quantize, an HF engine serves FP8 + scales.

EP=2 trainers (fp32 and bf16 bases) sync into HF engines loaded from block-FP8 checkpoints — float32 scales
(16×16 blocks) and ue8m0 scales (float8_e8m0fnu powers of two, 8×8 blocks) — a full push, then a delta after
``train_step``; TP=2 trainers sync into the 8×8 engine and are refused by the 16×16 one (their k_proj shards
are 8 rows: a TP split that cuts blocks is refused by name, not gathered). The reference of a version is
transformers' own ``Fp8Quantize`` (the engine's ``scale_fmt``) of PEFT's float64 merge of that version's
adapter (the unquantized tensors: that merge cast once to bf16), written as a checkpoint: with float64
accumulation the engine's served FP8 bytes and scales are that reference bit for bit and its greedy tokens
equal a fresh HF engine's on it (transformers' ``FineGrainedFP8Config(dequantize=True)`` load); with fp32
accumulation >= 99.9 % of FP8 bytes are equal and none is more than one FP8 step away. The bf16 trainers then
sync the float32-scales engine in factor mode (the engine keeps their bf16 base, merges and quantizes;
bitwise merged mode's bytes: ``tests/factor_stream/test_fp8_factors.py``), checked the same way at fp32
accumulation. One Ray session, one pool of two trainer actors.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file, save_file

from protocols.params import ParamMeta
from sync_service.api import SyncConfig, WeightSync
from sync_service.coordinator.planning import BlockAlignmentError, DtypeConflictError, engine_dtypes
from sync_service.entrypoints.local import AdapterReplay
from sync_service.merge.export import merge_checkpoint
from sync_service.merge.export_fp8 import Fp8Options, quantized_names
from sync_service.merge.fp8_checkpoint import read_fp8_checkpoint
from sync_service.merge.quantize import divides
from sync_service.synthetic import make_adapter, make_base
from sync_service.verify.fp8_oracle import transformers_quantize
from sync_service.verify.peft_oracle import peft_merged_model

BLOCK = (16, 16)
UE8M0_BLOCK = (8, 8)
"""The ue8m0 engine's block: divides the TP=2 shards (k_proj [16, 32] → 8 rows per rank)."""
FP8 = torch.float8_e4m3fn
SIZES = dict(hidden=32, intermediate=32, num_experts=4, vocab_size=64, num_layers=1)
PROMPT = [1, 5, 9, 13, 17, 21]


# -- planning (pure) ------------------------------------------------------------------------------
def test_a_box_off_the_block_edges_is_refused_naming_tensor_box_and_block():
    q = "model.layers.0.self_attn.q_proj.weight"
    table = [ParamMeta(q, "float8_e4m3fn", (32, 32)), ParamMeta(q + "_scale_inv", "float32", (2, 2))]
    owned = [[ParamMeta(q, "bfloat16", (32, 32), ((0, 8), (0, 32)))], [ParamMeta(q, "bfloat16", (32, 32), ((8, 32), (0, 32)))]]
    with pytest.raises(BlockAlignmentError, match=r"q_proj.weight: trainer box \[\(0, 8\), \(0, 32\)\] is not aligned "
                                                  r"to the engines' FP8 block \[16, 16\]"):
        engine_dtypes(owned, {"e0": table})
    aligned = [[ParamMeta(q, "bfloat16", (32, 32), ((0, 16), (0, 32)))], [ParamMeta(q, "bfloat16", (32, 32), ((16, 32), (0, 32)))]]
    retyped, conversions = engine_dtypes(aligned, {"e0": table})
    assert conversions == {("bfloat16", "float8_e4m3fn"): 1}
    assert [(m.name, m.dtype, m.box) for m in retyped[1]] == [
        (q, "float8_e4m3fn", ((16, 32), (0, 32))), (q + "_scale_inv", "float32", ((1, 2), (0, 2)))]
    with pytest.raises(ValueError, match="an FP8 checkpoint under a LoRA"):
        engine_dtypes([[ParamMeta(q, "float8_e4m3fn", (32, 32))]], {"e0": table})


def test_ue8m0_scales_travel_as_float8_e8m0fnu_and_engines_must_agree_on_the_format():
    q = "model.layers.0.self_attn.q_proj.weight"
    ue8m0 = [ParamMeta(q, "float8_e4m3fn", (32, 32)), ParamMeta(q + "_scale_inv", "float8_e8m0fnu", (2, 2))]
    owned = [[ParamMeta(q, "float32", (32, 32), ((0, 16), (0, 32)))], [ParamMeta(q, "float32", (32, 32), ((16, 32), (0, 32)))]]
    retyped, _ = engine_dtypes(owned, {"e0": ue8m0, "e1": ue8m0})
    assert [(m.dtype, m.box) for m in retyped[0]] == [("float8_e4m3fn", ((0, 16), (0, 32))),
                                                      ("float8_e8m0fnu", ((0, 1), (0, 2)))]
    floats = [ue8m0[0], ParamMeta(q + "_scale_inv", "float32", (2, 2))]
    with pytest.raises(DtypeConflictError, match=r"q_proj.weight_scale_inv: engine 'e0' float8_e8m0fnu, engine 'e1' float32"):
        engine_dtypes(owned, {"e0": ue8m0, "e1": floats})
    with pytest.raises(ValueError, match=r"lists its scales .* as float32 or float8_e8m0fnu\[\.\., N/bm, K/bn\]"):
        engine_dtypes(owned, {"e0": [ue8m0[0], ParamMeta(q + "_scale_inv", "bfloat16", (2, 2))]})


# -- end to end --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    out = {"root": root}
    for dtype in ("bfloat16", "float32"):
        base = make_base("qwen3_moe", root / f"base-{dtype}", dtype=dtype, **SIZES)
        out[dtype] = (base, make_adapter("qwen3_moe", base, root / f"lora-{dtype}", kind="target_parameters", r=4,
                                         lora_alpha=16, init_scale=0.3, seed=1))
    base = out["bfloat16"][0]  # the engine starts from another adapter's FP8 merge: a full sync must replace it all
    other = make_adapter("qwen3_moe", base, root / "lora-other", kind="target_parameters", r=4, init_scale=0.3, seed=7)
    merge_checkpoint(base, other, root / "engine", quantize="fp8", fp8=Fp8Options(weight_block_size=BLOCK), progress=False)
    merge_checkpoint(base, other, root / "ue8m0", quantize="fp8", progress=False,
                     fp8=Fp8Options(weight_block_size=UE8M0_BLOCK, scale_fmt="ue8m0"))
    out["engine"], out["ue8m0"] = root / "engine", root / "ue8m0"
    return out


FORMATS = {"float": ("engine", BLOCK), "ue8m0": ("ue8m0", UE8M0_BLOCK)}
"""scale_fmt → (the ``files`` key of its engine checkpoint, its block)."""


def reference(files, base: Path, adapter: Path, out: Path, scale_fmt: str = "float") -> Path:
    """transformers' Fp8Quantize (``scale_fmt``) of PEFT's float64 merge (bf16 elsewhere), as a checkpoint with the
    config of the engine of that format."""
    engine_dir, block = files[FORMATS[scale_fmt][0]], FORMATS[scale_fmt][1]
    peft_merged_model(base, adapter, dtype=torch.float64).save_pretrained(str(out / "peft64"))
    peft64 = load_file(str(out / "peft64" / "model.safetensors"))
    quantized = {k for k, t in load_file(str(engine_dir / "model.safetensors")).items() if t.dtype == FP8}
    tensors = {}
    for key, t in peft64.items():
        tensors |= transformers_quantize(key, t.float(), block, scale_fmt) if key in quantized else {key: t.to(torch.bfloat16)}
    (out / "ref").mkdir()
    for f in engine_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / "ref" / f.name)
    save_file(tensors, str(out / "ref" / "model.safetensors"), metadata={"format": "pt"})
    return out / "ref"


def fp8_steps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    def ordinal(t):
        code = t.contiguous().view(torch.uint8).to(torch.int32)
        return torch.where(code >= 128, -(code - 128), code)
    return (ordinal(got) - ordinal(want)).abs()


def served(engine) -> dict[str, torch.Tensor]:
    from sync_service.dtypes import TORCH_DTYPES

    sw = ray.get(engine.served_weights.remote(None, True))
    return {t.name: torch.frombuffer(bytearray(t.values), dtype=TORCH_DTYPES[t.dtype]).reshape(t.shape) for t in sw.tensors}


def check(got: dict, want: dict, bitwise: bool, what: str) -> None:
    assert got.keys() == want.keys(), what
    equal = total = 0
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype, (what, name)
        if bitwise:
            assert torch.equal(g.view(torch.uint8), w.contiguous().view(torch.uint8)), f"{what}: {name} not bitwise"
        elif w.dtype == FP8:
            steps = fp8_steps(g, w)
            assert int(steps.max()) <= 1, f"{what}: {name} more than one FP8 step away"
            equal, total = equal + int((steps == 0).sum()), total + steps.numel()
        elif name.endswith("_scale_inv"):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=0, msg=f"{what}: {name}")  # amax a float32 ulp or two away
        else:  # one bf16 rounding of the fp32 sum
            torch.testing.assert_close(g.float(), w.float(), rtol=2**-7, atol=0, msg=f"{what}: {name}")
    assert bitwise or equal / total >= 0.999, f"{what}: {equal}/{total} FP8 bytes equal"


@pytest.fixture(scope="module")
def engines(ray_local, files):
    """scale_fmt → an HF engine actor on that format's checkpoint (``FORMATS``)."""
    from actors.launch import start_engines

    out = {fmt: start_engines(files[key], 1, prefix=f"fp8-{fmt}-")[0] for fmt, (key, _) in FORMATS.items()}
    yield out
    for e in out.values():
        ray.kill(e)


@pytest.mark.parametrize("scale_fmt, scale_dtype", [("float", "float32"), ("ue8m0", "float8_e8m0fnu")])
def test_the_engine_serves_fp8_where_transformers_quantizes(files, engines, scale_fmt, scale_dtype):
    import json

    key, (bm, bn) = FORMATS[scale_fmt]
    config = json.loads((files[key] / "config.json").read_text())
    table = ray.get(engines[scale_fmt].param_metas.remote())
    shapes = {m.name: m.shape for m in table}
    fp8 = {m.name for m in table if m.dtype == "float8_e4m3fn"}
    options = Fp8Options(weight_block_size=(bm, bn), scale_fmt=scale_fmt)
    want = {n for n in quantized_names(config, options) if n in shapes and divides(shapes[n], (bm, bn))}
    assert fp8 == want and len(fp8) == 6, sorted(fp8)  # q/k/v/o + fused experts gate_up / down
    assert {m.name: (m.dtype, m.shape) for m in table if m.name.endswith("_scale_inv")} == {
        n[:-7] + ".weight_scale_inv" if n.endswith(".weight") else n + "_scale_inv":
            (scale_dtype, (*shapes[n][:-2], shapes[n][-2] // bm, shapes[n][-1] // bn)) for n in fp8}


def full_then_delta(files, trainers, engine, replay: AdapterReplay, v: int, tmp_path: Path, *, base: Path,
                    scale_fmt: str, accumulate: str, what: str, mode: str = "merged") -> int:
    """A full push and a delta (after ``train_step``) into ``engine`` in ``SyncConfig.mode`` ``mode``, each checked
    against transformers' ``Fp8Quantize(scale_fmt)`` of PEFT's float64 merge of that version; returns the next
    version."""
    from sync_service.engines.hf import HFEngine

    base_dtype = next(iter(load_file(str(base / "model.safetensors")).values())).dtype
    sync = WeightSync(trainers=trainers, engines=[engine], config=SyncConfig(
        transport="shm", bucket_bytes=4 << 10, timeout_s=90, reset_versions=True, accumulate_dtype=accumulate,
        mode=mode))
    try:
        assert sync.dtype_conversions[(str(base_dtype).removeprefix("torch."), "float8_e4m3fn")] == 6
        for full in (True, False):
            if not full:
                ray.get([t.train_step.remote(v) for t in trainers])
                replay.step(v)
            m = sync.push(v)
            assert m.full == full and all(e.committed for e in m.engines)
            assert mode == "merged" or len(m.factor_tensors) >= 6, m.factor_tensors  # FP8 targets as factors
            ref = reference(files, base, replay.save(tmp_path / f"a{v}"), tmp_path / f"v{v}", scale_fmt)
            here = f"{what}, {scale_fmt} scales, accumulate {accumulate}, {mode} mode, version {v}"
            got = served(engine)
            check(got, read_fp8_checkpoint(ref)[0], accumulate == "float64", here)
            if scale_fmt == "ue8m0":  # every scale a power of two, as float8_e8m0fnu holds them
                scales = [t for n, t in got.items() if n.endswith("_scale_inv")]
                assert len(scales) == 6 and all(t.dtype == torch.float8_e8m0fnu for t in scales), here
                assert all(bool((torch.frexp(t.float()).mantissa == 0.5).all()) for t in scales), here
            if accumulate == "float64":
                fresh = HFEngine.from_pretrained(ref).generate(PROMPT, 8).tokens
                assert ray.get(engine.generate.remote(PROMPT, 8))[0] == fresh, here
            v += 1
    finally:
        sync.close()
    return v


RUNS = {"bfloat16": (("float", "float64"), ("ue8m0", "float64")),
        "float32": (("float", "float64"), ("float", "float32"), ("ue8m0", "float64"))}
"""Trainer base dtype → the (engine scale_fmt, accumulation dtype) runs its EP=2 trainers sync, in order."""


@pytest.mark.parametrize("dtype", RUNS)
def test_ep2_trainers_sync_fp8_full_then_delta(files, engines, trainer_pool, tmp_path, dtype):
    from actors.launch import start_trainers

    base, adapter = files[dtype]
    trainers = start_trainers(base, adapter, ep=2, reuse=trainer_pool)
    replay, v = AdapterReplay(adapter), 0
    for scale_fmt, accumulate in RUNS[dtype]:
        v = full_then_delta(files, trainers, engines[scale_fmt], replay, v, tmp_path, base=base, scale_fmt=scale_fmt,
                            accumulate=accumulate, what=f"EP=2, {dtype} base")
    if dtype == "bfloat16":  # factor mode: the engine keeps the trainers' bf16 base, merges and quantizes
        with pytest.raises(ValueError, match="accumulate_dtype='float64': the engines merge factor-mode tensors"):
            WeightSync(trainers=trainers, engines=[engines["float"]], config=SyncConfig(
                transport="shm", mode="factors", reset_versions=True, accumulate_dtype="float64"))
        full_then_delta(files, trainers, engines["float"], replay, v, tmp_path, base=base, scale_fmt="float",
                        accumulate="float32", what=f"EP=2, {dtype} base", mode="factors")


def test_tp2_trainers_sync_an_fp8_engine_whose_block_divides_their_shards(files, engines, trainer_pool, tmp_path):
    """TP=2 boxes (rows of q/k/v, [gate_t; up_t] row pairs, down_proj / o_proj columns) are quantized where they
    stand when the block divides every shard (8×8 here); the 16×16 engine's blocks are cut by k_proj's 8-row shards:
    refused before any byte, naming the tensor, its box, the block and the fix."""
    from actors.launch import start_trainers

    base, adapter = files["bfloat16"]
    trainers = start_trainers(base, adapter, tp=2, reuse=trainer_pool)
    with pytest.raises(BlockAlignmentError, match=r"self_attn\.[kv]_proj\.weight: trainer box \[\(\d+, \d+\), \(0, 32\)\] "
                                                  r"is not aligned to the engines' FP8 block \[16, 16\].*a TP split "
                                                  r"cuts blocks here: use a tp whose shards are block multiples"):
        WeightSync(trainers=trainers, engines=[engines["float"]], config=SyncConfig(transport="shm", reset_versions=True))
    full_then_delta(files, trainers, engines["ue8m0"], AdapterReplay(adapter), 0, tmp_path, base=base,
                    scale_fmt="ue8m0", accumulate="float64", what="TP=2, bfloat16 base")
