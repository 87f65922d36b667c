"""Factor mode into a block-FP8 engine: the receiver merges over the trainers' base and quantizes as they would.

In one process (``LocalSync``: real shards, ``MergedSource``, ``Sender`` / ``BucketReceiver`` over shm) a
``MemoryEngine`` loaded from a block-FP8 checkpoint (``weightsync merge --quantize fp8``: float32 or ue8m0 scales,
8×8 blocks) is synced full then by deltas, once merged (the trainers quantize) and once as factors (the engine
keeps the trainers' bf16 base and quantizes): the two engines hold the same bytes, FP8 values and scales included,
after every version; with float64 accumulation both are transformers' ``Fp8Quantize`` of PEFT's float64 merge bit
for bit (``verify.fp8_oracle.quantized_state``).
"""

from __future__ import annotations

import pytest
import torch

from protocols.params import ParamMeta
from sync_service.entrypoints.local import AdapterReplay
from sync_service.factor_stream.choose import TargetCost
from sync_service.factor_stream.plan import build_factor_plan, engine_merged_bytes
from sync_service.factor_stream.recipes import recipes_for_target
from sync_service.factor_stream.rx_fp8 import owned_boxes
from sync_service.merge.export import merge_checkpoint
from sync_service.merge.export_fp8 import Fp8Options
from sync_service.merge.fp8_checkpoint import read_fp8_checkpoint
from sync_service.merge.terms import LoraTerm
from sync_service.streaming.plan import split_box
from sync_service.verify.fp8_oracle import quantized_state
from sync_service.verify.peft_oracle import model_state, peft_merged_model
from tests.factor_stream.conftest import differing, run_both

BLOCK = (8, 8)
FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("scale_fmt, accumulate", [("float", "float64"), ("ue8m0", "float64"), ("float", "float32")])
def test_factor_mode_into_an_fp8_engine_serves_merged_modes_bytes(model_factory, tmp_path, scale_fmt, accumulate):
    model = model_factory("qwen3_moe", "bfloat16")
    merge_checkpoint(model.base_dir, model.adapter_dir, tmp_path / "fp8", quantize="fp8", progress=False,
                     fp8=Fp8Options(weight_block_size=BLOCK, scale_fmt=scale_fmt))
    engine = read_fp8_checkpoint(tmp_path / "fp8")[0]
    runs, log, state = run_both(model, engine=engine, accumulate_dtype=accumulate, ep=2, bucket_bytes=1 << 10)
    run, (stats, served) = runs["factors"], log[-1]
    fp8_targets = {n for n in run.choice.factors if engine[n].dtype == FP8}
    assert len(fp8_targets) >= 4, (sorted(run.choice.factors), sorted(n for n, t in engine.items() if t.dtype == FP8))
    assert all(served[n].dtype == FP8 for n in fp8_targets)
    assert differing(served, engine)  # the engines changed: not a vacuous equality
    assert not stats["factors"].full  # a delta: factors only (at these tiny sizes not fewer bytes than 1-byte FP8)
    # the receiver holds the trainers' bf16 base of each FP8 target, not an FP8 copy
    assert all(run.engine._pristine[n].dtype == torch.bfloat16 for n in fp8_targets)
    if accumulate == "float64":
        replay = AdapterReplay(model.adapter_dir)
        replay.state = state
        table = [ParamMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in engine.items()]
        merged64 = model_state(peft_merged_model(model.base_dir, replay.save(tmp_path / "adapter"), dtype=torch.float64))
        oracle = quantized_state(merged64, table)
        assert served.keys() == oracle.keys()
        bad = [n for n, t in oracle.items() if not torch.equal(served[n].view(torch.uint8), t.contiguous().view(torch.uint8))]
        assert not bad, f"not transformers' Fp8Quantize of PEFT's float64 merge: {bad[:4]}"


def test_an_engine_holding_a_target_in_another_float_dtype_is_refused_by_name():
    name = "model.layers.0.mlp.experts.down_proj"
    meta = ParamMeta(name, "float32", (2, 16, 8))
    term = LoraTerm((0, 2), (0, 16), (0, 8), torch.zeros(2, 16, 2), torch.zeros(2, 2, 8), 1.0)
    recipes = recipes_for_target(meta, [term], experts_per_recipe=1, max_block_bytes=1 << 20)
    with pytest.raises(ValueError, match=rf"factor streaming of {name}: the engines hold it in bfloat16, the "
                                         r"trainers' base in float32.*load the engines in float32 or in block FP8"):
        build_factor_plan([[ParamMeta(name, "bfloat16", (2, 16, 8))]], recipes, bucket_bytes=1 << 20)


def test_owned_boxes_are_read_back_from_the_split_pieces():
    for box, cap in [(((0, 4), (0, 16), (0, 8)), 256), (((2, 4), (8, 16), (0, 8)), 64), (((0, 16), (0, 8)), 1 << 20)]:
        pieces = list(split_box(box, 2, cap))
        assert owned_boxes(pieces, 2, cap) == [box]
    a, b = ((0, 2), (0, 16)), ((4, 6), (0, 16))  # strided boxes of one rank: never joined
    assert owned_boxes(list(split_box(a, 2, 32)) + list(split_box(b, 2, 32)), 2, 32) == [a, b]


def test_an_fp8_target_weighs_its_fp8_values_and_scales_against_its_factors():
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    halves = [((0, 16), (0, 32)), ((16, 32), (0, 32))]
    owned = [[ParamMeta(q, "float8_e4m3fn", (32, 32), box), ParamMeta(q[:-7] + ".weight_scale_inv", "float32", (2, 2),
                                                                      ((i, i + 1), (0, 2))), ParamMeta(k, "bfloat16", (32, 32), box)]
             for i, box in enumerate(halves)]
    costs = [TargetCost(name=n, merged_bytes=32 * 32 * 2, factor_bytes=512, pristine_bytes=32 * 32 * 2) for n in (q, k)]
    assert [c.merged_bytes for c in engine_merged_bytes(costs, owned)] == [32 * 32 + 4 * 4, 32 * 32 * 2]
