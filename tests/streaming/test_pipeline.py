"""Plan building and the sender/receiver pipeline in one process (shm transport, receiver thread)."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from protocols.params import ParamMeta, box_numel
from sync_service.engines.memory import MemoryEngine
from sync_service.streaming import (
    BucketPool, BucketReceiver, ProtocolError, RemoteSyncError, Sender, SyncAbortedError, TensorSource,
    build_plan, buckets_of, combine_plans, split_box, subset_plan,
)
from sync_service.transports import TransportSpec, open_receiver, open_sender

CAP = 4096


def test_split_box_covers_in_row_major_order():
    pieces = list(split_box(((0, 5), (0, 3), (0, 400)), 4, CAP))  # one [3, 400] fp32 row = 4800 B > CAP
    assert all(box_numel(p) * 4 <= CAP for p in pieces)
    assert sum(box_numel(p) for p in pieces) == 5 * 3 * 400
    assert pieces[0] == ((0, 1), (0, 2), (0, 400)) and pieces[1] == ((0, 1), (2, 3), (0, 400))
    with pytest.raises(ValueError, match="smaller than one element"):
        list(split_box(((0, 1),), 8, 4))


def test_plan_packs_aligned_and_subset_is_dense():
    metas = [ParamMeta("a", "bfloat16", (10, 300)), ParamMeta("b", "float32", ()), ParamMeta("c", "int8", (7,))]
    plan = build_plan(metas, bucket_bytes=CAP)
    assert all(e.offset % 64 == 0 and e.offset + e.nbytes <= CAP for e in plan.entries)
    assert [e.name for e in plan.entries].count("a") == 2  # 6000 B split in two boxes
    sub = subset_plan(plan, frozenset({"b", "c"}))
    assert [(e.name, e.bucket, e.offset) for e in sub.entries] == [("b", 0, 0), ("c", 0, 64)]
    assert subset_plan(plan, frozenset({"b", "c"})) is sub  # cached
    with pytest.raises(KeyError, match="zzz"):
        subset_plan(plan, frozenset({"zzz"}))
    with pytest.raises(ValueError, match="planned twice"):
        combine_plans([plan, build_plan(metas[:1], bucket_bytes=CAP, sender=1)])
    with pytest.raises(ValueError, match="multiple of 64"):
        build_plan(metas, bucket_bytes=100)


def test_memory_engine_commit_is_atomic_and_abort_keeps_old():
    eng = MemoryEngine({"w": torch.zeros(4, 4)})
    eng.begin_update(1, ["w"])
    eng.apply("w", ((0, 2), (0, 4)), torch.ones(2, 4))
    assert eng.state_dict()["w"].sum() == 0  # staged, not served
    with pytest.raises(ValueError, match="incomplete update 1.*w: 8/16"):
        eng.finish_update()  # half of w: never served (staging is not pre-filled from the served values)
    eng.apply("w", ((2, 4), (0, 4)), torch.zeros(2, 4))
    eng.finish_update()
    eng.commit(1)
    assert eng.state_dict()["w"].sum() == 8 and eng.weight_version() == 1
    eng.begin_update(2, ["w"])
    eng.apply("w", ((0, 4), (0, 4)), torch.full((4, 4), 5.0))
    eng.abort()
    assert eng.state_dict()["w"].sum() == 8 and eng.weight_version() == 1
    eng.begin_update(3, ["w"])
    with pytest.raises(ValueError, match="outside its shape"):
        eng.apply("w", ((0, 5), (0, 4)), torch.ones(5, 4))
    with pytest.raises(RuntimeError, match="no finished update"):
        eng.commit(3)


class CountingEngine(MemoryEngine):
    """Counts ``finish_update`` calls (the receiver finishes once per sync)."""

    finish_calls = 0

    def finish_update(self):
        self.finish_calls += 1
        return super().finish_update()


class Loop:
    """A shm channel with the receiver in a thread of this process."""

    def __init__(self, tensors, *, secret_tx=None, secret_rx=None, num_senders=1):
        self.spec = TransportSpec(kind="shm", name="p" + uuid.uuid4().hex[:10], bucket_bytes=CAP,
                                  num_senders=num_senders, connect_timeout_s=10)
        self.txs = [open_sender(self.spec, s) for s in range(num_senders)]
        self.rx = open_receiver(self.spec, 0)
        self.engine = CountingEngine({n: torch.zeros_like(t) for n, t in tensors.items()})
        self.secret_tx, self.secret_rx = secret_tx, secret_rx

    def run(self, source, plan, version, names=None, sender=0):
        result = {}

        def receive():
            try:
                result["stats"] = BucketReceiver(self.engine, plan, secret=self.secret_rx).receive_sync(
                    self.rx, timeout_s=10, commit=True)
            except Exception as exc:
                result["error"] = exc

        th = threading.Thread(target=receive)
        self.last = result
        th.start()
        try:
            Sender(self.txs[sender], BucketPool(bucket_bytes=CAP), sender=sender, secret=self.secret_tx).send_sync(
                f"s{version}", version, source, plan, names=names, timeout_s=10)
        finally:
            th.join(15)
        return result

    def close(self):
        self.rx.close()
        for tx in self.txs:
            tx.close()


TENSORS = {"a": torch.randn(10, 300).bfloat16(), "b": torch.tensor(2.5), "c": torch.arange(7, dtype=torch.int8)}


def test_round_trip_with_hmac_then_wrong_secret_rejected():
    src = TensorSource(TENSORS)
    plan = build_plan(src.param_metas(), bucket_bytes=CAP)
    loop = Loop(TENSORS, secret_tx=b"k", secret_rx=b"k")
    try:
        assert "stats" in loop.run(src, plan, 1)
        assert all(torch.equal(loop.engine.state_dict()[n], t) for n, t in TENSORS.items())
        loop.secret_tx = b"other"
        with pytest.raises(RemoteSyncError, match="HMAC"):
            loop.run(TensorSource({n: t + 1 for n, t in TENSORS.items()}), plan, 2)
        assert loop.engine.weight_version() == 1
        assert torch.equal(loop.engine.state_dict()["a"], TENSORS["a"])
    finally:
        loop.close()


class BrokenSource(TensorSource):
    def fill(self, name, box, out):
        if name == "c":
            raise RuntimeError("merge failed on c")
        super().fill(name, box, out)


def test_source_failure_aborts_receivers_and_next_sync_works():
    plan = build_plan(TensorSource(TENSORS).param_metas(), bucket_bytes=CAP)
    loop = Loop(TENSORS)
    try:
        with pytest.raises(RuntimeError, match="merge failed on c"):
            loop.run(BrokenSource(TENSORS), plan, 1)
        assert loop.engine.weight_version() is None
        result = loop.run(TensorSource(TENSORS), plan, 2)
        assert result["stats"].version == 2 and loop.engine.finish_calls == 1
    finally:
        loop.close()


def test_plan_mismatch_is_a_protocol_error():
    src = TensorSource(TENSORS)
    loop = Loop(TENSORS)
    try:
        with pytest.raises(RemoteSyncError, match="plan_digest"):
            result = {}
            th = threading.Thread(target=lambda: result.update(
                e=_catch(lambda: BucketReceiver(loop.engine, build_plan(src.param_metas(), bucket_bytes=CAP // 2))
                         .receive_sync(loop.rx, timeout_s=10))))
            th.start()
            try:
                Sender(loop.txs[0], BucketPool(bucket_bytes=CAP)).send_sync(
                    "x", 1, src, build_plan(src.param_metas(), bucket_bytes=CAP), timeout_s=10)
            finally:
                th.join(15)
        assert isinstance(result["e"], ProtocolError) and result["e"].field == "begin.plan_digest"
    finally:
        loop.close()


def _catch(fn):
    try:
        fn()
    except Exception as exc:
        return exc
    return None


def test_delta_sync_sends_only_changed_names():
    plan = build_plan(TensorSource(TENSORS).param_metas(), bucket_bytes=CAP)
    loop = Loop(TENSORS)
    try:
        loop.run(TensorSource(TENSORS), plan, 1)
        new = dict(TENSORS, b=torch.tensor(-1.0))
        result = loop.run(TensorSource(new, changed={"b"}), plan, 2, names={"b"})
        assert result["stats"].entries == 1 and result["stats"].payload_bytes == 4
        assert loop.engine.state_dict()["b"] == -1.0 and torch.equal(loop.engine.state_dict()["a"], TENSORS["a"])
    finally:
        loop.close()


def test_aborted_sync_raises_on_receiver():
    plan = build_plan(TensorSource(TENSORS).param_metas(), bucket_bytes=CAP)
    loop = Loop(TENSORS)
    try:
        with pytest.raises(RuntimeError, match="merge failed"):
            loop.run(BrokenSource(TENSORS), plan, 1)
        err = loop.last["error"]
        assert isinstance(err, SyncAbortedError) and "merge failed on c" in str(err) and err.sender == 0
        assert loop.engine.weight_version() is None and len(buckets_of(plan, 0)) == 2
    finally:
        loop.close()


def test_multi_sender_receiver_waits_for_every_sender():
    halves = [{"a": TENSORS["a"]}, {"b": TENSORS["b"], "c": TENSORS["c"]}]
    plan = combine_plans([build_plan(TensorSource(h).param_metas(), bucket_bytes=CAP, sender=s)
                          for s, h in enumerate(halves)])
    loop = Loop(TENSORS, num_senders=2)
    try:
        result = {}
        th = threading.Thread(target=lambda: result.update(
            s=BucketReceiver(loop.engine, plan).receive_sync(loop.rx, timeout_s=10, commit=True)))
        th.start()
        Sender(loop.txs[0], BucketPool(bucket_bytes=CAP), sender=0)  # sender 0 is late: 1 starts first
        t1 = threading.Thread(target=lambda: Sender(loop.txs[1], BucketPool(bucket_bytes=CAP), sender=1).send_sync(
            "m", 4, TensorSource(halves[1]), plan, timeout_s=10))
        t1.start()
        Sender(loop.txs[0], BucketPool(bucket_bytes=CAP), sender=0).send_sync("m", 4, TensorSource(halves[0]), plan, timeout_s=10)
        t1.join(10)
        th.join(10)
        assert result["s"].entries == len(plan.entries) and loop.engine.weight_version() == 4
        assert all(torch.equal(loop.engine.state_dict()[n], t) for n, t in TENSORS.items())
    finally:
        loop.close()


class PieceEngine(CountingEngine):
    """A ``ChunkedApply`` engine with pieces far smaller than the entries; records every apply."""

    apply_chunk_bytes = 256

    def __init__(self, tensors):
        super().__init__(tensors)
        self.applied: list[tuple[str, tuple]] = []

    def apply(self, name, box, data):
        self.applied.append((name, box))
        super().apply(name, box, data)


class WholeEngine(PieceEngine):
    """The same engine without ``ChunkedApply``: every bucket is verified before any apply."""

    @property
    def apply_chunk_bytes(self):
        raise AttributeError("not a ChunkedApply engine")  # hasattr() is False


class CorruptingRx:
    """A real receiver whose ``bucket``-th bucket payload gets one byte flipped after it arrived."""

    def __init__(self, rx, bucket):
        self.rx, self.bucket, self.seen = rx, bucket, -1

    def __getattr__(self, name):
        return getattr(self.rx, name)

    def recv(self, timeout_s):
        header, payload = self.rx.recv(timeout_s)
        if payload is not None and len(payload):
            self.seen += 1
            if self.seen == self.bucket:
                payload[len(payload) // 2] ^= 0xFF
        return header, payload


@pytest.mark.parametrize("engine_cls", [PieceEngine, WholeEngine], ids=["hashed_while_applying", "verified_first"])
def test_checksum_checked_in_both_receiver_modes(engine_cls):
    from protocols.interfaces import ChunkedApply

    assert isinstance(engine_cls({}), ChunkedApply) == (engine_cls is PieceEngine)
    tensors = dict(TENSORS, d=torch.randn(3, 40))  # bf16 [10, 300] split over buckets, fp32, int8, padding
    plan = build_plan(TensorSource(tensors).param_metas(), bucket_bytes=CAP)
    loop = Loop(tensors)
    loop.engine = engine_cls({n: torch.zeros_like(t) for n, t in tensors.items()})
    try:
        assert "stats" in loop.run(TensorSource(tensors), plan, 1)
        assert all(torch.equal(loop.engine.state_dict()[n], t) for n, t in tensors.items())
        pieces = len(loop.engine.applied)
        assert (pieces > len(plan.entries)) == (engine_cls is PieceEngine)  # "a": 2 entries of ~3 KB in 256 B pieces
        loop.engine.applied.clear()
        rx, loop.rx = loop.rx, CorruptingRx(loop.rx, bucket=1)
        with pytest.raises(RemoteSyncError, match="xxh3_64 mismatch on bucket 1"):
            loop.run(TensorSource({n: t + 1 for n, t in tensors.items()}), plan, 2)
        loop.rx = rx
        err = loop.last["error"]
        assert isinstance(err, ProtocolError) and err.field == "header.checksum"
        assert loop.engine.weight_version() == 1
        assert all(torch.equal(loop.engine.state_dict()[n], t) for n, t in tensors.items())
        if engine_cls is WholeEngine:  # only bucket 0 reached the engine, nothing of the corrupt bucket 1
            assert set(loop.engine.applied) <= {(e.name, e.box) for e in buckets_of(plan, 0)[0]}
        result = loop.run(TensorSource({n: t * 2 for n, t in tensors.items()}), plan, 3)  # channel usable again
        assert result["stats"].version == 3
        assert all(torch.equal(loop.engine.state_dict()[n], t * 2) for n, t in tensors.items())
    finally:
        loop.close()


def test_apply_hashed_digest_equals_one_shot_checksum():
    import numpy as np

    from sync_service.streaming.applier import apply_hashed
    from sync_service.streaming.checksum import RunningChecksum, checksum
    from sync_service.streaming.sender import pack_bucket
    from sync_service.streaming.views import as_byte_tensor

    tensors = dict(TENSORS, d=torch.randn(3, 40))
    plan = build_plan(TensorSource(tensors).param_metas(), bucket_bytes=CAP)
    for entries in buckets_of(plan, 0):
        arr = np.zeros(CAP, dtype=np.uint8)
        n = pack_bucket(TensorSource(tensors), entries, as_byte_tensor(arr))
        arr[n:] = 7  # bytes past the payload are not hashed
        for chunk in (2, 100, 256, 1 << 20):
            eng = PieceEngine({k: torch.zeros_like(t) for k, t in tensors.items()})
            eng.begin_update(1, [e.name for e in entries])
            assert apply_hashed(eng, arr[:n], entries, chunk, RunningChecksum()) == checksum(arr[:n])
            for e in entries:
                got = eng._staging.buffer(e.name)[tuple(slice(a, b) for a, b in e.box)]
                assert torch.equal(got, tensors[e.name][tuple(slice(a, b) for a, b in e.box)])
