"""torch.distributed broadcast transport, in a dedicated process group (not the default group).

Rendezvous: a ``TCPStore`` at ``spec.address:spec.port`` hosted by the sender (rank 0; receiver
``i`` is rank ``i + 1``), keys prefixed by ``spec.name``; the group is a standalone
``ProcessGroupGloo`` (or ``ProcessGroupNCCL``) on it, so a trainer's own default group is untouched.

A frame is three broadcasts from rank 0: a fixed-size int64[2] length prefix (header bytes,
payload bytes), the header into a preallocated ``max_header_bytes`` buffer, then the payload into a
preallocated ``bucket_bytes`` receive buffer (reused; the receiver copies out before the next
``recv``). Replies go through the TCPStore (``reply/<receiver>/<n>`` + a counter). One sender only.
With NCCL, payloads are staged through preallocated device buffers (one copy each way).

Every wait has a timeout (``Work.wait``); a timed-out or failed collective leaves the group out of
step, so the transport is then marked broken and every later call raises ``TransportError``.
"""

from __future__ import annotations

import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from protocols.interfaces import PeerLostError, TransportError
from sync_service.transports.spec import TransportSpec

_GROUPS = {"gloo": (dist.ProcessGroupGloo, "cpu"), "nccl": (getattr(dist, "ProcessGroupNCCL", None), "cuda")}


class _Group:
    """Store + process group + preallocated buffers of one side."""

    def __init__(self, spec: TransportSpec, rank: int):
        if spec.num_senders != 1:
            raise ValueError(f"torch_dist carries one sender per spec, got num_senders={spec.num_senders}; "
                             "open one spec per trainer shard")
        cls, self.device = _GROUPS[spec.backend]
        if cls is None:
            raise ValueError(f"backend {spec.backend!r} is not available in this torch build")
        self.spec, self.rank, self.world = spec, rank, spec.num_receivers + 1
        base = dist.TCPStore(spec.address, spec.port, self.world, rank == 0,
                             timeout=timedelta(seconds=spec.connect_timeout_s))
        self.store = dist.PrefixStore(f"weightsync/{spec.name}/", base)
        self._base = base
        self.pg = cls(self.store, rank, self.world, timedelta(seconds=spec.op_timeout_s))
        self.prefix = torch.zeros(2, dtype=torch.int64, device=self.device)
        self.header = torch.zeros(spec.max_header_bytes, dtype=torch.uint8, device=self.device)
        self.payload = torch.ones(spec.bucket_bytes, dtype=torch.uint8, device=self.device)
        self.host = None if self.device == "cpu" else torch.empty(spec.bucket_bytes, dtype=torch.uint8, pin_memory=True)
        self.broken: str | None = None

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
        self.pg = self.store = self._base = None


class DistSender:
    """Sender side (rank 0, hosts the TCPStore)."""

    def __init__(self, spec: TransportSpec, sender: int = 0):
        self.g = _Group(spec, 0)
        self._seen = [0] * spec.num_receivers
        self._from = 0

    @property
    def num_receivers(self) -> int:
        return self.g.spec.num_receivers

    def send(self, header: bytes, payload, timeout_s: float) -> None:
        g, end = self.g, time.monotonic() + timeout_s
        size = 0 if payload is None else len(payload)
        if len(header) > g.header.numel() or size > g.payload.numel():
            raise ValueError(f"frame too large: header {len(header)} / payload {size} bytes over the spec's limits")
        g.prefix[0], g.prefix[1] = len(header), size
        g.bcast(g.prefix, end - time.monotonic(), "length prefix")
        g.header[:len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        g.bcast(g.header[:len(header)], end - time.monotonic(), "header")
        if size:
            src = torch.from_numpy(np.asarray(payload, dtype=np.uint8).reshape(-1))
            if g.device != "cpu":
                g.payload[:size].copy_(src, non_blocking=False)
                src = g.payload[:size]
            g.bcast(src, end - time.monotonic(), "payload")

    def poll_reply(self, timeout_s: float) -> bytes | None:
        end = time.monotonic() + timeout_s
        while True:
            for k in range(self.num_receivers):
                r = (self._from + k) % self.num_receivers
                if self.g.store.add(f"reply/{r}/n", 0) > self._seen[r]:
                    key = f"reply/{r}/{self._seen[r]}"
                    msg = self.g.store.get(key)
                    self.g.store.delete_key(key)
                    self._seen[r] += 1
                    self._from = r + 1
                    return msg
            if time.monotonic() >= end:
                return None
            time.sleep(0.001)

    def close(self) -> None:
        self.g.close()


class DistReceiver:
    """Receiver side (rank ``receiver + 1``)."""

    def __init__(self, spec: TransportSpec, receiver: int = 0):
        if not 0 <= receiver < spec.num_receivers:
            raise ValueError(f"receiver={receiver} outside [0, {spec.num_receivers})")
        self.receiver = receiver
        self.g = _Group(spec, receiver + 1)
        self._sent = 0

    def recv(self, timeout_s: float):
        g, end = self.g, time.monotonic() + timeout_s
        g.bcast(g.prefix, timeout_s, "length prefix")
        hlen, plen = int(g.prefix[0]), int(g.prefix[1])
        if not 0 < hlen <= g.header.numel() or not 0 <= plen <= g.payload.numel():
            g.broken = f"bad length prefix {hlen}/{plen}"
            raise TransportError(f"torch_dist {g.spec.name}: length prefix {hlen}/{plen} outside the spec's limits")
        g.bcast(g.header[:hlen], end - time.monotonic(), "header")
        header = bytes(g.header[:hlen].cpu().numpy())
        if not plen:
            return header, None
        g.bcast(g.payload[:plen], end - time.monotonic(), "payload")
        if g.host is not None:
            g.host[:plen].copy_(g.payload[:plen])
            return header, g.host[:plen].numpy()
        return header, g.payload[:plen].numpy()

    def release(self) -> None:
        pass  # the buffer is overwritten only by the next recv

    def reply(self, message: bytes, timeout_s: float) -> None:
        self.g.store.set(f"reply/{self.receiver}/{self._sent}", message)
        self._sent += 1
        self.g.store.add(f"reply/{self.receiver}/n", 1)

    def close(self) -> None:
        self.g.close()
