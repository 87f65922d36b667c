"""Wire messages of a weight sync: explicit frozen dataclasses, encoded with msgpack (never pickle).

One sync of one sender (a trainer shard) to its receivers (rollout engines):

    Begin → BucketHeader + payload × n → Commit        (sender → receivers)
    Ack | Error                                          (receiver → senders, once per sync)
    Abort                                                (sender → receivers, instead of Commit)

A ``SyncPlan`` (built once, reused every sync; shipped to every process out of band) lists each
``PlanEntry``: which sender sends which box of which tensor, in which bucket, at which byte offset.
A ``BucketHeader`` repeats the entries of its bucket; the receiver checks every one against the
plan before a byte is applied.

Encoding: ``msgpack([SCHEMA_VERSION, tag, *fields])``. ``protocols.wire_check.decode`` validates every field (type,
bounds, sizes, cross-field consistency) and raises ``ProtocolError`` naming the field; it never
raises anything else, whatever the input (fuzzed in tests/streaming/test_wire_fuzz.py).

Integrity: the payload checksum is xxh3_64 (https://xxhash.com) of the payload bytes. With a
per-session secret, ``BucketHeader.mac`` is HMAC-SHA256 (RFC 2104, stdlib ``hmac``) over the
canonical msgpack encoding of the header without its mac (that encoding includes the checksum).
"""

from __future__ import annotations

import hashlib
import hmac
import math
from dataclasses import dataclass, replace
from typing import Any

import msgpack

from protocols.params import DTYPE_BYTES, Box
from protocols.recipe import Recipe, recipe_list

SCHEMA_VERSION = 1
MAX_HEADER_BYTES = 8 << 20
"""Largest encoded message accepted by ``decode`` (bytes); a plan of ~40k entries fits."""
MAX_NAME_CHARS = 1024
MAX_SESSION_CHARS = 128
MAX_TEXT_CHARS = 16384
MAX_NDIM = 8
"""Most dims of a tensor on the wire (weights have at most 3)."""
MAX_PLAN_ENTRIES = 1 << 16
"""Most entries of a ``SyncPlan`` (decoding one of this size takes well under a second)."""
MAX_BUCKET_ENTRIES = 1 << 15
"""Most entries of one ``BucketHeader`` (1 MiB of 32 B entries; a bucket entry starts on a 64 B boundary)."""
MAX_PEERS = 1 << 16
U64_MAX = (1 << 64) - 1
I63_MAX = (1 << 63) - 1
ENTRY_KINDS = frozenset({"tensor", "recipe"})
"""Known entry kinds: ``"tensor"`` (raw values of a box) and ``"recipe"`` (the LoRA factors of one
term block, merged on the receiver; see ``protocols.recipe``)."""
ALIGN_BYTES = 64
"""Every entry starts at a multiple of this offset in its bucket (any dtype view is aligned)."""


class ProtocolError(ValueError):
    """A received message or plan is malformed or inconsistent; nothing from it was applied.

    Attributes:
        field: dotted name of the offending field (``"header.entries[3].nbytes"``).
    """

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message

    def __reduce__(self):  # picklable across Ray / multiprocessing despite the two-argument init
        return (type(self), (self.field, self.message))


@dataclass(frozen=True, slots=True)
class PlanEntry:
    """One box of one tensor in one bucket of one sender.

    Attributes:
        name: tensor name in the engine's naming.
        dtype: wire dtype name (a ``protocols.params.DTYPE_BYTES`` key).
        shape: shape of the whole tensor, in elements.
        box: the part carried, ``(start, stop)`` per dim; its bytes are row-major and contiguous.
        sender: index of the sender (trainer shard) that sends it.
        bucket: bucket index within that sender's stream of this plan (= sequence number).
        offset: byte offset in the bucket payload, a multiple of ``ALIGN_BYTES``.
        nbytes: ``box numel * dtype size``.
        kind: ``"tensor"`` (raw values) or ``"recipe"`` (LoRA factors, see ``protocols.recipe``:
            ``name`` is the recipe's entry name, ``shape``/``box`` the flat factor elements).
        recipe: the merge recipe of a ``"recipe"`` entry, ``None`` for a tensor.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    box: Box
    sender: int
    bucket: int
    offset: int
    nbytes: int
    kind: str = "tensor"
    recipe: Recipe | None = None

    @property
    def key(self) -> tuple[str, Box]:
        return (self.name, self.box)


@dataclass(frozen=True, slots=True)
class SyncPlan:
    """Every entry of a sync, ordered by (sender, bucket, offset).

    Attributes:
        bucket_bytes: capacity of one bucket payload, bytes.
        entries: the entries; a ``(name, box)`` pair appears once.
        session: sync session id (empty in a template plan reused across syncs).
        version: weight version (0 in a template plan).
    """

    bucket_bytes: int
    entries: tuple[PlanEntry, ...]
    session: str = ""
    version: int = 0


@dataclass(frozen=True, slots=True)
class BucketHeader:
    """Describes one sealed bucket payload.

    Attributes:
        session, version: the sync this bucket belongs to.
        sender: sender index; ``seq`` counts that sender's buckets in this sync from 0.
        entries: the plan entries packed in this bucket, by offset.
        payload_nbytes: bytes of payload that follow (≤ the plan's ``bucket_bytes``).
        checksum: xxh3_64 of the payload bytes.
        mac: HMAC-SHA256 of the header without mac, when the session has a secret.
    """

    session: str
    version: int
    sender: int
    seq: int
    entries: tuple[PlanEntry, ...]
    payload_nbytes: int
    checksum: int
    mac: bytes | None = None


@dataclass(frozen=True, slots=True)
class Begin:
    """A sender starts a sync. ``names`` is the delta set (``None``: every planned name);
    ``plan_digest`` is ``plan_digest()`` of the sub-plan both sides derive from it."""

    session: str
    version: int
    sender: int
    plan_digest: int
    num_buckets: int
    names: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class Commit:
    """A sender sent all its buckets of the sync (the receivers commit once every sender has)."""

    session: str
    version: int
    sender: int
    num_buckets: int
    payload_bytes: int


@dataclass(frozen=True, slots=True)
class Abort:
    """A sender gives up the sync; receivers drop everything staged for it."""

    session: str
    version: int
    sender: int
    reason: str


@dataclass(frozen=True, slots=True)
class Ack:
    """A receiver applied and finished the whole sync (every sender's entries)."""

    session: str
    version: int
    receiver: int
    num_entries: int
    payload_bytes: int


@dataclass(frozen=True, slots=True)
class Error:
    """A receiver failed the sync; ``message`` is its error text, ``field`` the culprit if known."""

    session: str
    version: int
    receiver: int
    field: str
    message: str


Message = SyncPlan | BucketHeader | Begin | Commit | Abort | Ack | Error


# ----------------------------------------------------------------------------- encoding

def _entry_list(e: PlanEntry) -> list:
    body = [e.kind, e.name, e.dtype, list(e.shape), [list(b) for b in e.box], e.sender, e.bucket,
            e.offset, e.nbytes]
    return body if e.recipe is None else body + [recipe_list(e.recipe)]


def _header_body(h: BucketHeader) -> list:
    return [h.session, h.version, h.sender, h.seq, [_entry_list(e) for e in h.entries],
            h.payload_nbytes, h.checksum]


_FIELDS: dict[type, tuple[str, ...]] = {
    Begin: ("session", "version", "sender", "plan_digest", "num_buckets", "names"),
    Commit: ("session", "version", "sender", "num_buckets", "payload_bytes"),
    Abort: ("session", "version", "sender", "reason"),
    Ack: ("session", "version", "receiver", "num_entries", "payload_bytes"),
    Error: ("session", "version", "receiver", "field", "message"),
}
_TAGS: dict[type, str] = {SyncPlan: "plan", BucketHeader: "bucket", Begin: "begin", Commit: "commit",
                          Abort: "abort", Ack: "ack", Error: "error"}


def encode(msg: Message) -> bytes:
    """Encode a message as msgpack bytes (see the module docstring for the layout)."""
    tag = _TAGS[type(msg)]
    if isinstance(msg, SyncPlan):
        body = [msg.session, msg.version, msg.bucket_bytes, [_entry_list(e) for e in msg.entries]]
    elif isinstance(msg, BucketHeader):
        body = _header_body(msg) + [msg.mac]
    else:
        body = [getattr(msg, f) for f in _FIELDS[type(msg)]]
        if isinstance(msg, Begin) and msg.names is not None:
            body[-1] = list(msg.names)
    return msgpack.packb([SCHEMA_VERSION, tag, *body], use_bin_type=True)


def header_mac(header: BucketHeader, secret: bytes) -> bytes:
    """HMAC-SHA256 over the canonical encoding of ``header`` without its mac (checksum included)."""
    body = msgpack.packb(_header_body(header), use_bin_type=True)
    return hmac.new(secret, body, hashlib.sha256).digest()


def seal(header: BucketHeader, secret: bytes | None) -> BucketHeader:
    """``header`` with its mac set when ``secret`` is given."""
    return header if secret is None else replace(header, mac=header_mac(header, secret))


def verify_mac(header: BucketHeader, secret: bytes | None) -> None:
    """Raises ProtocolError("header.mac") unless the mac matches (no-op without a secret)."""
    if secret is None:
        return
    if header.mac is None or not hmac.compare_digest(header.mac, header_mac(header, secret)):
        raise ProtocolError("header.mac", "missing or wrong HMAC: the header was altered or the "
                            "sender holds another session secret")


def plan_digest(plan: SyncPlan) -> int:
    """xxh3_64 of the plan's entries and bucket size (session and version excluded)."""
    import xxhash

    body = msgpack.packb([plan.bucket_bytes, [_entry_list(e) for e in plan.entries]], use_bin_type=True)
    return xxhash.xxh3_64_intdigest(body)


def box_nbytes(box: Box, dtype: str) -> int:
    return math.prod(stop - start for start, stop in box) * DTYPE_BYTES[dtype]
