"""The receiver's apply stage on its own thread, so bucket k+1 is verified while bucket k is applied.

``BucketReceiver`` verifies every frame on the calling thread and hands it here in arrival order:
a verified bucket (entries + payload) is applied, a control frame only released. Frames are
released to the transport strictly in arrival order (the transport frees the oldest held frame),
each after its last copy, so no view outlives its buffer. At most ``transport.max_held`` frames
are held at once (``slots`` acquired before each ``recv``).
"""

from __future__ import annotations

import queue
import threading
import time

from protocols.interfaces import EngineAdapter, TransportReceiver
from protocols.wire import PlanEntry
from sync_service.streaming.views import as_byte_tensor, entry_view


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

    def put(self, entries: tuple[PlanEntry, ...] | None, payload, seq: int, nbytes: int) -> None:
        """Queue the frame just received: apply ``entries`` from ``payload`` (None: release only)."""
        with self._idle:
            self._pending += 1
        self._q.put((entries, payload, seq, nbytes))

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
        while (item := self._q.get()) is not None:
            entries, payload, seq, nbytes = item
            try:
                if entries and self.failure is None and not self._dropping:
                    t = time.perf_counter()
                    buf = as_byte_tensor(payload)
                    for e in entries:
                        self.adapter.apply(e.name, e.box, entry_view(buf, e))
                    del buf
                    t1 = time.perf_counter()
                    self.apply_s += t1 - t
                    self.buckets, self.entries, self.payload_bytes = self.buckets + 1, self.entries + len(entries), self.payload_bytes + nbytes
                    self.timeline.append(("apply", seq, t, t1))
            except BaseException as exc:
                self.failure = exc
            finally:
                payload = item = None
                self.transport.release()
                self.slots.release()
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
