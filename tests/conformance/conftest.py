"""Fixtures of the transport conformance suite: one local Ray per module, two engine processes
(Ray actors) reused by every test, and a channel per test over each transport kind."""

from __future__ import annotations

import uuid

import pytest
import ray
import torch

from sync_service.transports import TransportSpec, host_channel, open_sender
from tests.conformance.peers import EnginePeer
from tests.ray_session import local_ray

KINDS = ["shm", "ray", "torch_dist", "cuda_ipc-cpu", "cuda_ipc", "torch_dist-nccl"]
"""Transport ids: a spec kind, optionally ``-<variant>``: ``cuda_ipc`` (slots on the GPU) and ``torch_dist-nccl``
are collected everywhere and skipped at run time without CUDA; ``cuda_ipc-cpu`` is the same IPC class over
CPU shared memory."""
BUCKET_BYTES = 4096
_VARIANTS: dict[str, dict] = {
    "cuda_ipc-cpu": {"kind": "cuda_ipc", "device": "cpu"},
    "cuda_ipc": {"kind": "cuda_ipc", "device": "cuda"},
    "torch_dist-nccl": {"kind": "torch_dist", "backend": "nccl", "device": "cuda"},
}


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray("wsr", importable=True):
        yield


@pytest.fixture(scope="module")
def engines(ray_cluster):
    peers = [EnginePeer.remote() for _ in range(2)]
    ray.get([p.pid.remote() for p in peers], timeout=60)
    yield peers
    for p in peers:
        ray.kill(p)


def make_spec(kind: str, num_receivers: int = 1, num_senders: int = 1, **kw) -> TransportSpec:
    """A spec of transport id ``kind`` (``KINDS``); skips the test when the id needs CUDA and there is none."""
    variant = dict(_VARIANTS.get(kind, {"kind": kind}))
    if variant.get("device") == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return TransportSpec(**variant, name="c" + uuid.uuid4().hex[:10], num_receivers=num_receivers,
                         num_senders=num_senders, bucket_bytes=BUCKET_BYTES, max_header_bytes=64 << 10,
                         connect_timeout_s=30.0, op_timeout_s=30.0, **kw)


class Channel:
    """Sender side(s) in this process, receiver sides in engine actors; this process hosts the
    channel (``host_channel``: torch_dist's rendezvous store) until ``close``, or uses ``host``
    (then its caller closes it). ``spec``: the hosted spec to hand any other side."""

    def __init__(self, spec: TransportSpec, peers, senders_here: bool = True, host=None):
        self.host, self._own_host = host or host_channel(spec), host is None
        self.spec = spec = self.host.spec
        self.peers = peers
        opening = [p.open.remote(spec.to_bytes(), i) for i, p in enumerate(peers)]
        self.txs = [open_sender(spec, s) for s in range(spec.num_senders)] if senders_here else []
        ray.get(opening, timeout=60)

    def close(self) -> None:
        for tx in self.txs:
            tx.close()
        ray.get([p.close.remote() for p in self.peers], timeout=30)
        if self._own_host:
            self.host.close()


@pytest.fixture(scope="module", params=KINDS)
def channel(request, engines):
    """One channel per transport kind, shared by the tests of the module: each test must leave it
    clean (that the next sync succeeds after a failure is part of the contract)."""
    ch = Channel(make_spec(request.param), engines[:1])
    yield ch
    ch.close()
