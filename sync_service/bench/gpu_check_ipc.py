"""Check 2 of ``gpu_check``: the ``cuda_ipc`` transport between two processes, against a D2D copy.

The sender (this process) fills each of its slots once with a distinct pattern and then publishes frames
from them (``reserve`` + ``send``: what a ``Sender`` does after ``fill``), so the figure is the transport's
hand-off plus the receiver's one copy out of the shared slot into its own buffer, per frame. The receiver
(a spawned process) reports its GB/s from its first data frame to its last release, and whether every frame's
bytes hashed to the xxh3_64 the sender put in the frame's header.
"""

from __future__ import annotations

import multiprocessing as mp
import struct
import time
import uuid

import torch

from sync_service.streaming.checksum import checksum
from sync_service.transports import TransportSpec, open_receiver, open_sender

def _receive(spec_bytes: bytes, frames: int, out) -> None:
    """Receiver process: copy every payload into a local buffer, verify the last ``slots`` frames' hashes."""
    spec = TransportSpec.from_bytes(spec_bytes)
    rx = open_receiver(spec, 0)
    try:
        dst = [torch.empty(spec.bucket_bytes, dtype=torch.uint8, device=spec.device) for _ in range(spec.slots)]
        want, t0, moved = [], None, 0
        for n in range(frames):
            header, payload = rx.recv(spec.op_timeout_s)
            t0 = t0 or time.perf_counter()
            src = payload if isinstance(payload, torch.Tensor) else torch.from_numpy(payload)
            dst[n % spec.slots][:len(payload)].copy_(src)
            moved += len(payload)
            want.append(struct.unpack("<Q", header)[0])
            rx.release()
        if spec.device != "cpu":
            torch.cuda.synchronize(spec.device)
        seconds = time.perf_counter() - t0
        intact = all(checksum(dst[n % spec.slots]) == want[n] for n in range(frames - spec.slots, frames))
        out.put((moved / seconds / 1e9, intact))
    except BaseException as exc:
        out.put((0.0, False))
        raise exc
    finally:
        rx.close()


def run_ipc(device: str, size_bytes: int, bucket_bytes: int, *, slots: int = 2) -> tuple[float, bool]:
    """``(GB/s the receiver process copied out, every checked frame intact)`` for ``size_bytes`` moved in
    buckets of ``bucket_bytes`` over a ``cuda_ipc`` channel with slots on ``device``. Blocks."""
    frames = max(slots + 1, -(-size_bytes // bucket_bytes))
    spec = TransportSpec(kind="cuda_ipc", name="gc" + uuid.uuid4().hex[:10], device=device, bucket_bytes=bucket_bytes,
                         slots=slots, max_header_bytes=4096, connect_timeout_s=120.0, op_timeout_s=120.0)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_receive, args=(spec.to_bytes(), frames, out), daemon=True)
    proc.start()
    tx = open_sender(spec, 0)
    try:
        sums = []
        for k in range(slots):  # each slot a distinct pattern, written once
            view = tx.reserve(spec.op_timeout_s)
            slot = view if isinstance(view, torch.Tensor) else torch.from_numpy(view)
            slot.copy_(torch.arange(bucket_bytes, device=slot.device, dtype=torch.int64).add_(k * 7).to(torch.uint8))
            sums.append(checksum(slot))
            tx.send(struct.pack("<Q", sums[k]), view, spec.op_timeout_s)
        for n in range(slots, frames):
            tx.send(struct.pack("<Q", sums[n % slots]), tx.reserve(spec.op_timeout_s), spec.op_timeout_s)
        result = out.get(timeout=spec.op_timeout_s)  # the receiver copied every frame: the slots may go
    finally:
        tx.close()
        proc.join(30)
    return result
