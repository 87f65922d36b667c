"""Decoding and field-by-field validation of wire messages (types in ``protocols.wire``).

``decode(bytes) -> Message`` unpacks msgpack (never pickle) and checks every field; every check raises
``ProtocolError`` naming the field; nothing else escapes ``decode`` / ``check_message``.
"""

from __future__ import annotations

import gc
from typing import Any

import msgpack

from protocols.params import DTYPE_BYTES, Box
from protocols.recipe_check import check_recipe
from protocols.wire import (
    ALIGN_BYTES, ENTRY_KINDS, I63_MAX, MAX_BUCKET_ENTRIES, MAX_HEADER_BYTES, MAX_NAME_CHARS, MAX_PLAN_ENTRIES, MAX_NDIM, MAX_PEERS, MAX_SESSION_CHARS,
    MAX_TEXT_CHARS, SCHEMA_VERSION, U64_MAX, Abort, Ack, Begin, BucketHeader, Commit, Error, Message,
    PlanEntry, ProtocolError, SyncPlan, box_nbytes,
)


def short_repr(v: Any, limit: int = 64) -> str:
    """``repr`` of a scalar cut to ``limit`` chars; a container is named by its type and length only
    (a hostile, deeply nested value is never walked)."""
    if type(v) in (list, dict, tuple):
        return f"<{type(v).__name__} of {len(v)}>"
    text = repr(v)
    return text if len(text) <= limit else text[:limit] + "…"


def _int(v: Any, field: str, lo: int = 0, hi: int = I63_MAX) -> int:
    if type(v) is not int:
        raise ProtocolError(field, f"expected int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ProtocolError(field, f"{v} outside [{lo}, {hi}]")
    return v


def _str(v: Any, field: str, max_chars: int, allow_empty: bool = False) -> str:
    if type(v) is not str:
        raise ProtocolError(field, f"expected str, got {type(v).__name__}")
    if len(v) > max_chars or (not v and not allow_empty):
        raise ProtocolError(field, f"length {len(v)} outside [{0 if allow_empty else 1}, {max_chars}]")
    return v


def _list(v: Any, field: str, n: int | None = None) -> list:
    if type(v) is not list:
        raise ProtocolError(field, f"expected array, got {type(v).__name__}")
    if n is not None and len(v) != n:
        raise ProtocolError(field, f"expected {n} items, got {len(v)}")
    return v


def _shape_box(shape_raw: Any, box_raw: Any, field: str) -> tuple[tuple[int, ...], Box]:
    # fast path: plain type/bound checks; field names are formatted only on the failing item
    _list(shape_raw, f"{field}.shape")
    if len(shape_raw) > MAX_NDIM:
        raise ProtocolError(f"{field}.shape", f"{len(shape_raw)} dims > {MAX_NDIM}")
    for i, d in enumerate(shape_raw):
        if type(d) is not int or not 0 <= d <= I63_MAX:
            _int(d, f"{field}.shape[{i}]")
    shape = tuple(shape_raw)
    _list(box_raw, f"{field}.box", len(shape))
    box = []
    for i, pair in enumerate(box_raw):
        if type(pair) is not list or len(pair) != 2:
            _list(pair, f"{field}.box[{i}]", 2)
        start, stop = pair
        if type(start) is not int or type(stop) is not int or not 0 <= start <= stop <= shape[i]:
            _int(start, f"{field}.box[{i}].start", 0, shape[i])
            _int(stop, f"{field}.box[{i}].stop", start, shape[i])
        box.append((start, stop))
    return shape, tuple(box)


def check_entry(raw: Any, field: str) -> PlanEntry:
    items = _list(raw, field)
    kind = items[0] if items else None
    if type(kind) is not str or kind not in ENTRY_KINDS:
        raise ProtocolError(f"{field}.kind", f"unknown entry kind {short_repr(kind)}; known: {sorted(ENTRY_KINDS)}")
    if len(items) != (10 if kind == "recipe" else 9):
        raise ProtocolError(f"{field}.kind" if len(items) in (9, 10) else field,
                            f"a {kind!r} entry has {10 if kind == 'recipe' else 9} items, got {len(items)}")
    _, name, dtype, shape_raw, box_raw, sender, bucket, offset, nbytes = items[:9]
    name = _str(name, f"{field}.name", MAX_NAME_CHARS)
    if type(dtype) is not str or dtype not in DTYPE_BYTES:
        raise ProtocolError(f"{field}.dtype", f"unknown dtype {short_repr(dtype)}; known: {sorted(DTYPE_BYTES)}")
    shape, box = _shape_box(shape_raw, box_raw, field)
    offset = _int(offset, f"{field}.offset")
    if offset % ALIGN_BYTES:
        raise ProtocolError(f"{field}.offset", f"{offset} is not a multiple of {ALIGN_BYTES}")
    nbytes = _int(nbytes, f"{field}.nbytes")
    if nbytes != box_nbytes(box, dtype):
        raise ProtocolError(f"{field}.nbytes", f"{nbytes} != box {box} of {dtype} = {box_nbytes(box, dtype)}")
    recipe = None
    if kind == "recipe":
        recipe = check_recipe(items[9], f"{field}.recipe", name=name, dtype=dtype, shape=shape, box=box)
    return PlanEntry(name=name, dtype=dtype, shape=shape, box=box,
                     sender=_int(sender, f"{field}.sender", 0, MAX_PEERS - 1),
                     bucket=_int(bucket, f"{field}.bucket"), offset=offset, nbytes=nbytes, kind=kind, recipe=recipe)


def check_entries(raw: Any, field: str, capacity: int, max_entries: int) -> tuple[PlanEntry, ...]:
    """Entries of one bucket or plan (at most ``max_entries``); within a (sender, bucket) they are
    sorted and disjoint."""
    if len(_list(raw, field)) > max_entries:
        raise ProtocolError(field, f"{len(raw)} entries > the limit {max_entries}")
    entries = tuple(check_entry(e, f"{field}[{i}]") for i, e in enumerate(raw))
    end: dict[tuple[int, int], int] = {}
    keys: set[tuple[str, Box]] = set()
    for i, e in enumerate(entries):
        if e.offset + e.nbytes > capacity:
            raise ProtocolError(f"{field}[{i}].nbytes", f"ends at {e.offset + e.nbytes} > bucket capacity {capacity}")
        if e.offset < end.get((e.sender, e.bucket), 0):
            raise ProtocolError(f"{field}[{i}].offset", f"{e.offset} overlaps the previous entry of its bucket")
        end[(e.sender, e.bucket)] = e.offset + e.nbytes
        if e.key in keys:
            raise ProtocolError(f"{field}[{i}].name", f"{e.name!r} box {e.box} appears twice")
        keys.add(e.key)
    return entries


def _common(body: list, tag: str, n: int) -> list:
    _list(body, tag, n)
    _str(body[0], f"{tag}.session", MAX_SESSION_CHARS, allow_empty=tag in ("plan", "error"))
    _int(body[1], f"{tag}.version")
    return body


def _plan(b: list) -> SyncPlan:
    _common(b, "plan", 4)
    cap = _int(b[2], "plan.bucket_bytes", 1)
    return SyncPlan(session=b[0], version=b[1], bucket_bytes=cap, entries=check_entries(b[3], "plan.entries", cap, MAX_PLAN_ENTRIES))


def _bucket(b: list) -> BucketHeader:
    _common(b, "header", 8)
    sender = _int(b[2], "header.sender", 0, MAX_PEERS - 1)
    payload = _int(b[5], "header.payload_nbytes")
    entries = check_entries(b[4], "header.entries", payload, MAX_BUCKET_ENTRIES)
    for i, e in enumerate(entries):
        if e.sender != sender:
            raise ProtocolError(f"header.entries[{i}].sender", f"{e.sender} != header sender {sender}")
    if b[7] is not None and (type(b[7]) is not bytes or len(b[7]) != 32):
        raise ProtocolError("header.mac", "expected 32 bytes (HMAC-SHA256) or nil")
    return BucketHeader(session=b[0], version=b[1], sender=sender, seq=_int(b[3], "header.seq"),
                        entries=entries, payload_nbytes=payload, checksum=_int(b[6], "header.checksum", 0, U64_MAX),
                        mac=b[7])


def _begin(b: list) -> Begin:
    _common(b, "begin", 6)
    names = b[5]
    if names is not None:
        names = tuple(_str(n, f"begin.names[{i}]", MAX_NAME_CHARS) for i, n in enumerate(_list(names, "begin.names")))
    return Begin(session=b[0], version=b[1], sender=_int(b[2], "begin.sender", 0, MAX_PEERS - 1),
                 plan_digest=_int(b[3], "begin.plan_digest", 0, U64_MAX),
                 num_buckets=_int(b[4], "begin.num_buckets"), names=names)


def _commit(b: list) -> Commit:
    _common(b, "commit", 5)
    return Commit(session=b[0], version=b[1], sender=_int(b[2], "commit.sender", 0, MAX_PEERS - 1),
                  num_buckets=_int(b[3], "commit.num_buckets"), payload_bytes=_int(b[4], "commit.payload_bytes"))


def _abort(b: list) -> Abort:
    _common(b, "abort", 4)
    return Abort(session=b[0], version=b[1], sender=_int(b[2], "abort.sender", 0, MAX_PEERS - 1),
                 reason=_str(b[3], "abort.reason", MAX_TEXT_CHARS, allow_empty=True))


def _ack(b: list) -> Ack:
    _common(b, "ack", 5)
    return Ack(session=b[0], version=b[1], receiver=_int(b[2], "ack.receiver", 0, MAX_PEERS - 1),
               num_entries=_int(b[3], "ack.num_entries"), payload_bytes=_int(b[4], "ack.payload_bytes"))


def _error(b: list) -> Error:
    _common(b, "error", 5)
    return Error(session=b[0], version=b[1], receiver=_int(b[2], "error.receiver", 0, MAX_PEERS - 1),
                 field=_str(b[3], "error.field", MAX_NAME_CHARS, allow_empty=True),
                 message=_str(b[4], "error.message", MAX_TEXT_CHARS, allow_empty=True))


_CHECKS = {"plan": _plan, "bucket": _bucket, "begin": _begin, "commit": _commit, "abort": _abort,
           "ack": _ack, "error": _error}


def check_message(raw: Any) -> Message:
    if type(raw) is not list or len(raw) < 2:
        raise ProtocolError("message", "expected an array [schema_version, tag, ...]")
    if type(raw[0]) is not int or raw[0] != SCHEMA_VERSION:
        raise ProtocolError("schema_version", f"got {short_repr(raw[0])}, this build speaks {SCHEMA_VERSION}")
    check = _CHECKS.get(raw[1]) if type(raw[1]) is str else None
    if check is None:
        raise ProtocolError("tag", f"unknown message tag {short_repr(raw[1])}; known: {sorted(_CHECKS)}")
    return check(raw[2:])


# ----------------------------------------------------------------------------- decoding

def decode(data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_HEADER_BYTES) -> Message:
    """Decode and validate one message.

    Raises:
        ProtocolError: anything malformed; ``field`` names the first bad field.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("message", f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProtocolError("message", f"{len(data)} bytes exceeds the header limit {max_bytes}")
    # the cyclic GC would run over and over while msgpack and the checks build up to millions of small lists
    # (10× slower on a large plan); nothing decoded here can form a cycle
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        try:
            raw: Any = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
        except Exception as exc:  # msgpack raises several types (ExtraData, FormatError, ValueError, ...)
            raise ProtocolError("message", f"not valid msgpack: {type(exc).__name__}: {str(exc)[:200]}") from None
        try:
            return check_message(raw)
        except RecursionError:
            raise ProtocolError("message", "nested too deeply") from None
    finally:
        if gc_was_enabled:
            gc.enable()
