"""``bucket_bytes`` against the plan's one-message limits, checked when the plan is built (before any
byte moves): a bucket so small that the plan has more entries than a message carries
(``MAX_PLAN_ENTRIES``) or encodes past the header limit (``MAX_HEADER_BYTES``) is refused naming
``bucket_bytes`` and the smallest value that fits — which does fit. It was refused only by the
endpoints, seconds later, as "message: 37283345 bytes exceeds the header limit 8388608"."""

from __future__ import annotations

import re
import time

import pytest

from protocols.params import DTYPE_BYTES, ParamMeta
from protocols.wire import MAX_HEADER_BYTES, MAX_PLAN_ENTRIES, encode
from sync_service.coordinator.planning import build_sync_plan, check_plan_size
from sync_service.streaming.plan import count_pieces, split_box

E, H, I, LAYERS = 8, 128, 64, 26  # noqa: E741  (Qwen3-MoE-like: experts, hidden, expert intermediate)


def qwen3_moe_metas(layers: int = LAYERS, prefix: str = "model") -> list[ParamMeta]:
    """The merged tensors of a small Qwen3-MoE (~28 MiB in fp32), as a trainer owns them."""
    metas = [ParamMeta(name=f"{prefix}.embed_tokens.weight", dtype="float32", shape=(1024, H))]
    for k in range(layers):
        p = f"{prefix}.layers.{k}"
        metas += [ParamMeta(name=f"{p}.self_attn.{n}_proj.weight", dtype="float32", shape=(H, H)) for n in "qkvo"]
        metas += [ParamMeta(name=f"{p}.mlp.experts.gate_up_proj", dtype="float32", shape=(E, 2 * I, H)),
                  ParamMeta(name=f"{p}.mlp.experts.down_proj", dtype="float32", shape=(E, H, I)),
                  ParamMeta(name=f"{p}.mlp.gate.weight", dtype="float32", shape=(E, H)),
                  ParamMeta(name=f"{p}.input_layernorm.weight", dtype="float32", shape=(H,))]
    return metas


def fix_of(message: str) -> int:
    return int(re.search(r"set bucket_bytes to at least (\d+)", message).group(1))


def test_count_pieces_equals_split_box():
    for meta in qwen3_moe_metas(layers=1):
        for cap in (64, 192, 4096, 1 << 16, 1 << 20):
            box, size = meta.covered_box(), DTYPE_BYTES[meta.dtype]
            assert count_pieces(box, size, cap) == sum(1 for _ in split_box(box, size, cap)), (meta.name, cap)


def test_too_small_bucket_refused_before_the_plan_is_built_with_a_value_that_fits():
    owned = [qwen3_moe_metas()]
    model_bytes = sum(4 * __import__("math").prod(m.shape) for m in owned[0])
    assert 20 << 20 < model_bytes < 40 << 20
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"SyncConfig\.bucket_bytes=64 cuts the model .* plan of \d+ entries") as err:
        check_plan_size(owned, bucket_bytes=64)
    assert time.perf_counter() - t0 < 5.0, "checked from the metas, not by splitting"
    assert f"{MAX_HEADER_BYTES} bytes (the header limit" in str(err.value)
    fix = fix_of(str(err.value))
    assert fix % 64 == 0 and fix > 64
    plan = build_sync_plan(owned, bucket_bytes=fix)
    encoded = len(encode(plan))
    assert len(plan.entries) <= MAX_PLAN_ENTRIES and encoded <= MAX_HEADER_BYTES
    check_plan_size(owned, bucket_bytes=fix)
    check_plan_size(owned, bucket_bytes=fix, encoded=encoded)


def test_plan_past_the_header_limit_refused_naming_bucket_bytes():
    """Fewer entries than ``MAX_PLAN_ENTRIES`` but long names: the encoded plan is what overflows."""
    owned = [qwen3_moe_metas(layers=4, prefix="m" * 900)]
    bucket = 512
    plan = build_sync_plan(owned, bucket_bytes=bucket)
    encoded = len(encode(plan))
    assert len(plan.entries) <= MAX_PLAN_ENTRIES and encoded > MAX_HEADER_BYTES
    check_plan_size(owned, bucket_bytes=bucket)  # the entry count alone fits
    with pytest.raises(ValueError, match=rf"bucket_bytes={bucket} .* {encoded} bytes encoded") as err:
        check_plan_size(owned, bucket_bytes=bucket, encoded=encoded)
    fix = fix_of(str(err.value))
    assert len(encode(build_sync_plan(owned, bucket_bytes=fix))) <= MAX_HEADER_BYTES
