"""The receiver's apply stage on its own thread, so bucket k+1 is verified while bucket k is applied.

``BucketReceiver`` verifies every frame on the calling thread and hands it here in arrival order:
a verified bucket (entries + payload) is applied, a control frame only released. Frames are
released to the transport strictly in arrival order (the transport frees the oldest held frame),
each after its last copy, so no view outlives its buffer. At most ``transport.max_held`` frames
are held at once (``slots`` acquired before each ``recv``).

For an engine that declares ``ChunkedApply`` the bucket's xxh3_64 is checked here, fused with the copy:
``apply_hashed`` hands each entry to ``apply`` in cache-sized pieces and hashes each piece's bytes
right after its copy (they are still in cache), so the payload is read from memory once, not twice;
a mismatch fails the stage (``ProtocolError`` on ``header.checksum``) before ``finish_update``. Behind the
served check (an adapter offering ``apply_landed``: ``engines.served_check.AppliedDigests``) the bytes hashed are
the piece's as they landed in the engine's staging, so the same one pass proves the applied bytes equal the
trainers'; on a mismatch the payload is hashed once more: intact, the engine's copy is at fault and the adapter
names the boxes (``landed_mismatch``) for the check's vote; else it is the transport's ``ProtocolError``.
"""

from __future__ import annotations

import queue
import threading
import time

from protocols.interfaces import EngineAdapter, TransportReceiver
from protocols.wire import BucketHeader, PlanEntry, ProtocolError
from sync_service.dtypes import TORCH_DTYPES
from sync_service.merge.staging import chunks
from sync_service.streaming.checksum import RunningChecksum, checksum
from sync_service.streaming.views import as_byte_array, as_byte_tensor, entry_view


def apply_hashed(adapter: EngineAdapter, payload, entries: tuple[PlanEntry, ...], chunk_bytes: int,
                 running: RunningChecksum) -> int:
    """Apply ``entries`` from ``payload`` in row-major pieces of at most ``chunk_bytes`` and return the
    xxh3_64 of the whole payload (equal to ``checksum(payload)``), each piece hashed right after its copy.

    ``entries`` lie in ``payload`` in offset order, disjoint (the plan's layout); the bytes between and
    after them (alignment padding) are hashed too. Blocks; raises what ``adapter.apply`` raises.
    """
    buf = as_byte_tensor(payload)
    arr = buf if buf.device.type != "cpu" else as_byte_array(payload)  # device bytes: hashed via host memory
    landed = getattr(adapter, "apply_landed", None)  # the served check: hash the bytes where they landed
    running.reset()
    hashed = 0
    for entry in sorted(entries, key=lambda e: e.offset):
        view = entry_view(buf, entry)
        itemsize = TORCH_DTYPES[entry.dtype].itemsize
        for sub in chunks(entry.box, chunk_bytes, itemsize):
            piece = view[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(sub, entry.box))]
            end = entry.offset + (piece.data_ptr() - view.data_ptr()) + piece.nbytes
            if landed is None:
                adapter.apply(entry.name, sub, piece)
                running.update(arr[hashed:end])
            else:
                if end - piece.nbytes > hashed:
                    running.update(arr[hashed:end - piece.nbytes])  # padding before the piece
                running.update(landed(entry.name, sub, piece))
            hashed = end
    running.update(arr[hashed:])
    return running.intdigest()


class ApplyStage:
    """Applies queued buckets in order on a daemon thread; errors surface on the caller's thread.

    Args:
        adapter: the engine; only this thread calls ``apply`` while the stage runs.
        transport: released once per queued frame, in order.
        max_held: frames the transport lets a caller hold (>= 2 to overlap anything).
        timeline: list that receives ``("apply", seq, start, end)`` per bucket (perf_counter s).
    """

    def __init__(self, adapter: EngineAdapter, transport: TransportReceiver, max_held: int, timeline: list):
        self.adapter, self.transport, self.timeline = adapter, transport, timeline
        self.slots = threading.Semaphore(max_held)
        self.apply_s, self.buckets, self.entries, self.payload_bytes = 0.0, 0, 0, 0
        self.failure: BaseException | None = None
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._dropping = False
        self._thread = threading.Thread(target=self._run, name="weightsync-apply", daemon=True)
        self._thread.start()

    def hold(self, timeout_s: float) -> None:
        """Wait until one more frame may be received (the stage released an older one).
        Raises the stage's failure, or TimeoutError."""
        end = time.monotonic() + timeout_s
        while not self.slots.acquire(timeout=0.05):
            self.raise_failure()
            if time.monotonic() >= end:
                raise TimeoutError(f"apply stage did not release a buffer within {timeout_s:.1f}s")
        self.raise_failure()

    def put(self, header: BucketHeader | None, payload, *, chunk_bytes: int = 0) -> None:
        """Queue the frame just received: apply the bucket ``header`` describes from ``payload``
        (None: release only). ``chunk_bytes`` > 0: the payload's checksum is still unchecked; apply
        in pieces of that size and check it on the way (``apply_hashed``). An adapter with ``received``
        (the served check: ``engines.served_check.AppliedDigests``) reads the bucket here first, on this thread."""
        received = getattr(self.adapter, "received", None) if header is not None and payload is not None else None
        if received is not None and self.failure is None:
            try:
                received(header.entries, payload)
            except Exception as exc:  # noqa: BLE001 - the sync fails with it; the frame is still queued and released
                self.failure = exc
        with self._idle:
            self._pending += 1
        self._q.put((header, payload, chunk_bytes))

    def wait_idle(self, timeout_s: float) -> None:
        """Block until every queued frame is applied and released. Raises the stage's failure or TimeoutError."""
        end = time.monotonic() + timeout_s
        with self._idle:
            while self._pending and self.failure is None:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"apply stage still busy after {timeout_s:.1f}s")
                self._idle.wait(min(left, 0.1))
        self.raise_failure()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop: frames still queued are released without applying; returns once the thread ended
        (so the caller may ``abort`` the adapter without a concurrent ``apply``)."""
        self._dropping = True
        self._q.put(None)
        self._thread.join(timeout_s)

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _run(self) -> None:
        running = RunningChecksum()
        while (item := self._q.get()) is not None:
            header, payload, chunk_bytes = item
            try:
                if header is not None and header.entries and self.failure is None and not self._dropping:
                    t = time.perf_counter()
                    self._apply(header, payload, chunk_bytes, running)
                    t1 = time.perf_counter()
                    self.apply_s += t1 - t
                    self.buckets, self.entries = self.buckets + 1, self.entries + len(header.entries)
                    self.payload_bytes += header.payload_nbytes
                    self.timeline.append(("apply", header.seq, t, t1))
            except BaseException as exc:
                self.failure = exc
            finally:
                payload = item = None
                self.transport.release()
                self.slots.release()
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _apply(self, header: BucketHeader, payload, chunk_bytes: int, running: RunningChecksum) -> None:
        if chunk_bytes <= 0:  # verified by the receiver before it was queued
            buf = as_byte_tensor(payload)
            for e in header.entries:
                self.adapter.apply(e.name, e.box, entry_view(buf, e))
            return
        if apply_hashed(self.adapter, payload, header.entries, chunk_bytes, running) != header.checksum:
            mismatch = getattr(self.adapter, "landed_mismatch", None)  # the landed bytes were hashed: whose fault?
            buf = as_byte_tensor(payload)
            if mismatch is not None and checksum(buf) == header.checksum:  # the engine's: the served check names it
                mismatch([(e.name, e.box, entry_view(buf, e)) for e in header.entries])
                return
            raise ProtocolError("header.checksum", f"xxh3_64 mismatch on bucket {header.seq} of sender "
                                                   f"{header.sender}: payload corrupted")
