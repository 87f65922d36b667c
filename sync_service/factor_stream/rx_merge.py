"""The receiver's merge workers: factor-mode targets merged on threads while the stream goes on.

``FactorEngine`` submits a target the moment the last of its pieces in a sync (pristine base boxes,
recipe blocks) has been applied, so the merge of layer k overlaps the transfer, checksum and apply
of layers k+1..; ``finish_update`` only waits for the tail. Each worker runs whole targets (the
merge core's own tiles, the same torch calls in the same order as on a trainer, so the values do
not depend on which thread ran them) and keeps one reusable output buffer (no allocation per box).

    pool = MergePool(threads=2, timeout_s=600)
    pool.submit(merge_one_target, ...)     # per ready target
    pool.wait()                            # finish_update: raises a worker's error or TimeoutError
    pool.cancel()                          # abort: pending targets dropped, running ones stop at a box
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

import torch

__all__ = ["MergePool", "busy_span_s"]


def busy_span_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds during which at least one of ``intervals`` (``(start, end)``, perf_counter s) ran."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class MergePool:
    """Worker threads for one receiver's merges, one sync at a time.

    Args:
        threads: worker threads (each merges one target at a time; >= 1).
        timeout_s: longest ``wait`` / ``cancel`` for the submitted merges, seconds.
    """

    def __init__(self, *, threads: int, timeout_s: float) -> None:
        if threads < 1:
            raise ValueError(f"merge threads={threads} must be >= 1")
        self.threads, self.timeout_s = threads, timeout_s
        self._executor: ThreadPoolExecutor | None = None
        self._futures: list[Future] = []
        self._intervals: list[tuple[float, float]] = []
        self._local = threading.local()
        self.cancelled = threading.Event()
        """Set by ``cancel``: a running merge stops before its next box."""

    def reset(self) -> None:
        """Start a sync: no merges submitted, none timed."""
        self._futures, self._intervals = [], []
        self.cancelled.clear()

    @property
    def submitted(self) -> int:
        return len(self._futures)

    def busy_s(self) -> float:
        """Wall seconds of this sync during which at least one worker merged."""
        return busy_span_s(list(self._intervals))

    def submit(self, fn: Callable[..., None], *args) -> None:
        """Run ``fn(*args)`` on a worker (timed); its exception surfaces in ``wait`` or ``failure``."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="weightsync-rx-merge")
        self._futures.append(self._executor.submit(self._timed, fn, *args))

    def failure(self) -> BaseException | None:
        """The first error of a finished merge of this sync, or ``None`` (does not block)."""
        return next((f.exception() for f in self._futures if f.done() and not f.cancelled() and f.exception()), None)

    def wait(self) -> None:
        """Block until every submitted merge ran. Raises the first merge's error, or TimeoutError
        after ``timeout_s`` (the merges still running are cancelled first)."""
        done, pending = wait(self._futures, timeout=self.timeout_s, return_when=FIRST_EXCEPTION)
        error = self.failure()
        if error is not None or pending:
            self.cancel()
            raise error or TimeoutError(f"receiver merge of {len(pending)} factor target(s) not done within "
                                        f"{self.timeout_s:.0f}s")

    def cancel(self) -> None:
        """Drop the merges not yet started and wait (bounded) for the running ones to stop, so nothing
        is applied after the caller aborts the engine."""
        self.cancelled.set()
        for f in self._futures:
            f.cancel()
        wait(self._futures, timeout=self.timeout_s)
        self._futures = []

    def out_buffer(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """This worker's reusable output tensor of ``shape``/``dtype`` (contents undefined; valid until
        the worker's next call). Grows to the largest box merged; one per worker thread."""
        nbytes = max(1, dtype.itemsize * int(torch.Size(shape).numel()))
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = self._local.buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes].view(dtype).view(shape)

    def close(self) -> None:
        """Stop the workers (after ``cancel``); idempotent."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def _timed(self, fn: Callable[..., None], *args) -> None:
        if self.cancelled.is_set():
            return
        t0 = time.perf_counter()
        try:
            fn(*args)
        finally:
            self._intervals.append((t0, time.perf_counter()))
