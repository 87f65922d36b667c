"""Where a trainer's sync keeps its bytes, CPU and CUDA alike: one table per question, no CUDA-only code path.

- weightsync's own process group (the gathers of sharded LoRA factors): the backend of the parameters' device,
  ``spec.AUTO_BACKEND`` (``{"cuda": "nccl", "cpu": "gloo"}``); its collectives take tensors on
  ``GROUP_DEVICES[backend]``.
- a transport's buckets: ``BUCKET_DEVICES[spec.kind]`` — device buckets for ``cuda_ipc`` on a GPU and
  ``torch_dist`` under NCCL, host buckets for ``shm``, ``ray`` and ``torch_dist`` under gloo.
- the merge: where the base lives (the parameters' device). When the buckets live elsewhere,
  ``stage_device`` names a staging bucket on the merge device, allocated once; each filled bucket is then
  copied into the transport's bucket in one copy (host buckets a sender allocates are pinned when CUDA is
  available: ``streaming.pool.host_buffer``).

On CPU every answer is ``cpu`` / ``gloo`` and no staging bucket exists: the CPU path is the same functions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sync_service.transports.spec import AUTO_BACKEND, TransportSpec

__all__ = ["BUCKET_DEVICES", "GROUP_DEVICES", "bucket_device", "group_backend", "group_device", "stage_device"]

GROUP_DEVICES: dict[str, str] = {backend: device for device, backend in AUTO_BACKEND.items()}
"""torch.distributed backend → the device type its collectives take tensors on (the inverse of ``AUTO_BACKEND``)."""

BUCKET_DEVICES: dict[str, Callable[[TransportSpec], str]] = {
    "shm": lambda spec: "cpu",                                # host shared-memory ring slots
    "ray": lambda spec: "cpu",                                # host arrays put into the object store
    "torch_dist": lambda spec: GROUP_DEVICES[spec.backend],   # NCCL broadcasts device buffers, gloo host ones
    "cuda_ipc": lambda spec: spec.device,                     # slots on the spec's device (CPU flavour: host)
}
"""``TransportSpec.kind`` → where that transport wants a sender's bucket bytes (a device string)."""


def group_backend(device: torch.device | str) -> str:
    """The backend of weightsync's own process group for parameters on ``device``: ``"nccl"`` for CUDA, ``"gloo"``
    for CPU (``spec.AUTO_BACKEND``).

    Raises:
        ValueError: a device type neither backend moves (``meta``, ``mps``, ...), naming it and the fix.
    """
    kind = torch.device(device).type
    if kind not in AUTO_BACKEND:
        raise ValueError(f"attach_trainer: the model's parameters are on {kind!r}; weightsync's group runs on "
                         f"{sorted(AUTO_BACKEND)} tensors — move the model to one of them, or pass group=")
    return AUTO_BACKEND[kind]


def group_device(backend: str) -> torch.device:
    """The device a ``backend`` group's collectives take tensors on (``"cuda"``: the current CUDA device). A
    backend string naming several (``"cpu:gloo,cuda:nccl"``) or an unknown one takes host tensors."""
    kind = GROUP_DEVICES.get(str(backend), "cpu")
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")


def bucket_device(spec: TransportSpec) -> torch.device:
    """Where ``spec``'s transport wants a sender's bucket bytes (``BUCKET_DEVICES``)."""
    return torch.device(BUCKET_DEVICES[spec.kind](spec))


def stage_device(merge: torch.device | str, bucket: torch.device | str) -> torch.device | None:
    """The device of a sender's staging bucket: ``merge`` (where the base lives) when the buckets live elsewhere,
    else ``None`` (the merge writes straight into the transport's bucket). ``"cuda"`` and the current
    ``"cuda:N"`` are the same device."""
    merge, bucket = torch.device(merge), torch.device(bucket)
    return None if _same(merge, bucket) else merge


def _same(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)
