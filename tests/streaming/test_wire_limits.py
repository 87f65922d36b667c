"""Decoder limits: hostile nesting and maximum-size messages fail (or pass) fast with ProtocolError."""

from __future__ import annotations

import time

import msgpack
import pytest

from protocols.wire import MAX_BUCKET_ENTRIES, MAX_NDIM, MAX_PLAN_ENTRIES, ProtocolError, SyncPlan
from protocols.wire_check import decode


@pytest.mark.parametrize("prefix", [b"\x92\x01", b"\x92", b"\x94\x01\xa4plan\xa0\x00\x01\x91"], ids=["tag", "schema", "plan"])
@pytest.mark.parametrize("depth", [1000, 5000])
def test_deep_nesting_is_a_protocol_error(prefix, depth):
    with pytest.raises(ProtocolError) as info:
        decode(prefix + b"\x91" * depth + b"\xc0")
    assert len(str(info.value)) < 400


HANG_GUARD_S = 5.0
"""CPU seconds: far above the measured cost (~0.1-1.5 s), far below the 22 s a hostile header once cost."""


def _plan_bytes(n: int, ndim: int) -> bytes:
    entries = [["tensor", f"n{i}", "uint8", [1] * ndim, [[0, 1]] * ndim, 0, i, 0, 1] for i in range(n)]
    return msgpack.packb([1, "plan", "", 0, 1, entries])


def _cpu_seconds(data: bytes):
    t0 = time.process_time()
    try:
        result = decode(data)
    except ProtocolError as exc:
        result = exc
    return time.process_time() - t0, result


def test_too_many_dims_rejected_fast():
    seconds, result = _cpu_seconds(_plan_bytes(MAX_PLAN_ENTRIES, 16))
    assert isinstance(result, ProtocolError) and result.field == "plan.entries[0].shape"
    assert f"> {MAX_NDIM}" in str(result)
    assert seconds < HANG_GUARD_S, seconds  # a no-hang guard, not a speed goal (see benchmarks)


def test_too_many_entries_rejected():
    for tag, body in (("plan", ["", 0, 1]), ("bucket", ["s", 0, 0, 0])):
        n = (MAX_PLAN_ENTRIES if tag == "plan" else MAX_BUCKET_ENTRIES) + 1
        entries = [["tensor", f"n{i}", "uint8", [1], [[0, 1]], 0, i, 0, 1] for i in range(n)]
        tail = [] if tag == "plan" else [1, 0, None]
        raw = [1, tag, *body, entries, *tail] if tag == "plan" else [1, tag, *body, entries, *tail]
        seconds, result = _cpu_seconds(msgpack.packb(raw))
        assert isinstance(result, ProtocolError), result
        assert f"{n} entries > the limit" in str(result)
        assert seconds < HANG_GUARD_S, seconds  # a no-hang guard, not a speed goal (see benchmarks)


def test_largest_legal_plan_decodes():
    """65,536 entries of MAX_NDIM dims (~4 MB): decoded, CPU-bound well under the old 22 s."""
    seconds, result = _cpu_seconds(_plan_bytes(MAX_PLAN_ENTRIES, MAX_NDIM))
    assert isinstance(result, SyncPlan) and len(result.entries) == MAX_PLAN_ENTRIES
    assert seconds < 3 * HANG_GUARD_S, seconds  # a no-hang guard, not a speed goal
