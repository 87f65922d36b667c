"""Serving in the engine's precision: the engines' tables decide the dtype a tensor is sent in.

An fp32 trainer base syncs into a bf16 HF engine: the trainers merge in their accumulation dtype and cast
once into bf16, straight into the bucket (``coordinator.planning.engine_dtypes``, ``MergeConfig.out_dtypes``).
The oracle is PEFT's float64 merge cast once into the ENGINE's dtype (``peft_merged_state(dtypes=)``):
bitwise with float64 accumulation, within one bf16 rounding step with fp32 accumulation. Engines that hold
one tensor in two dtypes, shapes that differ, FP8 and integer dtypes are refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch

from protocols.params import ParamMeta
from sync_service.api import DtypeConflictError, SyncConfig, WeightSync
from sync_service.coordinator.planning import PlanMismatchError, build_sync_plan, engine_dtypes, validate_plan
from sync_service.entrypoints.local import AdapterReplay
from sync_service.synthetic import make_adapter, make_base
from sync_service.verify.peft_oracle import peft_merged_state

GU = "model.layers.0.mlp.experts.gate_up_proj"
NORM = "model.norm.weight"
IDS = "model.position_ids"


# -- planning (pure) ------------------------------------------------------------------------------
def owned(dtype: str = "float32"):
    return [[ParamMeta(GU, dtype, (4, 8, 6), ((0, 2), (0, 8), (0, 6))), ParamMeta(NORM, dtype, (6,)),
             ParamMeta(IDS, "int64", (6,))],
            [ParamMeta(GU, dtype, (4, 8, 6), ((2, 4), (0, 8), (0, 6)))]]


def table(dtype: str = "bfloat16", **override):
    metas = {GU: ParamMeta(GU, dtype, (4, 8, 6)), NORM: ParamMeta(NORM, dtype, (6,)), IDS: ParamMeta(IDS, "int64", (6,))}
    metas.update(override)
    return list(metas.values())


@pytest.mark.parametrize("trainer,engine", [("float32", "bfloat16"), ("float32", "float16"), ("bfloat16", "float32")])
def test_plan_carries_the_engines_float_dtype(trainer, engine):
    retyped, conversions = engine_dtypes(owned(trainer), {"e0": table(engine), "e1": table(engine)})
    assert conversions == {(trainer, engine): 2}  # per tensor, not per box; the int64 tensor is not cast
    plan = build_sync_plan(retyped, bucket_bytes=4096)
    assert {e.name: e.dtype for e in plan.entries} == {GU: engine, NORM: engine, IDS: "int64"}
    validate_plan(plan, table(engine), engine="e0")


def test_same_dtype_converts_nothing():
    retyped, conversions = engine_dtypes(owned(), {"e0": table("float32")})
    assert conversions == {} and retyped == owned()


def test_engines_disagreeing_on_a_dtype_are_refused_by_name():
    with pytest.raises(DtypeConflictError, match=f"{NORM}: engine 'a' bfloat16, engine 'b' float16") as err:
        engine_dtypes(owned(), {"a": table("bfloat16"), "b": table("bfloat16", **{NORM: ParamMeta(NORM, "float16", (6,))})})
    assert err.value.conflicts == {NORM: {"a": "bfloat16", "b": "float16"}}


def test_fp8_without_its_scales_is_refused_by_name():
    with pytest.raises(ValueError, match=f"{NORM} is float8_e4m3fn\\[6\\]; an engine serving block FP8 lists its scales"):
        engine_dtypes(owned(), {"e0": table(**{NORM: ParamMeta(NORM, "float8_e4m3fn", (6,))})})


@pytest.mark.parametrize("override,needle", [
    ({NORM: ParamMeta(NORM, "bfloat16", (7,))}, f"{NORM}: sent bfloat16[6] vs engine bfloat16[7]"),  # cast, then refused
    ({IDS: ParamMeta(IDS, "int32", (6,))}, f"{IDS}: sent int64[6] vs engine int32[6]"),  # integers are never cast
])
def test_shape_and_integer_mismatches_are_still_refused(override, needle):
    retyped, _ = engine_dtypes(owned(), {"e0": table(**override)})
    with pytest.raises(PlanMismatchError) as err:
        validate_plan(build_sync_plan(retyped, bucket_bytes=4096), table(**override), engine="e0")
    assert needle in err.value.mismatched


# -- end to end: fp32 trainer → bf16 HF engine (one Ray session) ---------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("dtype")
    base = make_base("qwen3_moe", root / "base", num_experts=4, num_layers=1)
    bf16 = make_base("qwen3_moe", root / "base-bf16", num_experts=4, num_layers=1, dtype="bfloat16")  # the engine's start
    return base, bf16, make_adapter("qwen3_moe", base, root / "lora", kind="target_parameters", r=2)


@pytest.fixture(scope="module")
def actors(ray_local, files):
    from actors.launch import start_engines, start_trainers

    base, bf16, adapter = files
    trainers = start_trainers(base, adapter, ep=1)
    (engine_bf16,) = start_engines(bf16, 1, prefix="bf16-")
    (engine_fp32,) = start_engines(base, 1, prefix="fp32-")
    yield trainers, engine_bf16, engine_fp32
    for a in [*trainers, engine_bf16, engine_fp32]:
        ray.kill(a)


def served_and_oracle(engine, base, replay, out_dir):
    """The engine's served tensors (fp32-widened numpy), PEFT's float64 merge cast once into its dtypes, its dtypes."""
    dtypes = {m.name: m.dtype for m in ray.get(engine.param_metas.remote())}
    oracle = peft_merged_state(base, replay.save(out_dir), dtypes=dtypes)
    return ray.get(engine.state.remote()), oracle, dtypes


def assert_bitwise(served, oracle, what):
    assert set(served) == set(oracle)
    bad = [n for n, t in oracle.items() if not np.array_equal(served[n], t.float().numpy())]
    assert not bad, f"{what}: {len(bad)} tensor(s) not PEFT's float64 merge cast once to bf16, e.g. {bad[:3]}"


def assert_one_rounding_step(served, oracle, what):
    """|served − oracle| ≤ one bf16 spacing at the oracle's value (fp32 accumulation, then the one cast)."""
    assert set(served) == set(oracle)
    for n, want in oracle.items():
        got = torch.from_numpy(np.array(served[n])).to(want.dtype)  # bf16 widened to fp32: exact back
        _, exponent = torch.frexp(want.double())  # |w| = m·2^e, m in [0.5, 1): spacing eps·2^(e-1)
        spacing = torch.ldexp(torch.full_like(want, torch.finfo(want.dtype).eps, dtype=torch.float64), exponent - 1)
        diff = (got.double() - want.double()).abs()
        assert bool((diff <= spacing).all()), f"{what}: {n} off by up to {float(diff.max()):.3g}, past one bf16 step"


def test_fp32_trainer_serves_a_bf16_engine(files, actors, tmp_path):
    """Per accumulation dtype a new WeightSync: a full sync, then a delta after the adapter changed."""
    base, _, adapter = files
    trainers, engine, _ = actors
    replay = AdapterReplay(adapter)
    v = 0
    for accumulate, check in (("float64", assert_bitwise), ("float32", assert_one_rounding_step)):
        sync = WeightSync(trainers=trainers, engines=[engine], config=SyncConfig(
            transport="shm", bucket_bytes=8 << 10, timeout_s=90, reset_versions=True, accumulate_dtype=accumulate))
        try:
            assert sync.dtype_conversions.keys() == {("float32", "bfloat16")}
            assert {e.dtype for e in sync.plan.entries} == {"bfloat16"}
            for full in (True, False):
                if not full:
                    ray.get([t.train_step.remote(v) for t in trainers])
                    replay.step(v)
                m = sync.push(v)
                assert m.full == full and all(e.committed for e in m.engines)
                served, oracle, dtypes = served_and_oracle(engine, base, replay, tmp_path / f"adapter-{v}")
                assert {d for n, d in dtypes.items() if oracle[n].is_floating_point()} == {"bfloat16"}
                check(served, oracle, f"accumulate {accumulate}, version {v}")
                v += 1
        finally:
            sync.close()


def test_engines_in_two_dtypes_are_refused_before_any_byte(actors):
    trainers, engine_bf16, engine_fp32 = actors
    with pytest.raises(DtypeConflictError, match=r"engine 'bf16-0' bfloat16, engine 'fp32-0' float32") as err:
        WeightSync(trainers=trainers, engines=[engine_bf16, engine_fp32],
                   config=SyncConfig(transport="shm", timeout_s=90, reset_versions=True))
    assert "lm_head.weight" in err.value.conflicts
