"""CUDA semantics the device transports rely on, in one place: initialization, device identity, binding, events.

What a CPU run cannot show, and what each function here answers (the CPU tests exercise every decision; what
only a GPU can confirm is listed in docs/deploy.md, "What the first GPU run must confirm"):

- **Initialize before mapping.** ``cudaIpcOpenMemHandle`` reads the per-device allocator state that CUDA's lazy
  initialization creates; torch's own receive path (``torch.multiprocessing.reductions.rebuild_cuda_tensor``)
  calls ``torch.cuda._lazy_init()`` before ``UntypedStorage._new_shared_cuda``. A spawned receiver whose first
  CUDA call is the map has not run it, so ``map_shared_slot`` initializes first (``torch.cuda.init()``, the
  public spelling of the same call).
- **Identity, not index.** Ray (and ``CUDA_VISIBLE_DEVICES``) renumber GPUs per process: device 0 of one actor
  may be device 1 of another. A device is named by its UUID (``torch.cuda.get_device_properties(i).uuid``);
  ``visible_index`` finds the sender's GPU among the receiver's, and refuses in one line when the receiver
  cannot see it (an IPC handle opens only on the GPU it was made on).
- **One rank per GPU under NCCL.** NCCL refuses two ranks of one communicator on one GPU (``ncclInvalidUsage``,
  "Duplicate GPU detected") deep inside the first collective; ``refuse_shared_gpu`` names the ranks and the fix
  before the group is made. Every rank binds its device (``torch.cuda.set_device``) before its group exists
  (``bind_device``), so NCCL's communicator and the current device agree.
- **Events, not device synchronization.** A sender records an interprocess ``torch.cuda.Event`` per slot on its
  own stream after filling the slot; the receiver's stream waits on that event (``wait_event``: no host block)
  before reading it; the receiver releases a slot after an event recorded on its own stream behind its reads
  completes (``Event.synchronize``: only that stream's work, never the whole device as
  ``torch.cuda.synchronize`` would, which waits for a training step or a generation it is not part of).
  ``SlotEvents`` is that protocol; on CPU (the transport's host flavour) the same calls are counted no-ops, so
  the plumbing — one record per sent frame, one wait per received frame, handles shared once — is tested here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from protocols.interfaces import TransportError

__all__ = ["SlotEvents", "bind_device", "device_uuid", "map_shared_slot", "refuse_shared_gpu", "visible_index"]


def device_uuid(device: torch.device | str) -> str:
    """The UUID of a CUDA device as this process numbers it (``"GPU-…"``-free hex string); ``""`` on CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return ""
    index = torch.cuda.current_device() if device.index is None else device.index
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_index(uuid: str, visible: Sequence[str], *, what: str) -> int:
    """The index, in this process's numbering, of the GPU named ``uuid`` among ``visible`` (each visible device's
    UUID, in index order).

    Raises:
        TransportError: this process cannot see that GPU (Ray pinned the two actors to different GPUs), naming
            both and the fix.
    """
    if uuid in visible:
        return list(visible).index(uuid)
    raise TransportError(f"{what}: the sender's slots live on GPU {uuid}, which this process cannot see (it sees "
                         f"{list(visible) or 'no GPU'}); a CUDA IPC handle opens only on its own GPU: place both actors "
                         "on the same GPU, or use transport='torch' (NCCL) between GPUs")


def map_shared_slot(handle: Sequence, *, init: Callable[[], None] | None = None,
                    new_shared: Callable[..., torch.UntypedStorage] | None = None) -> torch.Tensor:
    """The uint8 tensor over a device slot another process shared (``UntypedStorage._share_cuda_`` fields); maps
    it, no copy. CUDA is initialized first (see the module doc). ``init`` / ``new_shared`` default to torch's
    (``torch.cuda.init``, ``torch.UntypedStorage._new_shared_cuda``); the CPU tests pass recorders to check the order."""
    (init or torch.cuda.init)()
    storage = (new_shared or torch.UntypedStorage._new_shared_cuda)(*handle)
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def refuse_shared_gpu(uuids: Mapping[int, str], *, what: str) -> None:
    """Refuse an NCCL group where two ranks hold the same GPU (``uuids``: rank → its device UUID).

    Raises:
        TransportError: naming the ranks that share a GPU and the fix, before NCCL's own ``Duplicate GPU detected``.
    """
    by_gpu: dict[str, list[int]] = {}
    for rank, uuid in sorted(uuids.items()):
        by_gpu.setdefault(uuid, []).append(rank)
    shared = {u: r for u, r in by_gpu.items() if u and len(r) > 1}
    if shared:
        uuid, ranks = next(iter(shared.items()))
        raise TransportError(f"{what}: ranks {ranks} are on one GPU ({uuid}); NCCL needs one GPU per rank — give each "
                             "actor its own GPU (Ray num_gpus=1), or use backend='gloo' / transport='cuda_ipc' on one GPU")


def bind_device(device: torch.device | str) -> torch.device:
    """Make ``device`` this process's current CUDA device before a process group is made on it (NCCL binds its
    communicator to the current device); returns the device with its index. CPU: returned as it is."""
    device = torch.device(device)
    if device.type != "cuda":
        return device
    index = torch.cuda.current_device() if device.index is None else device.index
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class SlotEvents:
    """One interprocess event per slot: the producer records after filling, the consumer's stream waits before
    reading, and the consumer releases after its own reads completed — no whole-device synchronization.

    Sender: ``SlotEvents.create(device, n)``, ``handles()`` shipped once with the slot handles, ``record(k)`` after
    slot ``k`` is filled (on ``stream``, the sender's side stream). Receiver: ``SlotEvents.open(device, handles)``,
    ``wait(k)`` before reading slot ``k``, ``release(k)`` before handing it back. On CPU every call is a counted no-op
    (``records``, ``waits``, ``releases``: per slot), the host flavour of the transport runs the same calls.
    """

    def __init__(self, device: torch.device, events: list | None, count: int):
        self.device = device
        self._events = events  # torch.cuda.Event per slot (interprocess), or None on CPU
        self._done = [torch.cuda.Event() for _ in range(count)] if events is not None else None
        self.stream = torch.cuda.Stream(device) if events is not None else None
        """The sender's side stream (CUDA), on which its fills run and its events are recorded; ``None`` on CPU."""
        self.records, self.waits, self.releases = [0] * count, [0] * count, [0] * count

    @classmethod
    def create(cls, device: torch.device | str, count: int) -> "SlotEvents":
        """The sender's events, one per slot (CUDA: ``torch.cuda.Event(interprocess=True)``)."""
        device = torch.device(device)
        if device.type != "cuda":
            return cls(device, None, count)
        with torch.cuda.device(device):
            return cls(device, [torch.cuda.Event(interprocess=True) for _ in range(count)], count)

    @classmethod
    def open(cls, device: torch.device | str, handles: Sequence | None, count: int) -> "SlotEvents":
        """The receiver's view of a sender's events (``handles``: the sender's ``handles()``; ``None`` on CPU)."""
        device = torch.device(device)
        if device.type != "cuda" or handles is None:
            return cls(device, None, count)
        with torch.cuda.device(device):
            return cls(device, [torch.cuda.Event.from_ipc_handle(device, bytes(h)) for h in handles], count)

    def handles(self) -> list | None:
        """msgpack-able IPC handles of the events (``None`` on CPU)."""
        return None if self._events is None else [bytes(e.ipc_handle()) for e in self._events]

    def record(self, k: int) -> None:
        """Slot ``k`` is filled: record its event on the sender's current stream (its side stream inside ``use``)."""
        self.records[k] += 1
        if self._events is not None:
            self._events[k].record(torch.cuda.current_stream(self.device))

    def wait(self, k: int) -> None:
        """Before reading slot ``k``: this process's current stream waits for the sender's fill (no host block)."""
        self.waits[k] += 1
        if self._events is not None:
            torch.cuda.current_stream(self.device).wait_event(self._events[k])

    def release(self, k: int) -> None:
        """Before handing slot ``k`` back: block until this stream's reads of it, queued so far, have run."""
        self.releases[k] += 1
        if self._done is not None:
            self._done[k].record(torch.cuda.current_stream(self.device))
            self._done[k].synchronize()

    def inputs_ready(self) -> None:
        """At the start of a sync's stream: the side stream waits for the work queued so far on the caller's current
        stream (the snapshot of the factors, the base), once per sync, not per bucket, so a training step queued
        later on the default stream is never waited for. No-op on CPU."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def use(self):
        """Context that makes the side stream current (CUDA): the fills of the slots run there; a no-op on CPU."""
        return _Null() if self.stream is None else torch.cuda.stream(self.stream)


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
