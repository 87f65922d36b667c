"""Same-host shared-memory ring: one mapped /dev/shm file per sender, reused for every frame.

Layout of segment ``/dev/shm/weightsync-<name>-s<sender>`` (all counters little-endian u64):

    [0, 4096)                 global: magic, slots, slot_payload, header_cap, receivers, write_seq,
                              sender_pid, closed
    [4096 + r·REPLY, ...)     receiver r: read_seq, pid, reply_seq, reply_ack, reply_len, then the
                              reply bytes (one reply in flight per receiver)
    slots                     slot k: header_len, payload_len, header bytes, payload bytes

The sender writes frame ``n`` into slot ``n % slots`` once every receiver's ``read_seq`` passed
``n - slots``, then bumps ``write_seq``; a receiver reads it in place (zero copy), and bumps its
``read_seq`` on ``release``. Zero-copy sending: ``ShmSender.reserve`` hands out the payload area
of the next frame's slot, the caller fills it (the bucket *is* the slot) and ``send``s that view,
which publishes it without a copy. A receiver may hold up to ``slots`` frames unreleased
(``max_held``; ``release`` frees the oldest), so it can verify frame n+1 while applying frame n. Stores are ordered by x86-64's TSO (counters are written after data).
Peers' pids are checked while waiting: a dead peer fails within ~0.2 s.

No segment outlives its session. The name exists only while receivers attach: the last receiver to
map the segment unlinks it (mappings live on, the memory goes with the last process holding one).
The sender unlinks it on ``close``, when it is collected or the interpreter exits
(``weakref.finalize``), and ``connect_timeout_s`` + 1 s after creating it if a receiver never came
(a failed open). A sender killed before any of that (SIGKILL, ``ray.shutdown``) leaves a segment
whose header names a dead pid: every new ``ShmSender`` removes those first (``sweep_orphans``).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import weakref
from collections import deque

import numpy as np

from protocols.interfaces import PeerLostError, TransportError
from sync_service.transports.shm_files import OWNED, SEGMENT_PREFIX, SHM_DIR, STAGING, alive, reserve, unlink
from sync_service.transports.spec import TransportSpec

MAGIC = 0x5753484D52494E47  # "WSHMRING"
PAGE = 4096
REPLY = 64 << 10
_G_MAGIC, _G_SLOTS, _G_PAYLOAD, _G_HCAP, _G_RECV, _G_WSEQ, _G_PID, _G_CLOSED = range(8)
_R_READ, _R_PID, _R_RSEQ, _R_RACK, _R_RLEN = range(5)
_LIVENESS_S = 0.2


def _path(spec: TransportSpec, sender: int) -> str:
    return f"{SHM_DIR}/{SEGMENT_PREFIX}{spec.name}-s{sender}"


def segment_owner(path: str) -> int | None:
    """The pid of the sender that created the segment at ``path`` (``None``: not a ring segment
    or unreadable). A staging file (``<path>.init-<pid>``) or an owned one (``<path>.pid-<pid>``) names its
    creator in its name."""
    for marker in (STAGING, OWNED):
        head, sep, pid = path.rpartition(marker)
        if sep and pid.isdigit():
            return int(pid)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        head = os.pread(fd, 64, 0)
    finally:
        os.close(fd)
    g = np.frombuffer(head, dtype=np.uint64) if len(head) == 64 else None
    return int(g[_G_PID]) if g is not None and int(g[_G_MAGIC]) == MAGIC else None


def sweep_orphans() -> list[str]:
    """Unlink every segment in ``SHM_DIR`` whose creator died without removing it; returns their paths."""
    removed = []
    for entry in os.listdir(SHM_DIR):
        path = f"{SHM_DIR}/{entry}"
        if entry.startswith(SEGMENT_PREFIX) and (pid := segment_owner(path)) is not None and not alive(pid):
            unlink(path)
            removed.append(path)
    return removed


class _Segment:
    """Numpy views of one mapped segment."""

    def __init__(self, mm: mmap.mmap, spec: TransportSpec):
        self.mm = mm
        self.buf = np.frombuffer(mm, dtype=np.uint8)
        self.g = self.buf[:64].view(np.uint64)
        self.recv = [self.buf[PAGE + r * REPLY:PAGE + (r + 1) * REPLY] for r in range(spec.num_receivers)]
        self.rc = [b[:64].view(np.uint64) for b in self.recv]
        self.hcap, self.payload = spec.max_header_bytes, spec.bucket_bytes
        self.base = PAGE + spec.num_receivers * REPLY
        self.stride = -(-(64 + self.hcap + self.payload) // PAGE) * PAGE
        self.slots = spec.slots

    @staticmethod
    def size(spec: TransportSpec) -> int:
        stride = -(-(64 + spec.max_header_bytes + spec.bucket_bytes) // PAGE) * PAGE
        return PAGE + spec.num_receivers * REPLY + spec.slots * stride

    def slot(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        start = self.base + (n % self.slots) * self.stride
        lens = self.buf[start:start + 16].view(np.uint64)
        return lens, self.buf[start + 64:start + 64 + self.hcap], self.buf[start + 64 + self.hcap:start + 64 + self.hcap + self.payload]

    def close(self) -> None:
        self.g = self.rc = self.recv = self.buf = None
        try:
            self.mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when it is collected


def _same_memory(payload, area: np.ndarray) -> bool:
    """True when ``payload`` is a numpy view starting at ``area``'s first byte (a reserved slot)."""
    return isinstance(payload, np.ndarray) and payload.__array_interface__["data"][0] == area.__array_interface__["data"][0]


def _sleep(spins: int) -> None:
    time.sleep(0 if spins < 50 else 0.0002 if spins < 2000 else 0.001)


class ShmSender:
    """Sender side: creates the segment ``/dev/shm/weightsync-<name>-s<sender>``."""

    def __init__(self, spec: TransportSpec, sender: int = 0):
        self.spec, self.sender, self.path = spec, sender, _path(spec, sender)
        sweep_orphans()
        mm, inode = self._create()
        self.seg = _Segment(mm, spec)
        # Removes the name however this sender ends (close, collection, interpreter exit), or once
        # the receivers had their connect window and did not all come.
        self._finalizer = weakref.finalize(self, unlink, self.path, inode)
        self._deadline = threading.Timer(spec.connect_timeout_s + 1.0, unlink, (self.path, inode))
        self._deadline.daemon = True
        self._deadline.start()
        self._unlinked = False
        self._reply_from = 0
        self._next = 0  # next frame number to reserve or send (write_seq + frames reserved, unpublished)

    def _create(self) -> tuple[mmap.mmap, int]:
        """The mapped, initialised segment and its inode, published at ``self.path`` only once complete: sized and
        filled under a private name, then linked (atomic, fails if the name is taken), so a receiver
        polling for the path never sees a half-created segment.

        Raises:
            TransportError: ``SHM_DIR`` cannot hold the segment (``shm_files.reserve``)."""
        spec, staging = self.spec, f"{self.path}{STAGING}{os.getpid()}"
        size = _Segment.size(spec)
        fd = os.open(staging, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            reserve(fd, size, self.path)
            mm = mmap.mmap(fd, size)
            g = np.frombuffer(mm, dtype=np.uint8, count=64).view(np.uint64)
            np.frombuffer(mm, dtype=np.uint8)[:] = 0  # touch every page once, here
            g[_G_SLOTS], g[_G_PAYLOAD], g[_G_HCAP] = spec.slots, spec.bucket_bytes, spec.max_header_bytes
            g[_G_RECV], g[_G_PID], g[_G_MAGIC] = spec.num_receivers, os.getpid(), MAGIC
            del g
            os.link(staging, self.path)
            inode = os.fstat(fd).st_ino
        finally:
            os.close(fd)
            os.unlink(staging)
        return mm, inode

    @property
    def num_receivers(self) -> int:
        return self.spec.num_receivers

    @property
    def _live(self) -> _Segment:
        """The mapped segment; ``PeerLostError`` once ``close`` ran (a cancelled push's sender thread
        may still be waiting on a slot or a reply when another thread closes the channel)."""
        seg = self.seg
        if seg is None:
            raise PeerLostError(f"shm {self.path}: the sender's side was closed (the push was cancelled)")
        return seg

    def reserve(self, timeout_s: float) -> np.ndarray:
        """The writable payload area (uint8, ``bucket_bytes``) of the next frame's ring slot.

        Blocks until every receiver released that slot. Fill it, then ``send(header, view[:n])``:
        published in place, no copy. Frames must be sent in reservation order; a frame sent with
        any other payload (or none) drops reservations not yet sent (a failed sync).
        Raises TimeoutError / PeerLostError as ``send``.
        """
        n = self._next
        self._wait_slot(n, timeout_s)
        self._next = n + 1
        return self._live.slot(n)[2]

    def send(self, header: bytes, payload, timeout_s: float) -> None:
        if len(header) > self._live.hcap or (payload is not None and len(payload) > self._live.payload):
            raise ValueError(f"frame too large for the ring: header {len(header)} > {self._live.hcap} or payload > {self._live.payload}")
        n = int(self._live.g[_G_WSEQ])
        lens, hbuf, pbuf = self._live.slot(n)
        size = 0 if payload is None else len(payload)
        if not (size and n < self._next and _same_memory(payload, pbuf)):
            self._next = n  # not a reserved view: reservations not yet sent are void
            self._wait_slot(n, timeout_s)
            if size:
                np.copyto(pbuf[:size], payload if isinstance(payload, np.ndarray) else np.frombuffer(payload, dtype=np.uint8))
        hbuf[:len(header)] = np.frombuffer(header, dtype=np.uint8)
        lens[0], lens[1] = len(header), size
        self._next = max(self._next, n + 1)
        self._live.g[_G_WSEQ] = n + 1
        self._maybe_unlink()

    def _wait_slot(self, n: int, timeout_s: float) -> None:
        self._wait(lambda: all(int(rc[_R_READ]) + self._live.slots > n for rc in self._live.rc), timeout_s, "a free ring slot")

    def poll_reply(self, timeout_s: float) -> bytes | None:
        end, spins = time.monotonic() + timeout_s, 0
        while True:
            for k in range(self.spec.num_receivers):
                r = (self._reply_from + k) % self.spec.num_receivers
                rc = self._live.rc[r]
                if int(rc[_R_RSEQ]) > int(rc[_R_RACK]):
                    msg = bytes(self._live.recv[r][64:64 + int(rc[_R_RLEN])])
                    rc[_R_RACK] = rc[_R_RSEQ]
                    self._reply_from = r + 1
                    return msg
            if time.monotonic() >= end:
                return None
            spins += 1
            _sleep(spins)

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        end, spins, check = time.monotonic() + timeout_s, 0, time.monotonic() + _LIVENESS_S
        while not ready():
            now = time.monotonic()
            if now >= end:
                raise TimeoutError(f"shm {self.path}: no {what} within {timeout_s:.1f}s (a receiver stalled)")
            if now >= check:
                check = now + _LIVENESS_S
                for r, rc in enumerate(self._live.rc):
                    if int(rc[_R_PID]) and not alive(int(rc[_R_PID])):
                        raise PeerLostError(f"shm {self.path}: receiver {r} (pid {int(rc[_R_PID])}) died")
            spins += 1
            _sleep(spins)

    def _maybe_unlink(self) -> None:
        if not self._unlinked and all(int(rc[_R_PID]) for rc in self._live.rc):
            self._unlink()

    def _unlink(self) -> None:
        self._unlinked = True
        self._deadline.cancel()
        self._finalizer()

    def close(self) -> None:
        seg, self.seg = self.seg, None  # first: a concurrent wait sees PeerLostError, not a half-closed segment
        if seg is None:
            return
        seg.g[_G_CLOSED] = 1
        self._unlink()
        seg.close()


class ShmReceiver:
    """Receiver side: maps every sender's segment (waiting up to ``spec.connect_timeout_s``)."""

    def __init__(self, spec: TransportSpec, receiver: int = 0):
        self.spec, self.receiver = spec, receiver
        if not 0 <= receiver < spec.num_receivers:
            raise ValueError(f"receiver={receiver} outside [0, {spec.num_receivers})")
        self.segs = [self._attach(s) for s in range(spec.num_senders)]
        self._read = [int(seg.rc[receiver][_R_READ]) for seg in self.segs]  # next frame to read, per sender
        self._held: deque[int] = deque()  # senders of the frames received and not yet released, oldest first
        self._lock = threading.Lock()
        self._next = 0

    @property
    def max_held(self) -> int:
        """Frames a caller may hold unreleased at once (the ring's slots); ``recv`` beyond it
        releases the oldest."""
        return self.spec.slots

    def _attach(self, sender: int) -> _Segment:
        path, end = _path(self.spec, sender), time.monotonic() + self.spec.connect_timeout_s
        while True:
            try:
                fd = os.open(path, os.O_RDWR)
                break
            except FileNotFoundError:
                if time.monotonic() >= end:
                    raise TimeoutError(f"shm segment {path} did not appear within {self.spec.connect_timeout_s}s") from None
                time.sleep(0.01)
        try:
            size = os.fstat(fd).st_size
            if size != _Segment.size(self.spec):
                raise TransportError(f"shm segment {path} has {size} bytes, the spec needs {_Segment.size(self.spec)}: spec mismatch")
            seg = _Segment(mmap.mmap(fd, size), self.spec)
        finally:
            os.close(fd)
        if int(seg.g[_G_MAGIC]) != MAGIC:
            seg.close()
            raise TransportError(f"shm segment {path} is not a weightsync ring (bad magic)")
        seg.rc[self.receiver][_R_PID] = os.getpid()
        if all(int(rc[_R_PID]) for rc in seg.rc):
            unlink(path)  # the last receiver in: nothing needs the name any more
        return seg

    def recv(self, timeout_s: float):
        """The next frame; its payload is a view of the ring slot, valid until its ``release``."""
        if len(self._held) >= self.max_held:
            self.release()
        end, spins, check = time.monotonic() + timeout_s, 0, time.monotonic() + _LIVENESS_S
        while True:
            for k in range(len(self.segs)):
                s = (self._next + k) % len(self.segs)
                seg = self.segs[s]
                n = self._read[s]
                if int(seg.g[_G_WSEQ]) > n:
                    lens, hbuf, pbuf = seg.slot(n)
                    with self._lock:
                        self._held.append(s)
                        self._read[s] = n + 1
                    self._next = s + 1
                    hlen, plen = int(lens[0]), int(lens[1])
                    return bytes(hbuf[:hlen]), (pbuf[:plen] if plen else None)
            now = time.monotonic()
            if now >= end:
                raise TimeoutError(f"shm {self.spec.name}: no frame within {timeout_s:.1f}s")
            if now >= check:
                check = now + _LIVENESS_S
                self._check_senders()
            spins += 1
            _sleep(spins)

    def _check_senders(self) -> None:
        for s, seg in enumerate(self.segs):
            if int(seg.g[_G_CLOSED]) or not alive(int(seg.g[_G_PID])):
                raise PeerLostError(f"shm {self.spec.name}: sender {s} (pid {int(seg.g[_G_PID])}) closed or died")

    def release(self) -> None:
        """Frees the oldest held frame's slot (no-op when none is held); thread-safe."""
        with self._lock:
            if self._held:
                self.segs[self._held.popleft()].rc[self.receiver][_R_READ] += 1

    def reply(self, message: bytes, timeout_s: float) -> None:
        if len(message) > REPLY - 64:
            raise ValueError(f"reply of {len(message)} bytes > {REPLY - 64}")
        # One reply in flight per sender: wait briefly for the previous one to be read, then
        # overwrite it (a sender that stopped reading has given up that sync anyway).
        end = time.monotonic() + min(timeout_s, 1.0)
        for s, seg in enumerate(self.segs):
            rc, spins = seg.rc[self.receiver], 0
            while int(rc[_R_RSEQ]) > int(rc[_R_RACK]) and time.monotonic() < end:
                spins += 1
                _sleep(spins)
            self.segs[s].recv[self.receiver][64:64 + len(message)] = np.frombuffer(message, dtype=np.uint8)
            rc[_R_RLEN] = len(message)
            rc[_R_RSEQ] += 1

    def close(self) -> None:
        self._held.clear()
        for seg in self.segs:
            seg.close()
        self.segs = []
