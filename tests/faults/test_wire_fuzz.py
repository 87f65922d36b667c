"""Bounded fuzz of the wire decoder (hypothesis): every message type, valid encodings mutated by
byte flips, truncations, splices, huge declared lengths, msgpack ext types and wrong types nested
anywhere. ``decode`` must return a valid message or raise ``ProtocolError`` — never another
exception, never take long (a hang or a huge allocation shows as a slow call) — and anything it
accepts must re-encode to a message that decodes to itself."""

from __future__ import annotations

import struct
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols.recipe import Recipe
from protocols.wire import (
    MAX_NAME_CHARS, MAX_NDIM, MAX_PEERS, MAX_SESSION_CHARS, MAX_TEXT_CHARS, Abort, Ack, Begin, BucketHeader, Commit, Error, PlanEntry, ProtocolError, SyncPlan, encode, seal, verify_mac,
)
from protocols.wire_check import decode

pytestmark = pytest.mark.faults

SLOW_DECODE_S = 5.0  # a decode of <= 8 MiB that takes longer than this is a hang for our purposes
FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))

_R = Recipe(target="model.layers.0.mlp.experts.gate_up_proj", target_dtype="float32", target_shape=(4, 16, 8), term=0,
            term_experts=(0, 4), experts=(0, 2), rows=(0, 16, 1), cols=(0, 8, 1), rank=2, scaling=4.0, x_at=0, y_at=256)
RECIPE = PlanEntry(name=_R.entry_name(), dtype="float32", shape=(_R.numel(),), box=((0, _R.numel()),), sender=0,
                   bucket=0, offset=0, nbytes=_R.numel() * 4, kind="recipe", recipe=_R)
E0 = PlanEntry(name="w", dtype="bfloat16", shape=(4, 8), box=((0, 2), (0, 8)), sender=0, bucket=0, offset=384, nbytes=32)
E1 = PlanEntry(name="s", dtype="float32", shape=(), box=(), sender=0, bucket=0, offset=448, nbytes=4)
HEADER = BucketHeader(session="s1", version=3, sender=0, seq=0, entries=(RECIPE, E0, E1), payload_nbytes=452,
                      checksum=2**64 - 1)
SECRET = b"k" * 32
SEEDS = [
    HEADER, seal(HEADER, SECRET), SyncPlan(bucket_bytes=1024, entries=(RECIPE, E0, E1), session="s1", version=2),
    Begin(session="s1", version=3, sender=0, plan_digest=5, num_buckets=1, names=("w", "s")),
    Begin(session="s1", version=3, sender=1, plan_digest=2**64 - 1, num_buckets=0),
    Commit(session="s1", version=3, sender=0, num_buckets=1, payload_bytes=452),
    Abort(session="s1", version=3, sender=0, reason="fill failed"),
    Ack(session="s1", version=3, receiver=1, num_entries=3, payload_bytes=452),
    Error(session="", version=0, receiver=1, field="header.checksum", message="mismatch"),
]
ENCODED = [encode(m) for m in SEEDS]


def check_decode(data: bytes) -> None:
    """The fuzz property (see the module docstring)."""
    t0 = time.perf_counter()
    try:
        msg = decode(data)
    except ProtocolError as exc:
        assert exc.field and isinstance(exc.message, str)
        msg = None
    elapsed = time.perf_counter() - t0
    assert elapsed < SLOW_DECODE_S, f"decode of {len(data)} bytes took {elapsed:.2f}s"
    if msg is not None:
        assert decode(encode(msg)) == msg
        if isinstance(msg, BucketHeader):
            try:
                verify_mac(msg, SECRET)
            except ProtocolError as exc:
                assert exc.field == "header.mac"


def test_seeds_are_valid():
    assert [decode(b) for b in ENCODED] == SEEDS


@FUZZ
@given(seed=st.sampled_from(ENCODED), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)),
                                                      min_size=1, max_size=8))
def test_byte_flips(seed, flips):
    data = bytearray(seed)
    for pos, xor in flips:
        data[pos % len(data)] ^= xor
    check_decode(bytes(data))


@FUZZ
@given(seed=st.sampled_from(ENCODED), cut=st.integers(0, 10**6), tail=st.binary(max_size=16))
def test_truncations_and_splices(seed, cut, tail):
    data = seed[:cut % len(seed)]
    check_decode(data)
    check_decode(data + tail)
    check_decode(seed + tail)  # trailing bytes


# msgpack length-prefixed markers: array16/32, map16/32, str8/16/32, bin8/16/32 (spec: github.com/msgpack/msgpack)
_LENGTH_MARKERS = {0xdc: ">H", 0xdd: ">I", 0xde: ">H", 0xdf: ">I", 0xd9: ">B", 0xda: ">H", 0xdb: ">I",
                   0xc4: ">B", 0xc5: ">H", 0xc6: ">I"}


@FUZZ
@given(seed=st.sampled_from(ENCODED), marker=st.sampled_from(sorted(_LENGTH_MARKERS)), pos=st.integers(0, 10**6),
       huge=st.sampled_from([2**8 - 1, 2**16 - 1, 2**31, 2**32 - 1]))
def test_huge_declared_lengths(seed, marker, pos, huge):
    """A length prefix claiming up to 4 Gi items/bytes inside a short message: refused quickly,
    without allocating what the prefix claims."""
    fmt = _LENGTH_MARKERS[marker]
    value = huge % (1 << (8 * struct.calcsize(fmt)))
    p = pos % (len(seed) + 1)
    check_decode(seed[:p] + bytes([marker]) + struct.pack(fmt, value) + seed[p:])
    check_decode(bytes([0x93, 0x01, 0xa6]) + b"bucket" + bytes([marker]) + struct.pack(fmt, value))


leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
                 st.text(max_size=8), st.binary(max_size=8), st.just("x" * (MAX_TEXT_CHARS + 1)),
                 st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8)),
                 st.builds(msgpack.Timestamp, st.integers(0, 2**32 - 1)))
trees = st.recursive(leaf, lambda c: st.lists(c, max_size=6) | st.dictionaries(st.text(max_size=3), c, max_size=3),
                     max_leaves=20)


def _paths(tree, prefix=()):
    yield prefix
    if isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _paths(v, prefix + (i,))


@FUZZ
@given(seed=st.sampled_from(ENCODED), pick=st.integers(0, 10**6), value=trees)
def test_wrong_types_nested(seed, pick, value):
    """Any node of a valid message (however deep: entries, boxes, recipes) replaced by a value of
    any msgpack type, ext types and timestamps included."""
    tree = msgpack.unpackb(seed, raw=False)
    paths = list(_paths(tree))[1:]
    path = paths[pick % len(paths)]
    node = tree
    for i in path[:-1]:
        node = node[i]
    node[path[-1]] = value
    check_decode(msgpack.packb(tree, use_bin_type=True, datetime=False))


@FUZZ
@given(seed=st.sampled_from(ENCODED), pick=st.integers(0, 10**6), drop=st.booleans(), extra=trees)
def test_missing_and_extra_items(seed, pick, drop, extra):
    tree = msgpack.unpackb(seed, raw=False)
    lists = [p for p in _paths(tree) if isinstance(_at(tree, p), list)]
    target = _at(tree, lists[pick % len(lists)])
    if drop and target:
        target.pop(pick % len(target))
    else:
        target.insert(pick % (len(target) + 1), extra)
    check_decode(msgpack.packb(tree, use_bin_type=True))


def _at(tree, path):
    for i in path:
        tree = tree[i]
    return tree


@pytest.mark.parametrize("make", [
    lambda: Begin(session="s" * (MAX_SESSION_CHARS + 1), version=1, sender=0, plan_digest=1, num_buckets=1),
    lambda: Begin(session="s", version=1, sender=0, plan_digest=1, num_buckets=1, names=("n" * (MAX_NAME_CHARS + 1),)),
    lambda: Begin(session="s", version=1, sender=MAX_PEERS, plan_digest=1, num_buckets=1),
    lambda: Begin(session="s", version=2**63, sender=0, plan_digest=1, num_buckets=1),
    lambda: Abort(session="s", version=1, sender=0, reason="r" * (MAX_TEXT_CHARS + 1)),
    lambda: Error(session="s", version=1, receiver=0, field="f", message="m" * (MAX_TEXT_CHARS + 1)),
    lambda: Error(session="s", version=1, receiver=0, field="f" * (MAX_NAME_CHARS + 1), message="m"),
    lambda: Ack(session="s", version=1, receiver=MAX_PEERS, num_entries=0, payload_bytes=0),
    lambda: Commit(session="s", version=1, sender=0, num_buckets=-1, payload_bytes=0),
    lambda: SyncPlan(bucket_bytes=64, entries=(PlanEntry(name="t", dtype="float32", shape=(1,) * (MAX_NDIM + 1),
                                                         box=((0, 1),) * (MAX_NDIM + 1), sender=0, bucket=0, offset=0,
                                                         nbytes=4),)),
    lambda: SyncPlan(bucket_bytes=64, entries=(PlanEntry(name="n" * (MAX_NAME_CHARS + 1), dtype="float32", shape=(1,),
                                                         box=((0, 1),), sender=0, bucket=0, offset=0, nbytes=4),)),
    lambda: BucketHeader(session="s", version=1, sender=0, seq=0, entries=(E1,), payload_nbytes=2, checksum=1),
], ids=["session", "names", "sender", "version", "reason", "message", "field", "receiver", "num_buckets", "ndim",
        "name", "entry_past_payload"])
def test_every_field_has_a_size_limit(make):
    with pytest.raises(ProtocolError):
        decode(encode(make()))
