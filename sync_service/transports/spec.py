"""``TransportSpec``: everything a process needs to open its side of a transport (msgpack-able).

A coordinator makes one spec per channel and ships ``spec.to_bytes()`` to the trainer shards
(``open_sender(spec, sender=rank)``) and to every rollout engine (``open_receiver(spec, receiver=i)``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import msgpack

KINDS: dict[str, tuple[str, str, str]] = {
    "shm": ("sync_service.transports.shm", "ShmSender", "ShmReceiver"),
    "ray": ("sync_service.transports.ray_store", "RaySender", "RayReceiver"),
    "torch_dist": ("sync_service.transports.torch_dist", "DistSender", "DistReceiver"),
    "cuda_ipc": ("sync_service.transports.cuda_ipc", "IpcSender", "IpcReceiver"),
}
"""``TransportSpec.kind`` → (module, sender class, receiver class); the module is imported on first use."""


@dataclass(frozen=True, slots=True)
class TransportChoice:
    """The spec kinds one ``SyncConfig.transport`` value uses."""

    push: str
    """``TransportSpec.kind`` of a push (trainer shards → every engine)."""
    join: str
    """``TransportSpec.kind`` of a late joiner's peer copy (torch.distributed needs a rendezvous port per
    channel; the object store reaches any host without one)."""
    max_senders: int | None = None
    """Trainer shards one push channel carries (``TransportSpec.num_senders``); ``None``: any number."""
    relays: bool = False
    """Whether the push kind relays frames receiver to receiver (``TransportSpec.relay="chain"``)."""


TRANSPORTS: dict[str, TransportChoice] = {
    "shm": TransportChoice(push="shm", join="shm"),
    "ray": TransportChoice(push="ray", join="ray", relays=True),
    "torch": TransportChoice(push="torch_dist", join="ray", max_senders=1),
    "cuda_ipc": TransportChoice(push="cuda_ipc", join="cuda_ipc"),
}
"""``SyncConfig.transport`` (and the CLIs' ``--transport``) → the spec kinds it uses."""

DEVICES = ("cpu", "cuda")
"""``TransportSpec.device`` / ``SyncConfig.device`` values: where bucket buffers live (``"cuda"``: the
process's current CUDA device)."""

AUTO_TRANSPORT: dict[tuple[bool, str], str] = {
    (True, "cuda"): "cuda_ipc",   # same node, GPU buckets: device slots shared once by CUDA IPC handles
    (False, "cuda"): "torch",     # other node, GPU buckets: torch.distributed with NCCL
    (True, "cpu"): "shm",         # same node, CPU buckets: the shared-memory ring (today's default)
    (False, "cpu"): "ray",        # other node, CPU buckets: the object store (N senders, relays)
}
"""(engines on the trainers' node?, bucket device) → the ``SyncConfig.transport`` that fits it best: the one
table of which transport serves which topology (docs/deploy.md, "GPU set-up")."""

AUTO_BACKEND: dict[str, str] = {"cuda": "nccl", "cpu": "gloo"}
"""Bucket device → the torch.distributed backend ``backend="auto"`` uses (NCCL moves CUDA tensors, gloo CPU ones)."""

BACKENDS = ("auto", "gloo", "nccl")
"""``SyncConfig.backend`` values."""


def auto_transport(same_node: bool, device: str) -> str:
    """The ``SyncConfig.transport`` for engines on the trainers' node (``same_node``) or not, with buckets on
    ``device`` (``"cpu"`` / ``"cuda"``, or ``"cuda:N"``). Raises ValueError naming the device and the fix."""
    return AUTO_TRANSPORT[(bool(same_node), _device_type(device, "SyncConfig.device"))]


def resolve_backend(backend: str, device: str) -> str:
    """``"gloo"`` / ``"nccl"`` for ``SyncConfig.backend`` (``"auto"``: from ``AUTO_BACKEND``) and buckets on
    ``device``. Raises ValueError naming the field and the fix (an unknown value; ``"nccl"`` with CPU buckets)."""
    kind = _device_type(device, "SyncConfig.device")
    if backend not in BACKENDS:
        raise ValueError(f"SyncConfig.backend={backend!r}; use one of {BACKENDS} ('auto': nccl for CUDA buckets, "
                         f"gloo otherwise)")
    if backend == "nccl" and kind != "cuda":
        raise ValueError("SyncConfig.backend='nccl' moves CUDA tensors only, but SyncConfig.device="
                         f"{device!r}; set device='cuda', or backend='gloo' / 'auto'")
    return AUTO_BACKEND[kind] if backend == "auto" else backend


def _device_type(device: str, field_name: str) -> str:
    """``"cpu"`` / ``"cuda"`` for a device string; ValueError naming ``field_name`` otherwise."""
    kind = device.split(":", 1)[0] if isinstance(device, str) else None
    if kind not in DEVICES or (kind == "cpu" and device != "cpu") or (":" in device and not device.split(":", 1)[1].isdigit()):
        raise ValueError(f"{field_name}={device!r}; use 'cpu', 'cuda' or 'cuda:N'")
    return kind

RELAYS = ("auto", "direct", "chain")
"""``TransportSpec.relay`` / ``SyncConfig.relay`` values."""


@dataclass(kw_only=True, slots=True)
class TransportSpec:
    kind: str
    """Transport: ``"shm"`` (same host), ``"ray"`` (object store), ``"torch_dist"`` (gloo/NCCL broadcast),
    ``"cuda_ipc"`` (same host, device slots shared by IPC handles)."""
    name: str
    """Unique channel name: shm segment prefix, Ray actor name prefix, TCPStore key prefix."""
    num_senders: int = 1
    """Senders (trainer shards) feeding every receiver; ``torch_dist`` supports 1."""
    num_receivers: int = 1
    """Receivers (rollout engines); every frame goes to all of them."""
    bucket_bytes: int = 256 << 20
    """Largest payload, bytes (the plan's bucket size)."""
    max_header_bytes: int = 1 << 20
    """Largest encoded header, bytes."""
    slots: int = 2
    """Frames in flight per sender (shm ring slots, Ray mailbox depth)."""
    connect_timeout_s: float = 60.0
    """How long opening a side waits for its peers (segment, mailbox, rendezvous)."""
    address: str = "127.0.0.1"
    """``torch_dist``: host of the rendezvous store; each rank's gloo connections listen on its own
    host's address on the route to it (the same address when every rank is on the store's host)."""
    port: int = 0
    """``torch_dist``: port of the rendezvous store (``host_channel`` starts one and fills it in;
    0: not hosted yet)."""
    auth_key: bytes = field(default_factory=lambda: os.urandom(32), repr=False)
    """``torch_dist``: key a process must prove to the rendezvous store (HMAC challenge); random per
    spec, so only the processes handed this spec can join the channel. Never printed."""
    backend: str = "gloo"
    """``torch_dist``: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors); ``resolve_backend`` turns
    ``SyncConfig.backend`` (``"auto"`` too) into one of them."""
    device: str = "cpu"
    """``cuda_ipc``: where the sender's bucket slots live, allocated once and shared once: ``"cuda"`` /
    ``"cuda:N"`` (a CUDA IPC handle per slot), or ``"cpu"`` (the same class over torch's shared memory)."""
    op_timeout_s: float = 60.0
    """``torch_dist``: timeout of one collective, seconds (a dead peer fails within it)."""
    relay: str = "auto"
    """How every frame reaches several receivers. ``"direct"``: each receiver takes it from the senders
    (over a shared link, once per receiver). ``"chain"``: the senders hand it to receiver 0 only, and
    receiver k relays it to receiver k + 1 as soon as it has it (the senders' link carries each byte
    once; each hop adds about one bucket of latency). ``"auto"``: chain when the receivers sit on >= 2
    nodes that host no sender, else direct. Only ``ray`` relays (``TransportChoice.relays``); the other
    kinds send directly whatever this says."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"TransportSpec.kind={self.kind!r}; use one of {tuple(KINDS)}")
        if not self.name or "/" in self.name or len(self.name) > 64:
            raise ValueError(f"TransportSpec.name={self.name!r}: 1-64 chars, no '/'")
        for f in ("num_senders", "num_receivers", "bucket_bytes", "max_header_bytes", "slots"):
            if type(getattr(self, f)) is not int or getattr(self, f) < 1:
                raise ValueError(f"TransportSpec.{f}={getattr(self, f)!r} must be an int >= 1")
        if type(self.port) is not int or not 0 <= self.port <= 65535:
            raise ValueError(f"TransportSpec.port={self.port!r} must be an int in [0, 65535]")
        if not isinstance(self.auth_key, bytes) or len(self.auth_key) < 16:
            raise ValueError("TransportSpec.auth_key must be bytes of >= 16 (default: a fresh random key)")
        if self.relay not in RELAYS:
            raise ValueError(f"TransportSpec.relay={self.relay!r}; use one of {RELAYS}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"TransportSpec.backend={self.backend!r}; use 'gloo' or 'nccl'")
        _device_type(self.device, "TransportSpec.device")

    def to_bytes(self) -> bytes:
        return msgpack.packb({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @classmethod
    def from_bytes(cls, data: bytes) -> "TransportSpec":
        """Raises ValueError on unknown fields or bad values."""
        raw = msgpack.unpackb(data, raw=False)
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(raw, dict) or set(raw) - known:
            raise ValueError(f"TransportSpec: unknown fields {sorted(set(raw) - known) if isinstance(raw, dict) else raw!r}")
        return cls(**raw)
