"""Same-node device transport: each sender's bucket slots live on its device, allocated once and shared once.

A sender allocates ``spec.slots`` buffers of ``spec.bucket_bytes`` on ``spec.device`` when it opens and
hands every receiver one handle per buffer, once: a CUDA IPC handle (``UntypedStorage._share_cuda_``)
for ``"cuda"``, or, for ``"cpu"`` (the same class, what runs without a GPU), the path and offset of the slot in
one shm segment of the sender (``shm_files.create_owned``: named for its owner's pid, swept once it is gone). Not
torch's ``file_system`` sharing: its ``torch_shm_manager`` dies with the sender's process group, and a receiver
then aborts (``std::system_error: Broken pipe``) when it frees a slot. No handle and no allocation per bucket.

Everything else is the shared-memory ring of ``shm.py``, reused as it is over a ring whose payload is a
16-byte slot note (a ``ShmSender`` / ``ShmReceiver`` per side): frame numbers, flow control (a slot is
reused only after every receiver released it), replies, dead-peer detection, segment cleanup. Frame
``n`` of sender ``s`` carries its payload in device slot ``n % slots`` of ``s``; the ring frame carries
the header and the note ``(payload bytes, sender, n)``. The bucket MAC, checksum, sequence numbers and the
two-phase commit are the streaming layer's, identical for every transport.

Zero copy on both ends: ``reserve`` lends the next frame's device slot (the ``Sender`` fills it in place:
the bucket *is* the slot); ``recv`` returns a view of the slot (a numpy array on CPU, a CUDA uint8 tensor
on a GPU), valid until ``release``. On CUDA the sender synchronizes its device before publishing a frame,
and a receiver before releasing one, so neither side reads or overwrites a slot the other still uses.

Frame 0 of every sender is its handles (``_HANDLES`` + msgpack), read by every receiver while it opens:
a channel's senders send nothing else before every receiver opened (the coordinator's open round).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import deque

import msgpack
import numpy as np
import torch

from protocols.interfaces import TransportError
from sync_service.transports.shm import ShmReceiver, ShmSender
from sync_service.transports.shm_files import create_owned, map_owned, unlink
from sync_service.transports.spec import TransportSpec

_HANDLES = b"\x00weightsync-ipc-handles\x00"
_NOTE = 3  # uint64 words of a ring payload: payload bytes, sender, frame number
_NOTE_BYTES = 64  # the ring's bucket_bytes (a note, one cache line)


def _ring_spec(spec: TransportSpec) -> TransportSpec:
    """The shm ring carrying headers, slot notes and replies of ``spec``'s channel."""
    return dataclasses.replace(spec, kind="shm", bucket_bytes=_NOTE_BYTES)


def _address(buf) -> int:
    """The first byte's address of a numpy array or tensor (``-1``: neither)."""
    if isinstance(buf, np.ndarray):
        return buf.__array_interface__["data"][0]
    return buf.data_ptr() if isinstance(buf, torch.Tensor) else -1


def share(slot: torch.Tensor) -> list:
    """The msgpack-able CUDA IPC handle of a device slot's storage."""
    return list(slot.untyped_storage()._share_cuda_())


def open_shared(handle: list) -> torch.Tensor:
    """The uint8 tensor over a device slot another process shared with ``share`` (maps it; no copy)."""
    storage = torch.UntypedStorage._new_shared_cuda(*handle)
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _host_slots(spec: TransportSpec, sender: int) -> tuple[list[torch.Tensor], list, str]:
    """``spec.slots`` host slots in one new shm segment: the slots, their handles ``[path, offset]``, the path."""
    mm, path = create_owned(f"{spec.name}-s{sender}-slots", spec.slots * spec.bucket_bytes)
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    size = spec.bucket_bytes
    return [whole[i * size:(i + 1) * size] for i in range(spec.slots)], [[path, i * size] for i in range(spec.slots)], path


def _open_host_slots(handles: list, spec: TransportSpec) -> list[torch.Tensor]:
    """Map the sender's segment once; a slot per handle.

    Raises: TransportError: the handles do not name one weightsync segment at slot offsets."""
    paths = {h[0] for h in handles}
    size = spec.bucket_bytes
    if len(paths) != 1 or any(h[1] != i * size for i, h in enumerate(handles)):
        raise TransportError(f"cuda_ipc {spec.name}: bad host slot handles {handles!r}")
    whole = torch.frombuffer(map_owned(paths.pop(), spec.slots * size), dtype=torch.uint8)
    return [whole[i * size:(i + 1) * size] for i in range(spec.slots)]


def _copy_into(view, payload) -> None:
    """Copy the 1-D uint8 ``payload`` (numpy array, buffer or tensor) to the front of the slot ``view``."""
    size = len(payload)
    if isinstance(view, np.ndarray):
        src = payload.numpy() if isinstance(payload, torch.Tensor) else payload
        np.copyto(view[:size], src if isinstance(src, np.ndarray) else np.frombuffer(src, dtype=np.uint8))
    else:
        src = payload if isinstance(payload, torch.Tensor) else torch.from_numpy(np.array(payload, dtype=np.uint8))
        view[:size].copy_(src)


def _synchronize(slot: torch.Tensor) -> None:
    if slot.is_cuda:
        torch.cuda.synchronize(slot.device)


class IpcSender:
    """Sender side: ``spec.slots`` device buffers shared once, frames published through a shm ring."""

    def __init__(self, spec: TransportSpec, sender: int = 0):
        self.spec, self.sender = spec, sender
        device = torch.device(spec.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise TransportError(f"cuda_ipc {spec.name}: TransportSpec.device={spec.device!r} but this process sees "
                                 "no CUDA device; use device='cpu' or the 'shm' transport")
        if device.type == "cuda":
            self.slots = [torch.empty(spec.bucket_bytes, dtype=torch.uint8, device=device) for _ in range(spec.slots)]
            handles = [share(s) for s in self.slots]
            for s in self.slots:
                s.fill_(1)  # touch every page (device memory) once, here
            self._unlink_slots = None
        else:  # host slots: every page reserved and touched by create_owned
            self.slots, handles, path = _host_slots(spec, sender)
            self._unlink_slots = weakref.finalize(self, unlink, path)  # the name goes with this sender
        self._views = [s if s.is_cuda else s.numpy() for s in self.slots]
        self.ring = ShmSender(_ring_spec(spec), sender)
        self._reserved: deque[np.ndarray] = deque()  # ring note areas of frames reserved, not yet sent
        self._sent = 0  # frames published (mirrors the ring's write sequence)
        info = {"sender": sender, "cuda": device.type == "cuda", "bytes": spec.bucket_bytes, "handles": handles}
        self._publish(_HANDLES + msgpack.packb(info), None, spec.connect_timeout_s)

    @property
    def num_receivers(self) -> int:
        return self.spec.num_receivers

    def reserve(self, timeout_s: float):
        """The writable device slot (uint8, ``bucket_bytes``: numpy on CPU, a tensor on CUDA) of the next
        frame; blocks until every receiver released it. Fill it, then ``send(header, view[:n])``: no copy."""
        n = self._sent + len(self._reserved)
        self._reserved.append(self.ring.reserve(timeout_s))
        return self._views[n % len(self.slots)]

    def send(self, header: bytes, payload, timeout_s: float) -> None:
        """Publish one frame. ``payload`` is the slot ``reserve`` lent for this frame (no copy), any other
        1-D uint8 buffer (copied into the slot), or ``None`` (control frame: drops reservations not yet sent,
        as the shm ring does)."""
        if payload is None or len(payload) == 0:
            self._publish(header, None, timeout_s)
            return
        if len(payload) > self.spec.bucket_bytes:
            raise ValueError(f"payload of {len(payload)} bytes > bucket_bytes={self.spec.bucket_bytes}")
        n = self._sent
        slot = self.slots[n % len(self.slots)]
        if not self._reserved:
            self._reserved.append(self.ring.reserve(timeout_s))  # waits until the slot is free
        if _address(payload) != slot.data_ptr():
            _copy_into(self._views[n % len(self.slots)], payload)
        _synchronize(slot)  # the fill (or copy) has landed before a receiver can see the frame
        note = self._reserved.popleft()
        note[:8 * _NOTE].view(np.uint64)[:] = (len(payload), self.sender, n)
        self.ring.send(header, note[:8 * _NOTE], timeout_s)
        self._sent += 1

    def _publish(self, header: bytes, payload, timeout_s: float) -> None:
        self._reserved.clear()  # the ring drops reservations on a frame without its reserved payload
        self.ring.send(header, payload, timeout_s)
        self._sent += 1

    def poll_reply(self, timeout_s: float) -> bytes | None:
        return self.ring.poll_reply(timeout_s)

    def close(self) -> None:
        """Close the ring (receivers see the sender gone); the slots go when every process dropped them."""
        self.ring.close()
        self._reserved.clear()
        if self._unlink_slots is not None:
            self._unlink_slots()


class IpcReceiver:
    """Receiver side: maps every sender's slots once (at open), then reads frames in place."""

    def __init__(self, spec: TransportSpec, receiver: int = 0):
        self.spec, self.receiver = spec, receiver
        self.ring = ShmReceiver(_ring_spec(spec), receiver)
        self.slots: list[list[torch.Tensor]] = [[] for _ in range(spec.num_senders)]
        self._views: list[list] = [[] for _ in range(spec.num_senders)]
        self._held: deque[torch.Tensor] = deque()
        try:
            for _ in range(spec.num_senders):
                self._attach(spec.connect_timeout_s)
        except BaseException:
            self.ring.close()
            raise

    @property
    def max_held(self) -> int:
        return self.ring.max_held

    def _attach(self, timeout_s: float) -> None:
        """Read one sender's handles frame (its frame 0) and map its slots.

        Raises: TransportError: another frame came first, or a spec mismatch."""
        header, _ = self.ring.recv(timeout_s)
        self.ring.release()
        if not header.startswith(_HANDLES):
            raise TransportError(f"cuda_ipc {self.spec.name}: a frame came before a sender's slot handles (a sender "
                                 "sent before every receiver opened the channel)")
        info = msgpack.unpackb(header[len(_HANDLES):], raw=False)
        s = info["sender"]
        if info["bytes"] != self.spec.bucket_bytes or len(info["handles"]) != self.spec.slots or self.slots[s]:
            raise TransportError(f"cuda_ipc {self.spec.name}: sender {s}'s slots ({len(info['handles'])} x "
                                 f"{info['bytes']} B) do not match the spec ({self.spec.slots} x {self.spec.bucket_bytes} B)")
        self.slots[s] = ([open_shared(h) for h in info["handles"]] if info["cuda"]
                         else _open_host_slots(info["handles"], self.spec))
        self._views[s] = [t if t.is_cuda else t.numpy() for t in self.slots[s]]

    def recv(self, timeout_s: float):
        """The next frame; its payload is a view of the sender's slot, valid until its ``release``."""
        if len(self._held) >= self.max_held:
            self.release()
        header, note = self.ring.recv(timeout_s)
        if note is None:
            self._held.append(None)
            return header, None
        size, s, n = (int(x) for x in note[:8 * _NOTE].view(np.uint64))
        if not 0 <= s < len(self.slots) or not self.slots[s] or size > self.spec.bucket_bytes:
            self._held.append(None)  # released with the ring's frame, in order
            raise TransportError(f"cuda_ipc {self.spec.name}: bad slot note (sender {s}, {size} bytes)")
        self._held.append(self.slots[s][n % len(self.slots[s])])
        return header, self._views[s][n % len(self._views[s])][:size]

    def release(self) -> None:
        """Frees the oldest held frame's slot (after this device finished reading it); thread-safe as the ring."""
        if self._held:
            slot = self._held.popleft()
            if slot is not None:
                _synchronize(slot)
            self.ring.release()

    def reply(self, message: bytes, timeout_s: float) -> None:
        self.ring.reply(message, timeout_s)

    def close(self) -> None:
        self._held.clear()
        self.ring.close()
        self.slots = self._views = []
