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

Zero copy on both ends: ``reserve`` lends the next frame's device slot (the ``Sender`` fills it in place, on the
sender's side stream, inside ``filling()``: the bucket *is* the slot); ``recv`` returns a view of the slot (a numpy
array on CPU, a CUDA uint8 tensor on a GPU), valid until ``release``. Neither side synchronizes its device: one
interprocess CUDA event per slot (``cuda_device.SlotEvents``), shared once with the slot handles, is recorded by
the sender after the fill and waited on by the receiver's stream before it reads; the receiver hands a slot back
after an event behind its own reads completed. So a push does not wait for the training step it overlaps, nor
an engine's release for its generation. The receiver initializes CUDA before it maps a slot and maps it on the
sender's GPU, found by UUID (``cuda_device``); a receiver that cannot see that GPU is refused in one line.

On CUDA the payload is not hashed (``TransportSpec.hashes_payload``): the slot is the sender's own device memory,
mapped, never on a wire, and hashing it would copy every byte across PCIe (~10 GB/s) on one core, slower than
the transport itself. The header, with its MAC, sequence number, entries and payload size, is checked as on
every transport; the host flavour hashes as ``shm`` does.

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
from sync_service.transports.cuda_device import SlotEvents, device_uuid, map_shared_slot, visible_index
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
    """The uint8 tensor over a device slot another process shared with ``share`` (maps it; no copy; CUDA is
    initialized first: ``cuda_device.map_shared_slot``)."""
    return map_shared_slot(handle)


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
            torch.cuda.synchronize(device)  # once, at open: the touch has landed before any receiver maps a slot
            self._unlink_slots = None
        else:  # host slots: every page reserved and touched by create_owned
            self.slots, handles, path = _host_slots(spec, sender)
            self._unlink_slots = weakref.finalize(self, unlink, path)  # the name goes with this sender
        self._views = [s if s.is_cuda else s.numpy() for s in self.slots]
        self.events = SlotEvents.create(self.slots[0].device, len(self.slots))
        self.ring = ShmSender(_ring_spec(spec), sender)
        self._reserved: deque[np.ndarray] = deque()  # ring note areas of frames reserved, not yet sent
        self._sent = 0  # frames published (mirrors the ring's write sequence)
        info = {"sender": sender, "cuda": device.type == "cuda", "bytes": spec.bucket_bytes, "handles": handles,
                "events": self.events.handles(), "uuid": device_uuid(self.slots[0].device)}
        self._publish(_HANDLES + msgpack.packb(info), None, spec.connect_timeout_s)

    @property
    def num_receivers(self) -> int:
        return self.spec.num_receivers

    @property
    def hashes_payload(self) -> bool:
        """False for device slots: the payload is not hashed, the header MAC still checked (module doc)."""
        return not self.slots[0].is_cuda

    def filling(self):
        """Context the ``Sender`` fills reserved slots in: the side stream on CUDA (``SlotEvents.use``), else a no-op."""
        return self.events.use()

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
            with self.events.use():
                _copy_into(self._views[n % len(self.slots)], payload)
        with self.events.use():
            self.events.record(n % len(self.slots))  # the receiver's stream waits for it before reading the slot
        note = self._reserved.popleft()
        note[:8 * _NOTE].view(np.uint64)[:] = (len(payload), self.sender, n)
        self.ring.send(header, note[:8 * _NOTE], timeout_s)
        self._sent += 1

    def _publish(self, header: bytes, payload, timeout_s: float) -> None:
        self._reserved.clear()  # the ring drops reservations on a frame without its reserved payload
        self.events.inputs_ready()  # a control frame (Begin) starts a stream: its fills follow the caller's inputs
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
        self.events: list[SlotEvents | None] = [None] * spec.num_senders
        self._held: deque[tuple[int, int] | None] = deque()  # (sender, slot) of each held frame
        try:
            for _ in range(spec.num_senders):
                self._attach(spec.connect_timeout_s)
        except BaseException:
            self.ring.close()
            raise

    @property
    def max_held(self) -> int:
        return self.ring.max_held

    @property
    def hashes_payload(self) -> bool:
        """False when a sender's slots are device memory (the sender sends no payload hash: module doc)."""
        return not any(slots and slots[0].is_cuda for slots in self.slots)

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
        if info["cuda"]:
            what = f"cuda_ipc {self.spec.name}"
            visible = [device_uuid(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
            device = torch.device("cuda", visible_index(info["uuid"], visible, what=what))
            with torch.cuda.device(device):
                self.slots[s] = [open_shared(h) for h in info["handles"]]
        else:
            device = torch.device("cpu")
            self.slots[s] = _open_host_slots(info["handles"], self.spec)
        self.events[s] = SlotEvents.open(device, info.get("events"), len(self.slots[s]))
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
        k = n % len(self.slots[s])
        self.events[s].wait(k)  # this process's stream runs its reads after the sender's fill
        self._held.append((s, k))
        return header, self._views[s][k][:size]

    def release(self) -> None:
        """Frees the oldest held frame's slot (after this stream's reads of it ran); thread-safe as the ring."""
        if self._held:
            held = self._held.popleft()
            if held is not None:
                self.events[held[0]].release(held[1])  # this stream's reads of the slot have run
            self.ring.release()

    def reply(self, message: bytes, timeout_s: float) -> None:
        self.ring.reply(message, timeout_s)

    def close(self) -> None:
        self._held.clear()
        self.ring.close()
        self.slots = self._views = []
