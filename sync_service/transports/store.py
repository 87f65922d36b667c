"""An authenticated key-value store: the rendezvous and reply channel of the ``torch_dist`` transport.

``torch.distributed.TCPStore`` serves anyone who can open a TCP connection to it: any local user
could list a channel's keys, overwrite gloo's address records or post a fake reply. This store
admits only clients that prove the channel's key (``TransportSpec.auth_key``): on every
connection both sides prove it by HMAC-SHA256 over fresh random nonces of both (mutual
challenge-response, compared in constant time), then the client sends msgpack requests, framed by
``multiprocessing.connection.Connection.send_bytes`` (length-prefixed bytes; no pickling). A client
without the key is disconnected before its first request; the server listens on one address only
(``StoreServer(host, ...)``).

``StoreClient`` is a ``torch.distributed.Store``, so a ``ProcessGroupGloo`` rendezvous runs on it
(gloo uses ``set`` / ``get`` / ``wait``); ``push`` / ``pop`` add the FIFO queue the replies use.
Every blocking call has a timeout. Keys are ``str``, values ``bytes``; ``add`` keeps decimal
ASCII counters (as ``TCPStore`` does).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading
import time
from collections import deque
from datetime import timedelta
from multiprocessing.connection import AuthenticationError, Connection

import msgpack
import torch.distributed as dist

from protocols.interfaces import TransportError

__all__ = ["StoreClient", "StoreServer", "bind_listener", "free_port", "local_address_toward"]

MAX_MESSAGE_BYTES = 4 << 20
"""Largest request or answer, bytes (replies and gloo address records are far smaller)."""
HANDSHAKE_TIMEOUT_S = 10.0
"""A connection that has not proven the key within this many seconds is dropped."""
_OK, _ERR, _TIMEOUT = 0, 1, 2
_NONCE = 32
_HELLO = b"weightsync-store-1"


def _proof(key: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, role + first + second, hashlib.sha256).digest()


def _challenge(conn: Connection, key: bytes) -> None:
    """Server side of the handshake: the client must prove ``key`` on our nonce, then we prove it on
    the client's. Raises AuthenticationError (or OSError / EOFError from the connection)."""
    ours = os.urandom(_NONCE)
    conn.send_bytes(_HELLO + ours)
    answer = conn.recv_bytes(_NONCE + 32)
    theirs, proof = answer[:_NONCE], answer[_NONCE:]
    if len(theirs) != _NONCE or not hmac.compare_digest(proof, _proof(key, b"client", ours, theirs)):
        raise AuthenticationError("store client did not prove the channel's key")
    conn.send_bytes(_proof(key, b"server", theirs, ours))


def _answer(conn: Connection, key: bytes) -> None:
    """Client side of the handshake (see ``_challenge``)."""
    hello = conn.recv_bytes(len(_HELLO) + _NONCE)
    theirs, ours = hello[len(_HELLO):], os.urandom(_NONCE)
    if not hello.startswith(_HELLO) or len(theirs) != _NONCE:
        raise AuthenticationError("not a weightsync store")
    conn.send_bytes(ours + _proof(key, b"client", theirs, ours))
    if not hmac.compare_digest(conn.recv_bytes(32), _proof(key, b"server", ours, theirs)):
        raise AuthenticationError("store did not prove the channel's key")


def bind_listener(host: str, port_range: tuple[int, int] | None) -> socket.socket:
    """A listening TCP socket bound to ``host`` only: the first free port of ``port_range``
    (inclusive), or one the OS picks when ``None``. Raises TransportError naming the range."""
    family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
    ports = [0] if port_range is None else range(port_range[0], port_range[1] + 1)
    last = None
    for port in ports:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))
            sock.listen(128)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    where = "a free port" if port_range is None else f"a free port in {port_range[0]}-{port_range[1]}"
    raise TransportError(f"cannot listen on {host}: no {where} ({last}); widen SyncConfig.port_range or free one")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it), for a listener another process opens; it can be
    taken again before that process binds it: where this process listens itself, keep ``bind_listener``'s socket."""
    with bind_listener(host, None) as sock:
        return sock.getsockname()[1]


def local_address_toward(host: str, port: int) -> str:
    """This host's own address on the route to ``host:port``: the one address a listener of this
    process must bind for ``host``'s side to reach it (``127.0.0.1`` toward ``127.0.0.1``; on another
    host, the interface the kernel routes through). Sends nothing (a UDP ``connect`` only picks the
    route). Raises TransportError when ``host`` is unroutable from here."""
    family, _, _, _, target = socket.getaddrinfo(host, port or 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(target)
        except OSError as exc:
            raise TransportError(f"no route from this host to {host} ({exc}); check the address the "
                                 "channel's maker binds (SyncConfig.bind_host)") from None
        return probe.getsockname()[0]


def _on_fd(conn: Connection, fn) -> None:
    """``fn(socket)`` on the connection's fd without taking it over (the Connection owns it)."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        fn(sock)
    finally:
        sock.detach()


def _set_io_timeout(conn: Connection, seconds: float | None) -> None:
    """SO_RCVTIMEO / SO_SNDTIMEO of a blocking connection (``None``: wait forever)."""
    sec = 0.0 if seconds is None else max(seconds, 0.001)
    value = struct.pack("ll", int(sec), int((sec - int(sec)) * 1e6))

    def apply(sock: socket.socket) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
    _on_fd(conn, apply)


def _shutdown(conn: Connection) -> None:
    try:
        _on_fd(conn, lambda sock: sock.shutdown(socket.SHUT_RDWR))
    except OSError:
        pass


class _Table:
    """The store's state: keys, counters and queues under one condition variable. Each operation
    takes the request's argument list and returns ``(status, value)``."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.queues: dict[str, deque[bytes]] = {}
        self.cv = threading.Condition()
        self.closed = False
        self.ops = {"set": self._set, "get": self._get, "add": self._add, "check": self._check, "wait": self._wait,
                    "delete": self._delete, "num_keys": self._num_keys, "push": self._push, "pop": self._pop}

    def handle(self, op: str, args: list):
        fn = self.ops.get(op)
        if fn is None:
            return _ERR, f"unknown store operation {op!r}"
        with self.cv:
            return fn(*args)

    def _until(self, ready, wait_s: float) -> bool:
        return self.cv.wait_for(lambda: self.closed or ready(), max(float(wait_s), 0.0)) and not self.closed

    def _changed(self, value=None):
        self.cv.notify_all()
        return _OK, value

    def _set(self, key: str, value: bytes):
        self.data[key] = bytes(value)
        return self._changed()

    def _get(self, key: str, wait_s: float):
        return (_OK, self.data[key]) if self._until(lambda: key in self.data, wait_s) else (_TIMEOUT, None)

    def _add(self, key: str, amount: int):
        value = int(self.data.get(key, b"0")) + int(amount)
        self.data[key] = str(value).encode()
        return self._changed(value)

    def _check(self, keys: list[str]):
        return _OK, all(k in self.data for k in keys)

    def _wait(self, keys: list[str], wait_s: float):
        return (_OK, True) if self._until(lambda: all(k in self.data for k in keys), wait_s) else (_TIMEOUT, None)

    def _delete(self, key: str):
        return _OK, self.data.pop(key, None) is not None

    def _num_keys(self):
        return _OK, len(self.data)

    def _push(self, queue: str, value: bytes):
        self.queues.setdefault(queue, deque()).append(bytes(value))
        return self._changed()

    def _pop(self, queue: str, wait_s: float):
        q = self.queues.setdefault(queue, deque())
        return _OK, (q.popleft() if self._until(lambda: bool(q), wait_s) else None)


class StoreServer:
    """Serves one ``_Table`` on ``host`` (a port of ``port_range``, or one the OS picks) to clients
    holding ``key``. Threads: one accepting, one per connection. ``close`` stops all of them."""

    def __init__(self, host: str, key: bytes, port_range: tuple[int, int] | None = None) -> None:
        if not isinstance(key, bytes) or len(key) < 16:
            raise ValueError("StoreServer: key must be bytes of >= 16")
        self.key, self.table = key, _Table()
        self._sock = bind_listener(host, port_range)
        self._sock.settimeout(0.2)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._conns: set[Connection] = set()
        self._lock = threading.Lock()
        self.refused = 0
        """Connections dropped because they did not prove the key."""
        threading.Thread(target=self._accept_loop, name="weightsync-store-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self.table.closed:
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            conn.settimeout(None)
            conn = Connection(conn.detach())
            with self._lock:
                if self.table.closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="weightsync-store-conn", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        try:
            _set_io_timeout(conn, HANDSHAKE_TIMEOUT_S)
            try:
                _challenge(conn, self.key)
            except (AuthenticationError, OSError, EOFError):
                self.refused += 1
                return
            _set_io_timeout(conn, None)
            while not self.table.closed:
                op, args = msgpack.unpackb(conn.recv_bytes(MAX_MESSAGE_BYTES), raw=False)
                conn.send_bytes(msgpack.packb(self.table.handle(op, args)))
        except (OSError, EOFError, ValueError, TypeError, IndexError):
            pass  # the client went away or sent garbage after authenticating: drop it
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stop serving: wakes every blocked request and disconnects every client."""
        with self.table.cv:
            self.table.closed = True
            self.table.cv.notify_all()
        self._sock.close()
        with self._lock:
            for conn in self._conns:
                _shutdown(conn)  # wakes its thread, which closes it


class StoreClient(dist.Store):
    """A connection to a ``StoreServer``, authenticated with ``key``; usable as a c10d Store.

    Args: host, port: the server. key: the channel's key. timeout_s: connect + handshake bound, and
    the default wait of ``get`` / ``wait`` (gloo's rendezvous), seconds.
    Raises (constructor): TransportError: unreachable, or the server does not hold ``key``.
    """

    def __init__(self, host: str, port: int, key: bytes, timeout_s: float) -> None:
        super().__init__()
        self.timeout_s, self._lock = float(timeout_s), threading.Lock()
        self._conn: Connection | None = self._connect(host, port, key)
        self._io_timeout = -1.0

    def _connect(self, host: str, port: int, key: bytes) -> Connection:
        end = time.monotonic() + self.timeout_s
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=max(end - time.monotonic(), 0.01))
                break
            except OSError as exc:
                if time.monotonic() >= end:
                    raise TransportError(f"rendezvous store {host}:{port} unreachable within {self.timeout_s:.1f}s: {exc}") from None
                time.sleep(0.05)
        sock.settimeout(None)
        conn = Connection(sock.detach())
        _set_io_timeout(conn, min(self.timeout_s, HANDSHAKE_TIMEOUT_S) + 1.0)
        try:
            _answer(conn, key)
        except (AuthenticationError, OSError, EOFError) as exc:
            conn.close()
            raise TransportError(f"rendezvous store {host}:{port} refused the channel's key or is not a weightsync "
                                 f"store ({type(exc).__name__}); the spec's auth_key must be the host's") from None
        return conn

    def _call(self, op: str, *args, wait_s: float = 0.0):
        with self._lock:
            if self._conn is None:
                raise TransportError("rendezvous store connection is closed")
            if self._io_timeout != wait_s:
                _set_io_timeout(self._conn, wait_s + 30.0)
                self._io_timeout = wait_s
            try:
                self._conn.send_bytes(msgpack.packb([op, list(args)]))
                status, value = msgpack.unpackb(self._conn.recv_bytes(MAX_MESSAGE_BYTES), raw=False)
            except (OSError, EOFError) as exc:
                self._close_locked()
                raise TransportError(f"rendezvous store lost during {op!r}: {type(exc).__name__}: {exc}") from None
        if status == _TIMEOUT:
            raise TimeoutError(f"rendezvous store: {op} {args[0]!r} not satisfied within {wait_s:.1f}s")
        if status != _OK:
            raise TransportError(f"rendezvous store: {value}")
        return value

    # -- c10d Store --------------------------------------------------------------------------
    def set(self, key: str, value) -> None:
        self._call("set", key, bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", key, self.timeout_s, wait_s=self.timeout_s)

    def add(self, key: str, value: int) -> int:
        return self._call("add", key, int(value))

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys), 0.0)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        wait_s = self.timeout_s if timeout is None else timeout.total_seconds()
        self._call("wait", list(keys), wait_s, wait_s=wait_s)

    def delete_key(self, key: str) -> bool:
        return self._call("delete", key)

    def num_keys(self) -> int:
        return self._call("num_keys")

    # -- queues ------------------------------------------------------------------------------
    def push(self, queue: str, value: bytes) -> None:
        """Append ``value`` to ``queue`` (FIFO)."""
        self._call("push", queue, bytes(value))

    def pop(self, queue: str, timeout_s: float) -> bytes | None:
        """The oldest value of ``queue``, waiting up to ``timeout_s``; ``None`` if none came."""
        return self._call("pop", queue, timeout_s, wait_s=timeout_s)

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
