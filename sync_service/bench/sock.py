"""Plain TCP between two hosts: the link floor and the disk path's checkpoint copy.

``LinkEnd`` is a Ray actor placed on a host (``options(resources=...)``). The receiving end
``listen(address)`` binds that host's address (a free port) and takes one stream per ``receive``; the
sending end ``send_bytes`` / ``send_dir`` connects and streams. A stream is a sequence of blobs, each
``u32 name length, name (UTF-8), u64 size, bytes``, ended by a zero-length name; the receiver then
answers one ack byte. Blobs are written into a directory (``send_dir``: the checkpoint copy) or
received into one reused buffer and dropped (``send_bytes``: the floor: no header, no checksum, the
least any sync of these bytes over the link spends). Nothing received is unpickled or executed.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from pathlib import Path

import ray

__all__ = ["LinkEnd"]

_HEAD, _HEAD_BYTES = "<I", 4  # blob name length (formats, not struct.Struct: Ray pickles the actor class by value)
_SIZE, _SIZE_BYTES = "<Q", 8  # blob size
CHUNK_BYTES = 4 << 20
"""Receive buffer, bytes (reused for every blob)."""
MAX_NAME_BYTES = 4096


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if not n:
            raise ConnectionError(f"link stream closed after {got} of {len(view)} bytes")
        got += n


def _recv_blob(conn: socket.socket, buf: bytearray, dest: Path | None) -> int | None:
    """One blob into ``dest`` (or dropped); returns its size, ``None`` at the end marker."""
    head = bytearray(_HEAD_BYTES)
    _recv_exact(conn, memoryview(head))
    (name_len,) = struct.unpack(_HEAD, head)
    if name_len == 0:
        return None
    if name_len > MAX_NAME_BYTES:
        raise ValueError(f"link stream: blob name of {name_len} bytes (at most {MAX_NAME_BYTES})")
    raw = bytearray(name_len + _SIZE_BYTES)
    _recv_exact(conn, memoryview(raw))
    name, (size,) = raw[:name_len].decode(), struct.unpack(_SIZE, raw[name_len:])
    if dest is not None and (Path(name).name != name or name in ("", ".", "..")):
        raise ValueError(f"link stream: blob name {name!r} is not a plain file name")
    out = open(dest / name, "wb") if dest is not None else None
    try:
        left, view = size, memoryview(buf)
        while left:
            n = min(left, len(buf))
            _recv_exact(conn, view[:n])
            if out is not None:
                out.write(view[:n])
            left -= n
    finally:
        if out is not None:
            out.close()
    return size


def _send_head(conn: socket.socket, name: str, size: int) -> None:
    raw = name.encode()
    conn.sendall(struct.pack(_HEAD, len(raw)) + raw + struct.pack(_SIZE, size))


@ray.remote(num_cpus=0)
class LinkEnd:
    """One end of a plain TCP stream between two hosts (see the module docstring)."""

    def __init__(self, timeout_s: float = 300.0) -> None:
        self.timeout_s = timeout_s
        self.server: socket.socket | None = None
        self.buf = bytearray(CHUNK_BYTES)
        self.src = bytes(CHUNK_BYTES)
        self._done: list = []
        self._thread: threading.Thread | None = None

    def listen(self, address: str) -> int:
        """Bind ``address`` (this host's; never every interface) on a free port; returns the port."""
        self.server = socket.create_server((address, 0))
        self.server.settimeout(self.timeout_s)
        return self.server.getsockname()[1]

    def receive(self, dest_dir: str | None = None) -> None:
        """Take the next stream in a thread (blobs into ``dest_dir``, created, or dropped); ``wait()``
        returns its byte count. Returns at once."""
        dest = None if dest_dir is None else Path(dest_dir)
        if dest is not None:
            dest.mkdir(parents=True, exist_ok=True)
        self._done = []
        self._thread = threading.Thread(target=self._serve, args=(dest,), daemon=True)
        self._thread.start()

    def _serve(self, dest: Path | None) -> None:
        try:
            conn, _ = self.server.accept()
            with conn:
                conn.settimeout(self.timeout_s)
                total = 0
                while (size := _recv_blob(conn, self.buf, dest)) is not None:
                    total += size
                conn.sendall(b"\x01")
            self._done.append(total)
        except Exception as exc:  # reported by wait()
            self._done.append(exc)

    def wait(self) -> int:
        """Bytes of the stream ``receive`` took; raises its error or TimeoutError after ``timeout_s``."""
        self._thread.join(self.timeout_s)
        if not self._done:
            raise TimeoutError(f"link receiver: no stream finished within {self.timeout_s} s")
        if isinstance(self._done[0], Exception):
            raise self._done[0]
        return self._done[0]

    def _stream(self, address: str, port: int, blobs) -> float:
        t0 = time.perf_counter()
        with socket.create_connection((address, port), timeout=self.timeout_s) as conn:
            for name, write in blobs:
                write(conn, name)
            conn.sendall(struct.pack(_HEAD, 0))
            _recv_exact(conn, memoryview(bytearray(1)))
        return time.perf_counter() - t0

    def send_bytes(self, address: str, port: int, nbytes: int) -> float:
        """Stream ``nbytes`` from one reused buffer to the receiver at ``address:port``; seconds from
        connect to the receiver's ack."""
        def write(conn: socket.socket, name: str) -> None:
            _send_head(conn, name, nbytes)
            view, left = memoryview(self.src), nbytes
            while left:
                n = min(left, len(view))
                conn.sendall(view[:n])
                left -= n

        return self._stream(address, port, [("floor", write)])

    def send_dir(self, address: str, port: int, src_dir: str) -> float:
        """Stream every file of ``src_dir`` (``socket.sendfile``) to the receiver; seconds to its ack."""
        def write_file(path: Path):
            def write(conn: socket.socket, name: str) -> None:
                _send_head(conn, name, path.stat().st_size)
                with open(path, "rb") as f:
                    conn.sendfile(f)
            return write

        files = sorted(p for p in Path(src_dir).iterdir() if p.is_file())
        return self._stream(address, port, [(p.name, write_file(p)) for p in files])

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def pid(self) -> int:
        return os.getpid()
