"""Sender pipeline on a trainer shard: fill buckets from a WeightSource, seal, stream, await acks.

    plan = build_plan(source.param_metas(), bucket_bytes=..., sender=rank)   # once
    sender = Sender(transport, BucketPool(bucket_bytes=plan.bucket_bytes), sender=rank)
    stats = sender.send_sync(session, version, source, plan, names=None, timeout_s=60)

The calling thread fills bucket k+1 (``WeightSource.fill`` writes straight into the bucket view)
and hashes each entry right after its fill, while it is still in cache, while a sender thread hands
bucket k to the transport. A transport that lends its own buffers (``reserve``: the shm ring) is
filled in place, so the bucket *is* the transport's slot and sending copies nothing. A sender whose merge runs
on another device than the transport's buckets (``stage_device``: CUDA parameters, host buckets) fills one
staging bucket there, allocated once, and copies each filled bucket into the transport's in one copy
(``pack_staged``). ``send_sync``
returns once every receiver acked the whole sync (applied + finished, not yet committed).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from protocols.interfaces import TransportSender, WeightSource
from protocols.wire import (
    Abort, Ack, Begin, BucketHeader, Commit, Error, PlanEntry, ProtocolError, SyncPlan, encode, plan_digest, seal,
)
from protocols.wire_check import decode
from sync_service.streaming.checksum import RunningChecksum
from sync_service.streaming.plan import buckets_of, subset_plan
from sync_service.streaming.pool import BucketPool
from sync_service.streaming.views import as_byte_tensor, entry_view


class RemoteSyncError(RuntimeError):
    """A receiver failed the sync; carries its error text. The sync was aborted everywhere."""

    def __init__(self, receiver: int, field: str, message: str):
        super().__init__(f"receiver {receiver} failed the sync ({field or 'error'}): {message}")
        self.receiver, self.field, self.message = receiver, field, message

    def __reduce__(self):
        return (type(self), (self.receiver, self.field, self.message))


@dataclass(slots=True)
class SendStats:
    """What one ``send_sync`` moved and where its time went (seconds, wall clock)."""

    session: str
    version: int
    buckets: int
    entries: int
    payload_bytes: int
    pack_s: float       # filling buckets + checksums (calling thread) = fill_s + checksum_s
    transfer_s: float   # inside Transport.send (sender thread; overlaps packing)
    ack_wait_s: float   # after the last send until every receiver acked
    total_s: float
    fill_s: float = 0.0        # WeightSource.fill into bucket views
    checksum_s: float = 0.0    # xxh3 of each entry right after its fill
    buffer_wait_s: float = 0.0  # waiting for a free bucket / ring slot (back-pressure)
    timeline: list = field(default_factory=list)
    """``(stage, seq, start, end)`` per bucket, ``time.perf_counter()`` seconds (CLOCK_MONOTONIC:
    comparable across processes of one host); stages ``pack`` (calling thread), ``send`` (sender thread)."""


def pack_bucket(source: WeightSource, entries: Sequence[PlanEntry], buf_u8: torch.Tensor) -> int:
    """Fill ``entries`` into the flat bucket ``buf_u8``; returns the payload size in bytes."""
    for e in entries:
        source.fill(e.name, e.box, entry_view(buf_u8, e))
    return entries[-1].offset + entries[-1].nbytes if entries else 0


def pack_and_hash(source: WeightSource, entries: Sequence[PlanEntry], arr: np.ndarray, digest: RunningChecksum,
                  times: list[float]) -> tuple[int, int]:
    """Fill ``entries`` into the flat uint8 bucket ``arr`` and hash each entry (with the alignment
    gap before it) right after its fill, while it is cache-hot. Returns ``(payload bytes, xxh3_64)``,
    equal to ``checksum(arr[:payload bytes])``; adds fill and hash seconds to ``times[0]``, ``times[1]``."""
    buf_u8, done = as_byte_tensor(arr), 0
    digest.reset()
    for e in entries:
        t0 = time.perf_counter()
        source.fill(e.name, e.box, entry_view(buf_u8, e))
        t1 = time.perf_counter()
        digest.update(arr[done:e.offset + e.nbytes])
        done = e.offset + e.nbytes
        times[0] += t1 - t0
        times[1] += time.perf_counter() - t1
    return done, digest.intdigest()


def pack_staged(source: WeightSource, entries: Sequence[PlanEntry], stage: torch.Tensor, arr, digest: RunningChecksum,
                times: list[float]) -> tuple[int, int]:
    """Fill ``entries`` into the staging bucket ``stage`` (1-D uint8 on the merge's device), copy the payload into
    the transport's bucket ``arr`` (numpy array or uint8 tensor, on another device) in one copy, then hash it.
    Returns ``(payload bytes, xxh3_64)`` as ``pack_and_hash``; adds fill (+ copy) and hash seconds to ``times[0]``,
    ``times[1]``. Blocks until the copy landed (a device-to-host copy synchronizes; the hash reads the bytes)."""
    t0 = time.perf_counter()
    nbytes = pack_bucket(source, entries, stage)
    as_byte_tensor(arr)[:nbytes].copy_(stage[:nbytes])
    t1 = time.perf_counter()
    digest.reset()
    digest.update(arr[:nbytes])
    times[0] += t1 - t0
    times[1] += time.perf_counter() - t1
    return nbytes, digest.intdigest()


class _Deadline:
    def __init__(self, timeout_s: float):
        self.timeout_s, self.end = timeout_s, time.monotonic() + timeout_s

    def left(self, what: str) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what}: sync timeout of {self.timeout_s:.1f}s exceeded")
        return left


class Sender:
    """Streams syncs of one sender (trainer shard ``sender``) over one transport.

    Args:
        transport: a ``TransportSender`` (``sync_service.transports.open_sender``).
        pool: reused bucket buffers; ``pool.bucket_bytes`` must equal the plan's.
        sender: this sender's index in the plan.
        secret: per-session HMAC key; headers carry a mac when set (receivers must hold it too).
        stage_device: where the source's ``fill`` writes when that is not where the transport's buckets live
            (``transports.devices.stage_device``): one staging bucket of ``pool.bucket_bytes`` there, allocated on
            the first sync and reused; ``None``: fill the transport's bucket in place.
    """

    def __init__(self, transport: TransportSender, pool: BucketPool, *, sender: int = 0, secret: bytes | None = None,
                 stage_device: torch.device | str | None = None):
        self.transport, self.pool, self.sender, self.secret = transport, pool, sender, secret
        self.stage_device = None if stage_device is None else torch.device(stage_device)
        self._stage: torch.Tensor | None = None

    @property
    def stage_bytes(self) -> int:
        """Bytes of the staging bucket on ``stage_device`` (0 before the first sync, or without one)."""
        return 0 if self._stage is None else self._stage.numel()

    def _pack(self, source: WeightSource, entries, arr, digest: RunningChecksum, times: list[float]) -> tuple[int, int]:
        if not getattr(self.transport, "hashes_payload", True):  # cuda_ipc on a GPU: header MAC only (its module doc)
            t0 = time.perf_counter()
            with self.transport.filling():
                nbytes = pack_bucket(source, entries, as_byte_tensor(arr))
            times[0] += time.perf_counter() - t0
            return nbytes, 0
        if self.stage_device is None:
            filling = getattr(self.transport, "filling", None)  # cuda_ipc: its side stream (a no-op on CPU)
            if filling is not None:
                with filling():
                    return pack_and_hash(source, entries, arr, digest, times)
            return pack_and_hash(source, entries, arr, digest, times)
        if self._stage is None:
            self._stage = torch.empty(self.pool.bucket_bytes, dtype=torch.uint8, device=self.stage_device)
        return pack_staged(source, entries, self._stage, arr, digest, times)

    def send_sync(self, session: str, version: int, source: WeightSource, plan: SyncPlan, *,
                  names: frozenset[str] | None = None, timeout_s: float = 60.0) -> SendStats:
        """Send this sender's part of ``plan`` (``names``: delta subset) for ``version``.

        Blocks until every receiver acked. Raises RemoteSyncError (a receiver's error text),
        TimeoutError, PeerLostError, or the source's own error; in every case receivers still inside the stream were told
        to abort (as far as reachable) and the next ``send_sync`` starts clean.
        """
        if plan.bucket_bytes != self.pool.bucket_bytes:
            raise ValueError(f"plan.bucket_bytes={plan.bucket_bytes} != pool bucket_bytes={self.pool.bucket_bytes}")
        t0 = time.perf_counter()
        deadline = _Deadline(timeout_s)
        sub = subset_plan(plan, None if names is None else frozenset(names))
        buckets = buckets_of(sub, self.sender)
        begin = Begin(session=session, version=version, sender=self.sender, plan_digest=plan_digest(sub),
                      num_buckets=len(buckets), names=None if names is None else tuple(sorted(names)))
        worker = _SendWorker(self.transport, self.pool, session, version, deadline)
        reserve = getattr(self.transport, "reserve", None)  # transport-lent buffers: fill in place
        times, payload_bytes, digest = [0.0, 0.0, 0.0], 0, RunningChecksum()
        held = None  # a pool buffer acquired but not yet queued: released if packing or queueing fails
        streamed = False
        try:
            if reserve is not None:  # sent before any slot is reserved (frames go out in reservation order)
                self.transport.send(encode(begin), None, deadline.left("sending begin"))
            else:
                worker.put(encode(begin), None, None)
            for seq, entries in enumerate(buckets):
                tw = time.perf_counter()
                index = held = None if reserve is not None else worker.acquire()
                arr = reserve(deadline.left("waiting for a free ring slot")) if index is None else self.pool.array(index)
                tp = time.perf_counter()
                times[2] += tp - tw
                nbytes, digest_value = self._pack(source, entries, arr, digest, times)
                header = seal(BucketHeader(session=session, version=version, sender=self.sender, seq=seq,
                                           entries=entries, payload_nbytes=nbytes, checksum=digest_value), self.secret)
                payload_bytes += nbytes
                worker.timeline.append(("pack", seq, tp, time.perf_counter()))
                worker.put(encode(header), index, arr[:nbytes], seq)
                held = None
            worker.put(encode(Commit(session=session, version=version, sender=self.sender,
                                     num_buckets=len(buckets), payload_bytes=payload_bytes)), None, None)
            worker.finish()
            streamed = True  # the stream ended (Commit sent): every receiver ends its stream without an Abort
            ta = time.perf_counter()
            self._await_acks(worker, deadline)
        except BaseException as exc:
            if held is not None:
                self.pool.release(held)
            worker.stop()
            if not streamed:  # after Commit an Abort frame would be a stale frame in the channel (torch_dist:
                self._abort(session, version, exc)  # a broadcast no receiver posts, so the group went out of step)
            raise
        return SendStats(session=session, version=version, buckets=len(buckets),
                         entries=sum(len(b) for b in buckets), payload_bytes=payload_bytes, pack_s=times[0] + times[1],
                         transfer_s=worker.transfer_s, ack_wait_s=time.perf_counter() - ta,
                         total_s=time.perf_counter() - t0, fill_s=times[0], checksum_s=times[1],
                         buffer_wait_s=times[2], timeline=sorted(worker.timeline, key=lambda x: x[2]))

    def _await_acks(self, worker: "_SendWorker", deadline: _Deadline) -> None:
        while len(worker.acked) < self.transport.num_receivers:
            worker.take_reply(self.transport.poll_reply(min(deadline.left(
                f"waiting for acks ({len(worker.acked)}/{self.transport.num_receivers})"), 0.5)))

    def _abort(self, session: str, version: int, exc: BaseException) -> None:
        if isinstance(exc, (TimeoutError, ConnectionError)) or type(exc).__name__ == "PeerLostError":
            return  # the channel is not usable; receivers time out or see the peer gone
        try:
            self.transport.send(encode(Abort(session=session, version=version, sender=self.sender,
                                             reason=f"{type(exc).__name__}: {exc}"[:4000])), None, 5.0)
        except Exception:
            pass  # best effort: the original error is what the caller needs


class _SendWorker:
    """The sender thread: hands queued frames to the transport, releases buffers, reads replies."""

    def __init__(self, transport: TransportSender, pool: BucketPool, session: str, version: int, deadline: _Deadline):
        self.transport, self.pool, self.deadline = transport, pool, deadline
        self.session, self.version = session, version
        self.acked: set[int] = set()
        self.failure: BaseException | None = None
        self.transfer_s = 0.0
        self.timeline: list[tuple[str, int, float, float]] = []
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weightsync-sender", daemon=True)
        self._thread.start()

    def put(self, header: bytes, index: int | None, payload: np.ndarray | None, seq: int = -1) -> None:
        """Queue a frame; ``index``: the pool buffer to release once sent (None: not a pool buffer)."""
        self._raise_failure()
        self._q.put((header, index, payload, seq))

    def acquire(self) -> int:
        while True:
            self._raise_failure()
            try:
                return self.pool.acquire(min(0.05, self.deadline.left("waiting for a free bucket")))
            except TimeoutError:
                continue

    def finish(self) -> None:
        self._q.put(None)
        while self._thread.is_alive():
            self._thread.join(min(0.1, self.deadline.left("sending")))
        self._raise_failure()

    def stop(self) -> None:
        self._stop.set()
        self._q.put(None)
        self._thread.join(10.0)

    def take_reply(self, raw: bytes | None) -> None:
        if raw is None:
            return
        msg = decode(raw)
        if not isinstance(msg, (Ack, Error)):
            raise ProtocolError("reply", f"expected an ack or error, got {type(msg).__name__}")
        if (msg.session, msg.version) != (self.session, self.version) and not (isinstance(msg, Error) and not msg.session):
            return  # a late reply to an earlier sync (an error without session: receiver failed at begin)
        if isinstance(msg, Error):
            raise RemoteSyncError(msg.receiver, msg.field, msg.message)
        self.acked.add(msg.receiver)

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None or self._stop.is_set():
                if item is not None and item[1] is not None:
                    self.pool.release(item[1])
                if item is None:
                    return
                continue
            header, index, payload, seq = item
            try:
                if self.failure is None:
                    t = time.perf_counter()
                    self.transport.send(header, payload, self.deadline.left("sending a bucket"))
                    t1 = time.perf_counter()
                    self.transfer_s += t1 - t
                    if payload is not None:
                        self.timeline.append(("send", seq, t, t1))
                    self.take_reply(self.transport.poll_reply(0.0))
            except BaseException as exc:
                self.failure = exc
            finally:
                payload = None
                if index is not None:
                    self.pool.release(index)
