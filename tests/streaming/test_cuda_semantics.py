"""The device path's CUDA semantics, checked where a CPU can check them (``transports.cuda_device``, the merge's tile
planner, the factor cast, the device finiteness check). What only a GPU can confirm is marked ``gpu`` below and
listed in docs/deploy.md ("What the first GPU run must confirm").

The two CUDA calls of ``map_shared_slot`` are replaced by recorders in one test: no CUDA exists here, and what is
checked is their order (CUDA initialized before the IPC map), not CUDA itself."""

from __future__ import annotations

import uuid

import pytest
import torch

from protocols.interfaces import TransportError
from sync_service.transports import TransportSpec, open_receiver, open_sender
from sync_service.transports.cuda_device import map_shared_slot, refuse_shared_gpu, visible_index


def test_cuda_is_initialized_before_a_peer_slot_is_mapped():
    calls = []

    def new_shared(*handle):
        calls.append(("map", handle))
        return torch.UntypedStorage(16)

    slot = map_shared_slot(("h", 1), init=lambda: calls.append(("init",)), new_shared=new_shared)
    assert calls == [("init",), ("map", ("h", 1))]
    assert slot.dtype == torch.uint8 and slot.numel() == 16


def test_the_senders_gpu_is_found_by_uuid_not_by_index():
    assert visible_index("GPU-b", ["GPU-a", "GPU-b"], what="cuda_ipc c") == 1
    with pytest.raises(TransportError, match=r"cuda_ipc c: .*GPU-z, which this process cannot see.*same GPU.*'torch'"):
        visible_index("GPU-z", ["GPU-a"], what="cuda_ipc c")


def test_nccl_refuses_two_ranks_on_one_gpu_naming_them():
    refuse_shared_gpu({0: "GPU-a", 1: "GPU-b"}, what="torch_dist c (NCCL)")  # one GPU each: fine
    refuse_shared_gpu({0: "", 1: ""}, what="torch_dist c (NCCL)")  # no device UUID (host ranks): nothing to refuse
    with pytest.raises(TransportError, match=r"torch_dist c \(NCCL\): ranks \[0, 2\] are on one GPU \(GPU-a\).*num_gpus=1"):
        refuse_shared_gpu({0: "GPU-a", 1: "GPU-b", 2: "GPU-a"}, what="torch_dist c (NCCL)")


def test_event_plumbing_through_the_host_flavour_of_cuda_ipc():
    """One event record per sent frame on its slot, one wait per received frame before it is read, one release
    per freed slot; the events' handles travel once, in the handles frame. On CPU the events are counted no-ops."""
    spec = TransportSpec(kind="cuda_ipc", name="ev" + uuid.uuid4().hex[:8], device="cpu", bucket_bytes=4096, slots=2,
                         max_header_bytes=1024, connect_timeout_s=30.0)
    tx = open_sender(spec, 0)
    rx = open_receiver(spec, 0)
    try:
        assert tx.hashes_payload and rx.hashes_payload  # host slots: hashed as shm's
        for n in range(5):
            view = tx.reserve(10.0)
            with tx.filling():
                view[:8] = n
            tx.send(b"h%d" % n, view[:8], 10.0)
            header, payload = rx.recv(10.0)
            assert header == b"h%d" % n and list(payload) == [n] * 8
            rx.release()
        assert tx.events.records == [2, 3]  # frame 0 (the handles) took slot 0's turn
        assert rx.events[0].waits == [2, 3] and rx.events[0].releases == [2, 3]
    finally:
        rx.close()
        tx.close()


def test_gpu_tiles_are_whole_expert_blocks_cpu_tiles_cache_sized():
    from sync_service.merge.staging import chunks, tile_bytes_for

    budget = 64 << 20
    assert tile_bytes_for("cpu", budget) == 2 << 20
    assert tile_bytes_for("cuda", budget) == budget == tile_bytes_for("cuda:3", budget)
    assert tile_bytes_for("cuda", budget, 1 << 20) == 1 << 20  # MergeConfig.tile_bytes given: taken
    box = ((0, 64), (0, 1536), (0, 2048))  # a fused gate_up_proj [E, 2I, H], fp32 scratch 805 MB
    gpu = list(chunks(box, tile_bytes_for("cuda", budget)))
    cpu = list(chunks(box, tile_bytes_for("cpu", budget)))
    assert len(gpu) == 13 and all(t[1:] == box[1:] for t in gpu)  # 5 whole experts a tile
    assert len(cpu) == 384  # 6 row bands an expert


def _source(tile_bytes, factors_dtype=torch.bfloat16):
    from sync_service.merge.base import TensorDictBase
    from sync_service.merge.source import MergeConfig, MergedSource
    from sync_service.merge.terms import LoraAdapter, LoraTerm

    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, 32, generator=g).to(torch.bfloat16)
    x = torch.randn(8, 64, 4, generator=g).to(factors_dtype)
    y = torch.randn(8, 4, 32, generator=g).to(factors_dtype)
    term = LoraTerm((0, 8), (0, 64, 1), (0, 32, 1), x, y, 0.5)
    adapter = LoraAdapter(terms={"w": [term]})
    config = MergeConfig(staging_bytes=1 << 20, tile_bytes=tile_bytes)
    return MergedSource(TensorDictBase({"w": w}), adapter, config=config), term


def _fill(source):
    out = torch.empty(8, 64, 32, dtype=torch.bfloat16)
    source.fill("w", ((0, 8), (0, 64), (0, 32)), out)
    return out


def test_factors_are_cast_once_per_source_and_again_after_an_in_place_update():
    small, term = _source(4096)  # 8 tiles a fill
    whole, _ = _source(None)
    first = _fill(small)
    assert torch.equal(first.view(torch.int16), _fill(whole).view(torch.int16))  # tile size changes no value
    assert len(small._cast) == 1
    cast = next(iter(small._cast.values()))[0]
    _fill(small)
    assert next(iter(small._cast.values()))[0] is cast  # the second fill reused the cast factors
    term.x.mul_(2)  # the trainer updates its factor in place
    second = _fill(small)
    assert len(small._cast) == 1 and not torch.equal(first, second)
    fresh, _ = _source(4096)
    fresh.adapter.terms["w"][0].x.mul_(2)
    assert torch.equal(second.view(torch.int16), _fill(fresh).view(torch.int16))


def test_nonfinite_factors_named_in_order():
    from sync_service.merge.finite import nonfinite_keys

    t = {"a": torch.ones(3), "b": torch.tensor([1.0, float("nan")]), "i": torch.ones(2, dtype=torch.int64),
         "c": torch.tensor([float("inf")])}
    assert nonfinite_keys(t) == ["b", "c"]
    assert nonfinite_keys({"a": torch.ones(2)}) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the interprocess events and the IPC map "
                                                           "themselves (scripts/gpu-check.sh check 2 measures them)")
def test_cuda_ipc_slots_and_events_on_a_gpu():
    spec = TransportSpec(kind="cuda_ipc", name="gev" + uuid.uuid4().hex[:8], device="cuda", bucket_bytes=1 << 20,
                         slots=2, max_header_bytes=1024, connect_timeout_s=30.0)
    tx = open_sender(spec, 0)
    rx = open_receiver(spec, 0)
    try:
        assert not tx.hashes_payload and not rx.hashes_payload
        view = tx.reserve(10.0)
        with tx.filling():
            view.fill_(7)
        tx.send(b"h", view, 10.0)
        _, payload = rx.recv(10.0)
        assert int(payload.sum()) == 7 * (1 << 20)
        rx.release()
    finally:
        rx.close()
        tx.close()
