"""Wire messages: round trips, validation naming the field, HMAC, and a bounded decoder fuzz."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.wire import (
    MAX_HEADER_BYTES, Abort, Ack, Begin, BucketHeader, Commit, Error, PlanEntry, ProtocolError, SyncPlan, encode, seal, verify_mac,
)
from protocols.wire_check import decode

E0 = PlanEntry(name="w", dtype="bfloat16", shape=(4, 8), box=((0, 2), (0, 8)), sender=0, bucket=0, offset=0, nbytes=32)
E1 = PlanEntry(name="s", dtype="float32", shape=(), box=(), sender=0, bucket=0, offset=64, nbytes=4)
HEADER = BucketHeader(session="s1", version=3, sender=0, seq=0, entries=(E0, E1), payload_nbytes=68, checksum=2**64 - 1)
MESSAGES = [
    HEADER, SyncPlan(bucket_bytes=128, entries=(E0, E1)),
    Begin(session="s1", version=3, sender=0, plan_digest=5, num_buckets=1, names=("w",)),
    Begin(session="s1", version=3, sender=0, plan_digest=5, num_buckets=1),
    Commit(session="s1", version=3, sender=0, num_buckets=1, payload_bytes=68),
    Abort(session="s1", version=3, sender=0, reason="fill failed"),
    Ack(session="s1", version=3, receiver=1, num_entries=2, payload_bytes=68),
    Error(session="s1", version=3, receiver=1, field="header.checksum", message="mismatch"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


def _tamper(index: int, value) -> bytes:
    raw = msgpack.unpackb(encode(HEADER))
    path = index if isinstance(index, tuple) else (index,)
    target = raw
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = value
    return msgpack.packb(raw)


@pytest.mark.parametrize("path,value,field", [
    (0, 2, "schema_version"),
    (1, "nope", "tag"),
    (3, -1, "header.version"),
    (6, (0, 0, 0, 0, 0, 0, 0, 0, 0), "header.entries[0]"),
    ((6, 0, 0), "recipe", "header.entries[0].kind"),
    ((6, 0, 2), "complex64", "header.entries[0].dtype"),
    ((6, 0, 4, 0, 1), 9, "header.entries[0].box[0].stop"),
    ((6, 0, 8), 31, "header.entries[0].nbytes"),
    ((6, 1, 7), 8, "header.entries[1].offset"),
    ((6, 1, 7), 0, "header.entries[1].offset"),
    (7, 66, "header.entries[1].nbytes"),
    (8, -1, "header.checksum"),
    (9, b"short", "header.mac"),
])
def test_bad_field_is_named(path, value, field):
    with pytest.raises(ProtocolError) as info:
        decode(_tamper(path, value))
    assert info.value.field.startswith(field), info.value


def test_header_size_limit():
    with pytest.raises(ProtocolError, match="header limit"):
        decode(b"\x00" * (MAX_HEADER_BYTES + 1))


def test_hmac_verified_with_secret():
    sealed = seal(HEADER, b"k1")
    verify_mac(decode(encode(sealed)), b"k1")
    for bad in (HEADER, seal(HEADER, b"k2"), seal(HEADER, b"k1").__class__(**{**_fields(sealed), "checksum": 1})):
        with pytest.raises(ProtocolError, match="HMAC") as info:
            verify_mac(bad, b"k1")
        assert info.value.field == "header.mac"


def _fields(h: BucketHeader) -> dict:
    return {f: getattr(h, f) for f in h.__slots__}


leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=8),
                 st.binary(max_size=8))
trees = st.recursive(leaf, lambda c: st.lists(c, max_size=10) | st.dictionaries(st.text(max_size=4), c, max_size=4),
                     max_leaves=40)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=256))
def test_fuzz_random_bytes_only_protocol_error(data):
    try:
        decode(data)
    except ProtocolError:
        pass


@settings(max_examples=80, deadline=None)
@given(tag=st.sampled_from(["plan", "bucket", "begin", "commit", "abort", "ack", "error"]), body=st.lists(trees, max_size=10))
def test_fuzz_structured_only_protocol_error(tag, body):
    try:
        decode(msgpack.packb([1, tag, *body], use_bin_type=True))
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(msg=st.sampled_from(MESSAGES), pos=st.integers(0, 10**6), byte=st.integers(0, 255))
def test_fuzz_mutated_valid_messages(msg, pos, byte):
    data = bytearray(encode(msg))
    data[pos % len(data)] = byte
    try:
        decode(bytes(data))
    except ProtocolError:
        pass
