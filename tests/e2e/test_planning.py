"""Plan building and validation against engine tables (pure, no Ray)."""

from __future__ import annotations

import pytest

from protocols.params import ParamMeta
from sync_service.coordinator.planning import PlanMismatchError, build_sync_plan, validate_plan

GU = "model.layers.0.mlp.experts.gate_up_proj"
NORM = "model.norm.weight"


def owned():
    # EP=2: each rank one expert half of GU; rank 0 alone sends the norm
    return [[ParamMeta(GU, "float32", (4, 8, 6), ((0, 2), (0, 8), (0, 6))), ParamMeta(NORM, "float32", (6,))],
            [ParamMeta(GU, "float32", (4, 8, 6), ((2, 4), (0, 8), (0, 6)))]]


def table(**override):
    metas = {GU: ParamMeta(GU, "float32", (4, 8, 6)), NORM: ParamMeta(NORM, "float32", (6,))}
    metas.update(override)
    return [m for m in metas.values() if m is not None]


def test_matching_table_passes_and_buckets_are_per_sender():
    plan = build_sync_plan(owned(), bucket_bytes=256)
    validate_plan(plan, table(), engine="e0")
    assert {e.sender for e in plan.entries} == {0, 1}
    assert max(e.bucket for e in plan.entries) >= 1  # 384-byte expert halves split over 256-byte buckets


@pytest.mark.parametrize("override,field,needle", [
    ({NORM: None}, "unexpected", NORM),
    ({GU: ParamMeta(GU, "bfloat16", (4, 8, 6))}, "mismatched", "bfloat16"),
    ({"lm_head.weight": ParamMeta("lm_head.weight", "float32", (6, 6))}, "missing", "lm_head.weight"),
])
def test_mismatch_is_reported_by_name(override, field, needle):
    plan = build_sync_plan(owned(), bucket_bytes=4096)
    with pytest.raises(PlanMismatchError, match="engine 'e1'") as err:
        validate_plan(plan, table(**override), engine="e1")
    assert any(needle in x for x in getattr(err.value, field))


def test_partially_covered_engine_tensor_is_missing():
    plan = build_sync_plan([owned()[0]], bucket_bytes=4096)  # rank 1's experts never sent
    with pytest.raises(PlanMismatchError) as err:
        validate_plan(plan, table(), engine="e2")
    assert err.value.missing == [GU]


def test_box_produced_twice_is_rejected():
    with pytest.raises(ValueError, match="planned twice"):
        build_sync_plan([owned()[0], owned()[0][:1]], bucket_bytes=4096)
