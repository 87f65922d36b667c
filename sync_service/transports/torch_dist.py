"""torch.distributed broadcast transport, in a dedicated process group (not the default group).

Rendezvous: the authenticated store at ``spec.address:spec.port`` (``store.StoreServer``, started
by the channel's maker with ``host_channel``; only holders of ``spec.auth_key`` get in), keys
prefixed by ``spec.name``. The sender is rank 0, receiver ``i`` rank ``i + 1``; the group is a
standalone ``ProcessGroupGloo`` (or ``ProcessGroupNCCL``) on that store, so a trainer's own default
group is untouched, and each rank's gloo connections listen on one address only: its own host's
address on the route to the store (``store.local_address_toward``; ``spec.address`` itself when
every rank shares the store's host).

A frame is one broadcast of a fixed ``CTRL_BYTES`` control block from rank 0 (header length,
payload length, whether more frames of this stream follow, then the header itself; a header that
does not fit follows in a second broadcast), then the payload into one of ``spec.slots``
preallocated receive buffers. A receiver thread receives ahead: while the caller verifies and
applies frame k (holding its buffer), frame k+1 already streams into the next buffer, until the
sender's ``Commit``/``Abort`` ends the stream. Nothing is allocated per frame. Replies go through
the store's ``reply`` queue. One sender only. With NCCL, a sender's device bucket (``transports.devices``:
NCCL takes device buckets) is broadcast as it is; a host payload, and every receive, is staged through
preallocated device buffers (one copy).

Under NCCL each rank binds its current CUDA device before the group is made (``cuda_device.bind_device``; the
communicator lives on that device) and publishes its GPU's UUID on the store; a group where two ranks hold one
GPU is refused in one line naming the ranks (``cuda_device.refuse_shared_gpu``) instead of NCCL's "Duplicate GPU
detected" inside the first broadcast — on a one-GPU machine, run trainers and engines with ``transport="cuda_ipc"``.

Every wait has a timeout (``Work.wait``); a timed-out or failed collective leaves the group out of
step, so the transport is then marked broken and every later call raises ``TransportError``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from datetime import timedelta

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from protocols.interfaces import PeerLostError, TransportError
from sync_service.transports.cuda_device import bind_device, device_uuid, refuse_shared_gpu
from sync_service.transports.spec import TransportSpec
from sync_service.transports.store import StoreClient, local_address_toward

_GROUPS = {"gloo": (dist.ProcessGroupGloo, "cpu"), "nccl": (getattr(dist, "ProcessGroupNCCL", None), "cuda")}
CTRL_BYTES = 16 << 10
"""Control block: u64 header length, u64 payload length, u64 more-follows, pad to 64, header bytes."""
_CTRL_HEAD = 64
_STREAM_END_TAGS = frozenset({"commit", "abort"})


def _more_follows(header: bytes) -> bool:
    """False for a frame that ends a sender's stream (``Commit``/``Abort``): the receiver then
    stops receiving ahead. Reads only the wire tag (``[SCHEMA_VERSION, tag, ...]``)."""
    try:
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(header[:64])
        unpacker.read_array_header()
        unpacker.skip()
        return unpacker.unpack() not in _STREAM_END_TAGS
    except Exception:
        return False


class _Group:
    """Store + process group + preallocated buffers of one side."""

    def __init__(self, spec: TransportSpec, rank: int):
        if spec.num_senders != 1:
            raise ValueError(f"torch_dist carries one sender per spec, got num_senders={spec.num_senders}; "
                             "open one spec per trainer shard")
        cls, self.device = _GROUPS[spec.backend]
        if cls is None:
            raise ValueError(f"backend {spec.backend!r} is not available in this torch build")
        if not spec.port:
            raise ValueError(f"torch_dist spec {spec.name!r} has no rendezvous port; start its store with "
                             "sync_service.transports.host_channel(spec) and ship host.spec")
        self.spec, self.rank, self.world = spec, rank, spec.num_receivers + 1
        self.local_address = local_address_toward(spec.address, spec.port)
        """The address this rank's gloo connections listen on: its own host's, on the route to the store."""
        self.client = StoreClient(spec.address, spec.port, spec.auth_key, spec.connect_timeout_s)
        self.store = dist.PrefixStore(f"{spec.name}/", self.client)
        try:
            self.pg = self._group(cls)
        except BaseException:
            self.client.close()
            raise
        self.ctrl = torch.zeros(CTRL_BYTES, dtype=torch.uint8, device=self.device)
        self.ctrl_host = self.ctrl if self.device == "cpu" else torch.zeros(CTRL_BYTES, dtype=torch.uint8)
        self.header = torch.zeros(spec.max_header_bytes, dtype=torch.uint8, device=self.device)
        self.broken: str | None = None

    def _group(self, cls):
        spec = self.spec
        try:
            if spec.backend == "gloo":  # bound to this host's address toward the store (by itself: the host name's)
                options = dist.ProcessGroupGloo._Options()
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.local_address)]
                options._timeout = timedelta(seconds=spec.op_timeout_s)
                return cls(self.store, self.rank, self.world, options)
            device = bind_device("cuda")
            self.store.set(f"gpu/{self.rank}", device_uuid(device).encode())
            refuse_shared_gpu({r: self.store.get(f"gpu/{r}").decode() for r in range(self.world)},
                              what=f"torch_dist {spec.name} (NCCL)")
            pg = cls(self.store, self.rank, self.world, timedelta(seconds=spec.op_timeout_s))
            if hasattr(pg, "bound_device_id"):  # eager communicator init on the bound device, as init_process_group(device_id=)
                pg.bound_device_id = device
            return pg
        except TransportError:
            raise
        except (RuntimeError, TimeoutError) as exc:  # c10d wraps the store's errors
            raise TransportError(f"torch_dist {spec.name}: rank {self.rank} could not join the group within "
                                 f"{spec.connect_timeout_s:.1f}s: {str(exc)[:300]}") from None

    def bcast(self, t: torch.Tensor, timeout_s: float, what: str) -> None:
        if self.broken:
            raise TransportError(f"torch_dist {self.spec.name} is broken ({self.broken}); open a new spec")
        try:
            self.pg.broadcast([t], dist.BroadcastOptions()).wait(timedelta(seconds=max(timeout_s, 0.001)))
        except RuntimeError as exc:
            self.broken = f"{what}: {exc}"
            text = str(exc)
            if "timed out" in text.lower() or "timeout" in text.lower():
                raise TimeoutError(f"torch_dist {self.spec.name}: {what} timed out after {timeout_s:.1f}s") from None
            raise PeerLostError(f"torch_dist {self.spec.name}: {what} failed: {text[:500]}") from None

    def close(self) -> None:
        self.client.close()
        self.pg = self.store = None
        self.broken = self.broken or "closed"

    def check_open(self) -> None:
        """``PeerLostError`` once ``close`` ran (a cancelled push's sender may still call in)."""
        if self.pg is None:
            raise PeerLostError(f"torch_dist {self.spec.name}: this side was closed (the push was cancelled)")


class DistSender:
    """Sender side (rank 0)."""

    def __init__(self, spec: TransportSpec, sender: int = 0):
        self.g = _Group(spec, 0)
        self._ctrl = self.g.ctrl_host.numpy()
        self._words = self._ctrl[:_CTRL_HEAD].view(np.uint64)
        self._stage = None if self.g.device == "cpu" else torch.empty(spec.bucket_bytes, dtype=torch.uint8, device=self.g.device)

    @property
    def num_receivers(self) -> int:
        return self.g.spec.num_receivers

    def send(self, header: bytes, payload, timeout_s: float) -> None:
        g, end = self.g, time.monotonic() + timeout_s
        g.check_open()
        size = 0 if payload is None else len(payload)
        if len(header) > g.header.numel() or size > g.spec.bucket_bytes:
            raise ValueError(f"frame too large: header {len(header)} / payload {size} bytes over the spec's limits")
        inline = min(len(header), CTRL_BYTES - _CTRL_HEAD)
        self._words[0], self._words[1], self._words[2] = len(header), size, _more_follows(header)
        self._ctrl[_CTRL_HEAD:_CTRL_HEAD + inline] = np.frombuffer(header, dtype=np.uint8, count=inline)
        if g.ctrl is not g.ctrl_host:
            g.ctrl.copy_(g.ctrl_host)
        g.bcast(g.ctrl, end - time.monotonic(), "control block")
        if len(header) > inline:
            rest = len(header) - inline
            g.header[:rest].copy_(torch.frombuffer(memoryview(header)[inline:], dtype=torch.uint8))
            g.bcast(g.header[:rest], end - time.monotonic(), "header")
        if size:
            src = payload if isinstance(payload, torch.Tensor) else torch.from_numpy(np.asarray(payload, dtype=np.uint8).reshape(-1))
            if self._stage is not None and src.device.type != self.g.device:  # a device bucket goes as it is
                self._stage[:size].copy_(src)
                src = self._stage[:size]
            g.bcast(src, end - time.monotonic(), "payload")

    def poll_reply(self, timeout_s: float) -> bytes | None:
        self.g.check_open()
        if self.g.broken:
            raise TransportError(f"torch_dist {self.g.spec.name} is broken ({self.g.broken}); open a new spec")
        return self.g.client.pop("reply", timeout_s)

    def close(self) -> None:
        self.g.close()


class DistReceiver:
    """Receiver side (rank ``receiver + 1``); a thread receives ahead into ``spec.slots`` buffers."""

    def __init__(self, spec: TransportSpec, receiver: int = 0):
        if not 0 <= receiver < spec.num_receivers:
            raise ValueError(f"receiver={receiver} outside [0, {spec.num_receivers})")
        self.receiver = receiver
        self.g = _Group(spec, receiver + 1)
        nbuf = max(2, spec.slots)
        self._bufs = [torch.ones(spec.bucket_bytes, dtype=torch.uint8, device=self.g.device) for _ in range(nbuf)]
        self._host = None if self.g.device == "cpu" else [torch.empty(spec.bucket_bytes, dtype=torch.uint8, pin_memory=True)
                                                          for _ in range(nbuf)]
        self._arrays = [(b if self._host is None else h).numpy() for b, h in zip(self._bufs, self._host or self._bufs)]
        self._ctrl = self.g.ctrl_host.numpy()
        self._words = self._ctrl[:_CTRL_HEAD].view(np.uint64)
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(nbuf):
            self._free.put(i)
        self._frames: queue.SimpleQueue = queue.SimpleQueue()
        self._go: queue.SimpleQueue = queue.SimpleQueue()
        self._active = False
        self._closed = False
        self._held: deque[int | None] = deque()
        self._thread = threading.Thread(target=self._run, name="weightsync-dist-recv", daemon=True)
        self._thread.start()

    @property
    def max_held(self) -> int:
        """Frames a caller may hold unreleased: one buffer stays free for receiving ahead."""
        return len(self._bufs) - 1

    def recv(self, timeout_s: float):
        if len(self._held) >= self.max_held:
            self.release()
        if not self._active and self._frames.empty():
            self._active = True
            self._go.put(True)
        try:
            item = self._frames.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            raise TimeoutError(f"torch_dist {self.g.spec.name}: no frame within {timeout_s:.1f}s") from None
        if isinstance(item, BaseException):
            raise item
        header, index, plen = item
        self._held.append(index)
        return header, (None if index is None else self._arrays[index][:plen])

    def release(self) -> None:
        """Returns the oldest held frame's buffer for receiving ahead (no-op when none is held)."""
        if self._held and (index := self._held.popleft()) is not None:
            self._free.put(index)

    def _run(self) -> None:
        while self._go.get() is not None:
            more = True
            while more and not self._closed:
                try:
                    header, index, plen, more = self._receive_frame()
                except BaseException as exc:
                    header, more = exc, False
                if not more:
                    self._active = False  # before the stream's last frame is visible to recv
                self._frames.put(header if isinstance(header, BaseException) else (header, index, plen))

    def _receive_frame(self) -> tuple[bytes, int | None, int, bool]:
        g = self.g
        timeout_s = g.spec.op_timeout_s  # the group's own per-collective timeout
        g.bcast(g.ctrl, timeout_s, "control block")
        if g.ctrl is not g.ctrl_host:
            g.ctrl_host.copy_(g.ctrl)
        hlen, plen, more = (int(w) for w in self._words[:3])
        if not 0 < hlen <= g.header.numel() or not 0 <= plen <= g.spec.bucket_bytes:
            g.broken = f"bad control block {hlen}/{plen}"
            raise TransportError(f"torch_dist {g.spec.name}: frame lengths {hlen}/{plen} outside the spec's limits")
        inline = min(hlen, CTRL_BYTES - _CTRL_HEAD)
        header = self._ctrl[_CTRL_HEAD:_CTRL_HEAD + inline].tobytes()
        if hlen > inline:
            g.bcast(g.header[:hlen - inline], timeout_s, "header")
            header += g.header[:hlen - inline].cpu().numpy().tobytes()
        if not plen:
            return header, None, 0, bool(more)
        index = self._take_buffer(timeout_s)
        g.bcast(self._bufs[index][:plen], timeout_s, "payload")
        if self._host is not None:
            self._host[index][:plen].copy_(self._bufs[index][:plen])
        return header, index, plen, bool(more)

    def _take_buffer(self, timeout_s: float) -> int:
        end = time.monotonic() + timeout_s
        while True:
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                if self._closed or time.monotonic() >= end:
                    raise TimeoutError(f"torch_dist {self.g.spec.name}: no receive buffer released within {timeout_s:.1f}s") from None

    def reply(self, message: bytes, timeout_s: float) -> None:
        self.g.client.push("reply", message)

    def close(self) -> None:
        self._closed = True
        self._go.put(None)
        self._held.clear()
        self.g.close()

