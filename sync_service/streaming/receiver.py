"""Receiver pipeline in a rollout engine: verify every bucket against the plan, apply, finish.

    receiver = BucketReceiver(adapter, plan, receiver=index, secret=None)
    stats = receiver.receive_sync(transport, timeout_s=60)            # begin → buckets → finish → ack
    adapter.commit(stats.version)       # the coordinator's call once every engine acked (two-phase)

``receive_sync(..., commit=True)`` commits right after the ack instead (single-engine setups).
Each bucket is checked (mac, session, version, sender, sequence number, entries == the planned
entries of that bucket, payload size, xxh3_64 checksum) before any entry of it is applied — except
for an engine that declares ``ChunkedApply``: there the checksum is checked on the apply thread, fused
with the copy into staging (``applier.apply_hashed``), and a mismatch aborts the sync before
``finish_update``, so nothing unverified is served. Entries
are dtype views into the transport's buffer, copied once by ``EngineAdapter.apply``; the buffer is
released to the transport only after the last copy, and no view outlives it. Applying runs on its
own thread (``ApplyStage``): while bucket k is applied, bucket k+1 is received and verified here,
as far as the transport lets a receiver hold two frames (``max_held``).

On any failure the adapter is aborted (nothing staged survives), an ``Error`` carrying the text
is replied to every sender, the rest of the sync is drained (so the channel is clean for the next
sync), and the error is raised.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from protocols.interfaces import ChunkedApply, EngineAdapter, PeerLostError, TransportReceiver
from protocols.wire import (
    Abort, Ack, Begin, BucketHeader, Commit, Error, PlanEntry, ProtocolError, SyncPlan, encode, plan_digest, verify_mac,
)
from protocols.wire_check import decode
from sync_service.streaming.applier import ApplyStage
from sync_service.streaming.checksum import checksum
from sync_service.streaming.plan import buckets_of, senders, subset_plan


class SyncAbortedError(RuntimeError):
    """A sender aborted the sync (its reason is the message); nothing was committed."""

    def __init__(self, sender: int, message: str):
        super().__init__(message)
        self.sender, self.message = sender, message

    def __reduce__(self):
        return (type(self), (self.sender, self.message))


@dataclass(slots=True)
class ApplyStats:
    """One received sync: sizes and where the time went (seconds)."""

    session: str
    version: int
    buckets: int
    entries: int
    payload_bytes: int
    wait_s: float     # blocked in Transport.recv
    verify_s: float   # header checks + checksums (checksums: in apply_s for a ChunkedApply engine)
    apply_s: float    # EngineAdapter.apply copies (apply thread; overlaps wait and verify)
    finish_s: float   # EngineAdapter.finish_update
    total_s: float
    timeline: list = field(default_factory=list)
    """``(stage, seq, start, end)`` per bucket, ``time.perf_counter()`` seconds (CLOCK_MONOTONIC,
    comparable across processes of one host); stages ``recv``, ``verify`` (calling thread), ``apply``."""
    modules: int = 0
    """Engine modules whose post-load processing ran (``FinishReport.modules`` of the adapter's finish)."""
    update_id: str = ""
    """The engine's update token (``begin_update``'s answer): ``commit`` / ``abort`` act with it."""


class _SyncState:
    """Bookkeeping of one sync in progress: which sender is at which bucket."""

    def __init__(self, plan: SyncPlan, begin: Begin):
        self.session, self.version, self.names = begin.session, begin.version, begin.names
        self.staged = False  # the engine's begin_update accepted this sync
        self.update_id: str | None = None  # its token (None from an adapter that hands out none)
        self.plan = subset_plan(plan, None if begin.names is None else frozenset(begin.names))
        self.digest = plan_digest(self.plan)
        self.expected = {s: buckets_of(self.plan, s) for s in senders(plan)}
        self.begun: set[int] = set()
        self.next_seq = {s: 0 for s in self.expected}
        self.done: set[int] = set()

    def check_begin(self, b: Begin) -> None:
        if (b.session, b.version) != (self.session, self.version):
            raise ProtocolError("begin.session", f"sync {b.session}/v{b.version} while {self.session}/v{self.version} runs")
        if b.sender not in self.expected:
            raise ProtocolError("begin.sender", f"sender {b.sender} is not in the plan (senders {sorted(self.expected)})")
        if b.sender in self.begun:
            raise ProtocolError("begin.sender", f"sender {b.sender} began twice")
        if b.names != self.names or b.plan_digest != self.digest:
            raise ProtocolError("begin.plan_digest", "sender and receiver disagree on the plan; rebuild both from one plan")
        if b.num_buckets != len(self.expected[b.sender]):
            raise ProtocolError("begin.num_buckets", f"{b.num_buckets} != planned {len(self.expected[b.sender])}")
        self.begun.add(b.sender)

    def check_bucket(self, h: BucketHeader, payload, *, hash_payload: bool = True) -> tuple[PlanEntry, ...]:
        if (h.session, h.version) != (self.session, self.version):
            raise ProtocolError("header.session", f"bucket of {h.session}/v{h.version} in sync {self.session}/v{self.version}")
        if h.sender not in self.begun or h.sender in self.done:
            raise ProtocolError("header.sender", f"bucket from sender {h.sender} outside its begin..commit")
        want = self.next_seq[h.sender]
        if h.seq != want:
            kind = "duplicate" if h.seq < want else "out-of-order (missing buckets)"
            raise ProtocolError("header.seq", f"{kind} sequence number {h.seq} from sender {h.sender}, expected {want}")
        if want >= len(self.expected[h.sender]) or h.entries != self.expected[h.sender][want]:
            raise ProtocolError("header.entries", f"bucket {want} of sender {h.sender} does not match the plan")
        size = 0 if payload is None else len(payload)
        if size != h.payload_nbytes:
            raise ProtocolError("header.payload_nbytes", f"payload has {size} bytes, header says {h.payload_nbytes} (truncated?)")
        if hash_payload and checksum(payload) != h.checksum:
            raise ProtocolError("header.checksum", f"xxh3_64 mismatch on bucket {h.seq} of sender {h.sender}: payload corrupted")
        self.next_seq[h.sender] = want + 1
        return h.entries

    def check_commit(self, c: Commit) -> None:
        if (c.session, c.version) != (self.session, self.version) or c.sender not in self.begun:
            raise ProtocolError("commit.session", f"commit of {c.session}/v{c.version} sender {c.sender} unexpected")
        if c.num_buckets != self.next_seq[c.sender]:
            raise ProtocolError("commit.num_buckets", f"sender {c.sender} committed {c.num_buckets} buckets, {self.next_seq[c.sender]} arrived")
        self.done.add(c.sender)

    @property
    def complete(self) -> bool:
        return len(self.done) == len(self.expected)


class BucketReceiver:
    """Applies syncs of ``plan`` (all senders) to one engine.

    Args:
        adapter: the engine (``EngineAdapter``).
        plan: the full plan (``combine_plans`` of every sender's), identical to the senders'.
        receiver: this receiver's index (named in its Ack/Error).
        secret: per-session HMAC key; when set, every header must carry a valid mac.
    """

    def __init__(self, adapter: EngineAdapter, plan: SyncPlan, *, receiver: int = 0, secret: bytes | None = None):
        self.adapter, self.plan, self.receiver, self.secret = adapter, plan, receiver, secret
        # > 0: checksums are checked while applying, in pieces of this many bytes (ChunkedApply)
        self._chunk_bytes = adapter.apply_chunk_bytes if isinstance(adapter, ChunkedApply) else 0
        self._starting: _SyncState | None = None
        self._reset_versions = False
        self._hash = True

    def receive_sync(self, transport: TransportReceiver, *, timeout_s: float = 60.0, commit: bool = False,
                     reset_versions: bool = False) -> ApplyStats:
        """Receive one whole sync: begin → apply per bucket → finish → Ack (→ commit if asked).

        ``reset_versions``: begin the engine's update with ``reset_versions`` (a version at or below the
        served one is taken; ``engines.commit_gate``). Blocks up to ``timeout_s`` in all. Raises
        ProtocolError (bad/corrupt/out-of-order data), SyncAbortedError (a sender aborted), TimeoutError,
        PeerLostError, or the adapter's error (a refused ``begin_update``: another sync's update is staged,
        or the version is fenced); in every case this sync's own update was aborted (never another's:
        the abort carries its token) and the senders were told (where reachable).
        """
        self._reset_versions = reset_versions
        # cuda_ipc on a GPU sends no payload hash (transports/cuda_ipc.py): its header (MAC, entries, sizes) is checked
        self._hash = bool(getattr(transport, "hashes_payload", True))
        t0 = time.perf_counter()
        end = time.monotonic() + timeout_s
        st: _SyncState | None = None
        stats = ApplyStats("", 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0)
        stage = ApplyStage(self.adapter, transport, max(1, int(getattr(transport, "max_held", 1))), stats.timeline)
        try:
            while st is None or not st.complete:
                stage.hold(_left(end, timeout_s))
                tw = time.perf_counter()
                header, payload = transport.recv(_left(end, timeout_s))
                stats.wait_s += time.perf_counter() - tw
                stats.timeline.append(("recv", -1, tw, time.perf_counter()))
                bucket = None
                try:
                    st, bucket = self._on_frame(st, header, payload, stats)
                finally:  # every received frame goes through the stage: released in arrival order
                    stage.put(bucket, None if bucket is None else payload, chunk_bytes=self._chunk_bytes if self._hash else 0)
                    payload = None
            stage.wait_idle(_left(end, timeout_s))
            stats.apply_s, stats.buckets, stats.entries, stats.payload_bytes = (
                stage.apply_s, stage.buckets, stage.entries, stage.payload_bytes)
            tf = time.perf_counter()
            stats.modules = self.adapter.finish_update().modules
            stats.finish_s = time.perf_counter() - tf
            transport.reply(encode(Ack(session=st.session, version=st.version, receiver=self.receiver,
                                       num_entries=stats.entries, payload_bytes=stats.payload_bytes)), _left(end, timeout_s))
        except BaseException as exc:
            stage.close()  # no apply runs past this point; queued frames are released unapplied
            self._fail(transport, st or self._starting, exc, end)
            raise
        finally:
            stage.close()
            self._starting = None
        if commit:
            self.adapter.commit(*(st.version,) if st.update_id is None else (st.version, st.update_id))
        stats.session, stats.version, stats.total_s = st.session, st.version, time.perf_counter() - t0
        stats.update_id = st.update_id or ""
        return stats

    def _on_frame(self, st: _SyncState | None, header: bytes, payload,
                  stats: ApplyStats) -> tuple[_SyncState, BucketHeader | None]:
        """Decode and check one frame; returns the state and, for a bucket, its verified header
        (the caller queues it for applying)."""
        tv = time.perf_counter()
        msg = decode(header)
        if isinstance(msg, Begin):
            if st is None:
                st = self._starting = _SyncState(self.plan, msg)
                st.check_begin(msg)
                names = list(dict.fromkeys(e.name for e in st.plan.entries))
                if self._reset_versions:
                    st.update_id = self.adapter.begin_update(msg.version, names, reset_versions=True)
                else:
                    st.update_id = self.adapter.begin_update(msg.version, names)
                st.staged = True
            else:
                st.check_begin(msg)
            return st, None
        if isinstance(msg, Abort):
            if st is None or (msg.session, msg.version) != (st.session, st.version):
                return st, None  # a late abort of an earlier, already failed sync
            raise SyncAbortedError(msg.sender, f"sender {msg.sender} aborted sync {msg.session}/v{msg.version}: {msg.reason}")
        if st is None:
            raise ProtocolError("message", f"{type(msg).__name__} before any begin")
        if isinstance(msg, Commit):
            st.check_commit(msg)
            return st, None
        if not isinstance(msg, BucketHeader):
            raise ProtocolError("message", f"unexpected {type(msg).__name__} on the data channel")
        verify_mac(msg, self.secret)
        st.check_bucket(msg, payload, hash_payload=self._chunk_bytes <= 0 and self._hash)
        stats.verify_s += time.perf_counter() - tv
        stats.timeline.append(("verify", msg.seq, tv, time.perf_counter()))
        return st, msg

    def _fail(self, transport: TransportReceiver, st: _SyncState | None, exc: BaseException, end: float) -> None:
        if st is not None and st.staged:  # only this sync's own update (a refused begin staged nothing)
            try:
                self.adapter.abort(*() if st.update_id is None else (st.update_id,))
            except Exception:
                pass  # the original error is what the caller needs
        if isinstance(exc, (TimeoutError, PeerLostError)):
            return
        session, version = (st.session, st.version) if st else ("", 0)
        field = exc.field if isinstance(exc, ProtocolError) else type(exc).__name__
        try:
            transport.reply(encode(Error(session=session, version=version, receiver=self.receiver, field=field[:1000],
                                         message=str(exc)[:8000])), 5.0)
            finished = {exc.sender} if isinstance(exc, SyncAbortedError) else set()
            _drain(transport, self.plan, st, finished, end)
        except Exception:
            pass  # channel unusable: the sender times out or sees the peer gone


def _left(end: float, timeout_s: float) -> float:
    left = end - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"sync not complete within {timeout_s:.1f}s")
    return left


def _drain(transport: TransportReceiver, plan: SyncPlan, st: _SyncState | None, finished: set[int], end: float,
           grace_s: float = 10.0) -> None:
    """Discard frames until every sender of the plan not yet done commits or aborts, so the
    channel is in step for the next sync (senders abort on seeing our Error)."""
    pending = set(senders(plan)) - (st.done if st else set()) - finished
    stop = min(end, time.monotonic() + grace_s)
    while pending:
        left = stop - time.monotonic()
        if left <= 0:
            return
        header, _ = transport.recv(left)
        transport.release()
        try:
            msg = decode(header)
        except ProtocolError:
            continue
        if isinstance(msg, (Commit, Abort)):
            pending.discard(msg.sender)
