"""Ray actors and helpers of the transport conformance suite: a rollout-engine peer (receiver) and a
trainer peer (sender), each in its own process, plus deterministic tensor sets and frame forging."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import ray
import torch

from protocols.wire import Begin, BucketHeader, Commit, encode, plan_digest
from protocols.wire_check import decode
from sync_service.dtypes import TORCH_DTYPES
from sync_service.engines.memory import MemoryEngine
from sync_service.streaming import BucketPool, BucketReceiver, Sender, TensorSource, buckets_of
from sync_service.streaming.checksum import checksum
from sync_service.streaming.sender import pack_bucket
from sync_service.streaming.views import as_byte_tensor
from sync_service.transports import TransportSpec, open_receiver, open_sender


def make_tensors(specs: list[tuple[str, str, list[int], bool]], seed: int) -> dict[str, torch.Tensor]:
    """Tensors from ``(name, dtype, shape, non_contiguous)`` with random bytes (NaNs included:
    comparisons are bitwise). A non-contiguous tensor is every other row of a taller one."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, dtype, shape, strided in specs:
        dt = TORCH_DTYPES[dtype]
        full = [shape[0] * 2] + list(shape[1:]) if strided and shape else list(shape)
        n = int(np.prod(full)) if full else 1
        raw = torch.randint(0, 256, (n * dt.itemsize,), dtype=torch.uint8, generator=g)
        t = raw.view(dt).reshape(full)
        out[name] = t[::2] if strided and shape else t
    return out


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's values as bytes, row-major (bitwise comparison: NaN payloads included)."""
    if t.numel() == 0:
        return b""
    return t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8).numpy().tobytes()


class FailingEngine(MemoryEngine):
    """A MemoryEngine whose ``apply`` raises once on a chosen name (a receiver failing mid-sync); counts
    its ``finish_update`` calls (the receiver finishes once per sync)."""

    fail_on: str | None = None
    finish_calls: int = 0

    def finish_update(self):
        self.finish_calls += 1
        return super().finish_update()

    def apply(self, name, box, data):
        if name == self.fail_on:
            self.fail_on = None
            raise RuntimeError(f"injected engine failure while applying {name}")
        super().apply(name, box, data)


class SlowSource(TensorSource):
    """A TensorSource that sleeps in every ``fill`` (keeps a sync in flight long enough to kill a peer)."""

    def __init__(self, tensors, delay_s: float):
        super().__init__(tensors)
        self.delay_s = delay_s

    def fill(self, name, box, out):
        time.sleep(self.delay_s)
        super().fill(name, box, out)


@ray.remote(num_cpus=0, max_concurrency=2)
class EnginePeer:
    """A rollout engine process: MemoryEngine + BucketReceiver over a transport opened from a spec."""

    def __init__(self):
        self.rx = self.engine = self.plan = None

    def pid(self) -> int:
        import os
        return os.getpid()

    def open(self, spec_bytes: bytes, receiver: int) -> None:
        self.close()
        self.rx, self.receiver = open_receiver(TransportSpec.from_bytes(spec_bytes), receiver), receiver

    def load(self, plan_bytes: bytes, specs, seed: int) -> None:
        """A fresh engine holding ``make_tensors(specs, seed)`` values and the given plan."""
        self.engine = FailingEngine(make_tensors(specs, seed))
        self.plan = decode(plan_bytes)

    def fail_next(self, name: str) -> None:
        self.engine.fail_on = name

    def receive(self, timeout_s: float) -> dict:
        t = time.monotonic()
        try:
            stats = BucketReceiver(self.engine, self.plan, receiver=self.receiver).receive_sync(
                self.rx, timeout_s=timeout_s, commit=True)
            return {"ok": True, "version": stats.version, "bytes": stats.payload_bytes, "s": time.monotonic() - t}
        except Exception as exc:
            return {"ok": False, "type": type(exc).__name__, "field": getattr(exc, "field", ""), "text": str(exc),
                    "s": time.monotonic() - t}

    def state(self) -> tuple[int | None, dict[str, bytes], int]:
        return self.engine.weight_version(), {n: raw_bytes(t) for n, t in self.engine.state_dict().items()}, \
            self.engine.finish_calls

    def close(self) -> None:
        if self.rx is not None:
            self.rx.close()
            self.rx = None


@ray.remote(num_cpus=0)
class TrainerPeer:
    """A trainer process streaming a slow sync (killed mid-sync by the test)."""

    def open(self, spec_bytes: bytes) -> None:
        self.tx = open_sender(TransportSpec.from_bytes(spec_bytes), 0)

    def send(self, plan_bytes: bytes, specs, seed: int, delay_s: float) -> None:
        plan = decode(plan_bytes)
        Sender(self.tx, BucketPool(bucket_bytes=plan.bucket_bytes)).send_sync(
            "dying", 1, SlowSource(make_tensors(specs, seed), delay_s), plan, timeout_s=60)


def forge_frames(plan, source, session: str, version: int, sender: int = 0) -> list[tuple[bytes, np.ndarray | None]]:
    """The frames a correct Sender would send for ``plan``, built by hand so tests can tamper."""
    buckets = buckets_of(plan, sender)
    frames = [(encode(Begin(session=session, version=version, sender=sender, plan_digest=plan_digest(plan),
                            num_buckets=len(buckets))), None)]
    total = 0
    for seq, entries in enumerate(buckets):
        arr = np.zeros(plan.bucket_bytes, dtype=np.uint8)
        n = pack_bucket(source, entries, as_byte_tensor(arr))
        payload = arr[:n].copy()
        total += n
        frames.append((encode(BucketHeader(session=session, version=version, sender=sender, seq=seq, entries=entries,
                                           payload_nbytes=n, checksum=checksum(payload))), payload))
    frames.append((encode(Commit(session=session, version=version, sender=sender, num_buckets=len(buckets),
                                 payload_bytes=total)), None))
    return frames


def pack_specs(specs) -> bytes:
    return msgpack.packb(specs)
