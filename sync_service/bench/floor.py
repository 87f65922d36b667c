"""The floor: the same bytes copied once across processes through reused shared memory.

A writer (this process) copies each bucket-sized chunk from a source buffer into one of two slots of
a ``/dev/shm`` mapping created once; a reader process copies the slot into its own, already touched
buffer and says so over a pipe (two chunks in flight). No checksum, no header, no merge: the least
any same-host sync of these bytes must spend (DESIGN.md: ~10-12 GB/s on a quiet machine).
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import time
import uuid

import numpy as np

__all__ = ["ShmFloor"]

_CTX = mp.get_context("spawn")


def _reader(path: str, slot_bytes: int, conn) -> None:
    fd = os.open(path, os.O_RDWR)
    mapping = mmap.mmap(fd, 2 * slot_bytes)
    os.close(fd)
    shared = np.frombuffer(mapping, dtype=np.uint8)
    own = np.ones(slot_bytes, dtype=np.uint8)
    conn.send(os.getpid())
    while (msg := conn.recv()) is not None:
        k, n = msg
        np.copyto(own[:n], shared[k * slot_bytes:k * slot_bytes + n])
        conn.send(k)
    del shared
    mapping.close()


class ShmFloor:
    """A reader process and a two-slot shared mapping of ``slot_bytes`` each, reused by every ``copy``.

    Use as a context manager (the reader exits and the mapping is unlinked on exit).
    """

    def __init__(self, slot_bytes: int, *, timeout_s: float = 300.0) -> None:
        self.slot_bytes, self.timeout_s = slot_bytes, timeout_s
        self.path = f"/dev/shm/wsbench-floor-{uuid.uuid4().hex[:8]}"
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 2 * slot_bytes)
        self._map = mmap.mmap(fd, 2 * slot_bytes)
        os.close(fd)
        self.shared = np.frombuffer(self._map, dtype=np.uint8)
        self.shared[:] = 0
        self.src = np.ones(slot_bytes, dtype=np.uint8)
        self.conn, child = _CTX.Pipe()
        self.proc = _CTX.Process(target=_reader, args=(self.path, slot_bytes, child), daemon=True)
        self.proc.start()
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"shm floor reader did not start within {timeout_s} s")
        self.reader_pid = self.conn.recv()

    def _ack(self) -> None:
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"shm floor reader did not ack within {self.timeout_s} s")
        self.conn.recv()

    def copy(self, total_bytes: int) -> float:
        """Move ``total_bytes`` through the slots; returns seconds (writer start → last reader ack)."""
        t0, sent, in_flight, k = time.perf_counter(), 0, 0, 0
        while sent < total_bytes:
            n = min(self.slot_bytes, total_bytes - sent)
            if in_flight == 2:
                self._ack()
                in_flight -= 1
            np.copyto(self.shared[k * self.slot_bytes:k * self.slot_bytes + n], self.src[:n])
            self.conn.send((k, n))
            sent, in_flight, k = sent + n, in_flight + 1, 1 - k
        for _ in range(in_flight):
            self._ack()
        return time.perf_counter() - t0

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
        del self.shared
        self._map.close()
        os.unlink(self.path)

    def __enter__(self) -> "ShmFloor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
