"""Where a sync keeps its bytes (``transports.devices``), from the tables alone: CPU → gloo + host buckets, no
staging; CUDA → NCCL + device buckets, a staging bucket where the buckets are on the host. No CUDA needed: the
tables are read, no CUDA tensor is made. Plus the packing rule itself: a bucket filled through a staging
bucket holds the bytes and checksum of one filled in place."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sync_service.transports import TransportSpec
from sync_service.transports.devices import bucket_device, group_backend, group_device, stage_device


@pytest.mark.parametrize("device, backend", [("cpu", "gloo"), ("cuda", "nccl"), ("cuda:1", "nccl"),
                                             (torch.device("cpu"), "gloo")])
def test_group_backend_follows_the_parameters_device(device, backend):
    assert group_backend(device) == backend


def test_group_backend_refuses_a_device_no_backend_moves():
    with pytest.raises(ValueError, match=r"'meta'.*move the model.*or pass group="):
        group_backend("meta")


def test_a_gloo_group_gathers_on_the_host():
    assert group_device("gloo") == torch.device("cpu")
    assert group_device("cpu:gloo,cuda:nccl") == torch.device("cpu")  # several backends: host tensors


@pytest.mark.parametrize("kind, fields, device", [
    ("shm", {}, "cpu"),
    ("ray", {}, "cpu"),
    ("torch_dist", {"backend": "gloo"}, "cpu"),
    ("torch_dist", {"backend": "nccl"}, "cuda"),
    ("cuda_ipc", {"device": "cpu"}, "cpu"),
    ("cuda_ipc", {"device": "cuda"}, "cuda"),
    ("cuda_ipc", {"device": "cuda:1"}, "cuda:1"),
])
def test_bucket_device_is_where_the_transport_wants_its_bytes(kind, fields, device):
    assert bucket_device(TransportSpec(kind=kind, name="t", **fields)) == torch.device(device)


@pytest.mark.parametrize("merge, bucket, stage", [
    ("cpu", "cpu", None),          # CPU trainer, host buckets: the merge fills the bucket in place (today's path)
    ("cuda:0", "cpu", "cuda:0"),   # CUDA trainer, host transport: stage on the GPU, one copy per bucket
    ("cpu", "cuda", "cpu"),        # CPU trainer, device buckets: stage on the host, one copy per bucket
])
def test_stage_device_only_where_merge_and_buckets_differ(merge, bucket, stage):
    assert stage_device(merge, bucket) == (None if stage is None else torch.device(stage))


def test_a_staged_bucket_equals_one_filled_in_place():
    from protocols.wire import PlanEntry
    from sync_service.merge.base import TensorDictBase
    from sync_service.merge.source import MergeConfig, MergedSource
    from sync_service.streaming.checksum import RunningChecksum, checksum
    from sync_service.streaming.sender import pack_and_hash, pack_staged

    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(8, 16, generator=g), "b.weight": torch.randn(5, generator=g).bfloat16()}
    source = MergedSource(TensorDictBase(tensors), None, config=MergeConfig())
    entries = [PlanEntry(name="a.weight", dtype="float32", shape=(8, 16), box=((0, 8), (0, 16)), sender=0, bucket=0,
                         offset=0, nbytes=512),
               PlanEntry(name="b.weight", dtype="bfloat16", shape=(5,), box=((0, 5),), sender=0, bucket=0, offset=512,
                         nbytes=10)]
    in_place, staged = np.zeros(1024, dtype=np.uint8), np.zeros(1024, dtype=np.uint8)
    stage = torch.empty(1024, dtype=torch.uint8)
    times = [0.0, 0.0, 0.0]
    n1, h1 = pack_and_hash(source, entries, in_place, RunningChecksum(), times)
    n2, h2 = pack_staged(source, entries, stage, staged, RunningChecksum(), times)
    assert (n1, h1) == (n2, h2) == (522, checksum(in_place[:522]))
    assert np.array_equal(in_place, staged)


def test_rollout_engine_device_auto_is_cuda_only_with_a_gpu():
    from actors.rollout import engine_device

    assert engine_device("auto", "hf", []) == "cpu"
    assert engine_device("auto", "memory", [0]) == "cpu"  # the memory engine holds host tensors
    assert engine_device("auto", "hf", [0]) == ("cuda" if torch.cuda.is_available() else "cpu")
    assert engine_device("cpu", "hf", [0]) == "cpu"
    with pytest.raises(ValueError, match=r"engine 'memory' serves on \('cpu',\)"):
        engine_device("cuda", "memory", [])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA device.*num_gpus=1"):
            engine_device("cuda", "hf", [])
    for device in ("cpu:abc", "CPU", " cpu", "", None, 0):  # torch cannot parse it, or not a device string
        with pytest.raises(ValueError, match=r"engine 'hf' serves on \('cpu', 'cuda'\)"):
            engine_device(device, "hf", [])
    past = f"cuda:{torch.cuda.device_count()}"  # one past the visible devices (cuda:0 without a GPU)
    with pytest.raises(ValueError, match="sees no CUDA device" if not torch.cuda.is_available() else
                       r"sees \d+ CUDA device\(s\) \(cuda:0 \.\. cuda:\d+"):
        engine_device(past, "hf", [0])
