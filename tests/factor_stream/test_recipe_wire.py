"""The ``recipe`` entry kind on the wire: round trips, every field validated and named, bounded fuzz."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.recipe import Recipe
from protocols.wire import BucketHeader, PlanEntry, ProtocolError, SyncPlan, encode
from protocols.wire_check import decode

RECIPE = Recipe(target="model.layers.0.mlp.experts.gate_up_proj", target_dtype="bfloat16", target_shape=(4, 16, 8),
                term=0, term_experts=(0, 4), experts=(2, 4), rows=(1, 16, 2), cols=(0, 8, 1), rank=2, scaling=0.5,
                x_at=0, y_at=2 * 8 * 2 * 4)
N = RECIPE.numel()
ENTRY = PlanEntry(name=RECIPE.entry_name(), dtype="float32", shape=(N,), box=((0, N),), sender=0, bucket=0, offset=0,
                  nbytes=N * 4, kind="recipe", recipe=RECIPE)
DENSE = Recipe(target="lm_head.weight", target_dtype="float32", target_shape=(64, 16), term=1, term_experts=None,
               experts=None, rows=(0, 64, 1), cols=(0, 16, 1), rank=4, scaling=2.0, x_at=0, y_at=64 * 4 * 4, x_t=True, y_t=True)
DENSE_ENTRY = PlanEntry(name=DENSE.entry_name(), dtype="float32", shape=(DENSE.numel(),), box=((0, DENSE.numel()),),
                        sender=0, bucket=0, offset=N * 4 + 64 - (N * 4) % 64, nbytes=DENSE.numel() * 4, kind="recipe", recipe=DENSE)
HEADER = BucketHeader(session="s", version=1, sender=0, seq=0, entries=(ENTRY, DENSE_ENTRY),
                      payload_nbytes=DENSE_ENTRY.offset + DENSE_ENTRY.nbytes, checksum=1)


def test_round_trip_plan_and_header():
    assert ENTRY.name == "model.layers.0.mlp.experts.gate_up_proj@lora0:e2-4" and DENSE.entry_name() == "lm_head.weight@lora1"
    plan = SyncPlan(bucket_bytes=1 << 16, entries=(ENTRY, DENSE_ENTRY))
    assert decode(encode(plan)) == plan and decode(encode(HEADER)) == HEADER
    assert RECIPE.x_shape() == (2, 8, 2) and RECIPE.y_shape() == (2, 2, 8)


def _tampered(index: int, value) -> bytes:
    raw = msgpack.unpackb(encode(HEADER))
    raw[6][0][9][index] = value
    return msgpack.packb(raw)


@pytest.mark.parametrize("index,value,field", [
    (0, "", "recipe.target"),
    (1, "int8", "recipe.target_dtype"),
    (2, [16], "recipe.target_shape"),
    (2, [4, 16, 0], "recipe.target_shape[2]"),
    (3, -1, "recipe.term"),
    (4, [0, 5], "recipe.term_experts.stop"),
    (5, [3, 6], "recipe.experts.stop"),
    (5, None, "recipe.experts"),
    (6, [0, 17, 1], "recipe.rows.stop"),
    (6, [0, 16, 0], "recipe.rows.step"),
    (7, [8, 8, 1], "recipe.cols"),
    (8, 0, "recipe.rank"),
    (8, 3, "recipe.size"),
    (9, float("nan"), "recipe.scaling"),
    (9, 1, "recipe.scaling"),
    (11, 7, "recipe.y_at"),
    (12, 1, "recipe.x_t"),
])
def test_bad_recipe_field_is_named(index, value, field):
    with pytest.raises(ProtocolError) as info:
        decode(_tampered(index, value))
    assert info.value.field == f"header.entries[0].{field}", info.value


def test_entry_level_recipe_errors():
    raw = msgpack.unpackb(encode(HEADER))
    raw[6][0][1] = "other@lora0:e2-4"
    with pytest.raises(ProtocolError, match="recipe name") as info:
        decode(msgpack.packb(raw))
    assert info.value.field == "header.entries[0].recipe.target"
    raw = msgpack.unpackb(encode(HEADER))
    del raw[6][0][9]  # a recipe entry without its recipe
    with pytest.raises(ProtocolError) as info:
        decode(msgpack.packb(raw))
    assert info.value.field == "header.entries[0].kind"
    raw = msgpack.unpackb(encode(HEADER))
    raw[6][0][2] = "int32"  # factors are floating point
    with pytest.raises(ProtocolError) as info:
        decode(msgpack.packb(raw))
    assert info.value.field == "header.entries[0].recipe.dtype"


_ANY = st.recursive(st.none() | st.booleans() | st.integers(-2, 2**64 - 1) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=5), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(index=st.integers(0, 13), value=_ANY)
def test_fuzzed_recipe_fields_raise_only_protocol_errors(index, value):
    try:
        msg = decode(_tampered(index, value))
    except ProtocolError:
        return
    assert msg.entries[0].recipe is not None  # accepted only if still self-consistent
