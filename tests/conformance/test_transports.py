"""Transport conformance: every transport, real processes (Ray actors), same assertions."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import ray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols.interfaces import PeerLostError
from protocols.wire import encode
from sync_service.streaming import (
    BucketPool, RemoteSyncError, Sender, TensorSource, build_plan, combine_plans,
)
from sync_service.transports import TransportSpec, host_channel
from tests.conformance.conftest import BUCKET_BYTES, KINDS, Channel, make_spec
from tests.conformance.peers import (
    EnginePeer, SlowSource, TrainerPeer, forge_frames, make_tensors, raw_bytes,
)

pytestmark = pytest.mark.conformance

DTYPES = ["bfloat16", "float16", "float32", "int8", "float8_e4m3fn"]
BASE = [("scalar", "float32", [], False), ("empty", "bfloat16", [0, 5], False),
        ("strided", "float16", [6, 7], True), ("big", "bfloat16", [3, 40, 50], False)]  # big: 12000 B > 4096


def sync(ch: Channel, specs, seed: int, version: int, *, names=None, peers=None, timeout_s: float = 20.0):
    """One sync of ``make_tensors(specs, seed)`` from this process to the channel's engines."""
    src = TensorSource(make_tensors(specs, seed))
    plan = build_plan(src.param_metas(), bucket_bytes=BUCKET_BYTES)
    futures = [p.receive.remote(timeout_s) for p in (peers or ch.peers)]
    stats = Sender(ch.txs[0], BucketPool(bucket_bytes=BUCKET_BYTES)).send_sync(
        f"s{version}", version, src, plan, names=names, timeout_s=timeout_s)
    return stats, ray.get(futures, timeout=timeout_s + 10), src


def load(ch: Channel, specs, seed: int):
    src = TensorSource(make_tensors(specs, seed))
    plan = build_plan(src.param_metas(), bucket_bytes=BUCKET_BYTES)
    ray.get([p.load.remote(encode(plan), specs, seed) for p in ch.peers], timeout=30)
    return src, plan


def assert_state(peer, tensors, version):
    got_version, state, _ = ray.get(peer.state.remote(), timeout=30)
    assert got_version == version
    assert set(state) == set(tensors)
    for name, t in tensors.items():
        assert state[name] == raw_bytes(t), name


shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3)
tensor_sets = st.lists(st.tuples(st.sampled_from(DTYPES), shapes, st.booleans()), min_size=1, max_size=6)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(extra=tensor_sets, seed=st.integers(0, 2**31))
def test_lossless_round_trip(channel, extra, seed):
    specs = BASE + [(f"t{i}", d, s, nc and bool(s)) for i, (d, s, nc) in enumerate(extra)]
    load(channel, specs, seed + 1)  # engine starts from other values
    stats, (res,), src = sync(channel, specs, seed, version=7)
    assert res["ok"], res
    assert stats.buckets >= 3 and res["bytes"] == stats.payload_bytes
    assert_state(channel.peers[0], src.tensors, 7)
    assert ray.get(channel.peers[0].state.remote())[2] == 1  # one finish per sync


@pytest.mark.parametrize("kind", KINDS)
def test_fan_out_then_delta(engines, kind):
    ch = Channel(make_spec(kind, num_receivers=2), engines)
    try:
        load(ch, BASE, 0)
        _, results, src = sync(ch, BASE, 1, version=1)
        assert all(r["ok"] for r in results), results
        for p in engines:
            assert_state(p, src.tensors, 1)
        _, results, src2 = sync(ch, BASE, 2, version=2, names={"big", "scalar"})
        assert all(r["ok"] for r in results), results
        want = dict(src.tensors, big=src2.tensors["big"], scalar=src2.tensors["scalar"])
        for p in engines:
            assert_state(p, want, 2)
    finally:
        ch.close()


def _corrupt(frames):
    frames[2][1][5] ^= 0xFF  # bucket 1: one byte flipped after its checksum
    return frames


def _truncate(frames):
    frames[1] = (frames[1][0], frames[1][1][:-1])
    return frames


def _duplicate(frames):
    return frames[:2] + [frames[1]] + frames[2:]


def _reorder(frames):
    return [frames[0], frames[2], frames[1]] + frames[3:]


@pytest.mark.parametrize("mutate,field", [(_corrupt, "header.checksum"), (_truncate, "header.payload_nbytes"),
                                          (_duplicate, "header.seq"), (_reorder, "header.seq")],
                         ids=["corrupt", "truncated", "duplicate", "out_of_order"])
def test_bad_bucket_is_rejected_and_nothing_applied(channel, mutate, field):
    src, plan = load(channel, BASE, 3)
    before = {n: raw_bytes(t) for n, t in make_tensors(BASE, 3).items()}
    future = channel.peers[0].receive.remote(20.0)
    for header, payload in mutate(forge_frames(plan, TensorSource(make_tensors(BASE, 4)), "bad", 1)):
        channel.txs[0].send(header, payload, 10.0)
    res = ray.get(future, timeout=30)
    assert not res["ok"] and res["type"] == "ProtocolError" and res["field"] == field, res
    version, state, _ = ray.get(channel.peers[0].state.remote())
    assert version is None and state == before
    _, (res,), src = sync(channel, BASE, 5, version=2)  # the channel is usable again
    assert res["ok"], res
    assert_state(channel.peers[0], src.tensors, 2)


def test_receiver_error_reaches_sender(channel):
    load(channel, BASE, 0)
    ray.get(channel.peers[0].fail_next.remote("big"))
    t = time.monotonic()
    src = TensorSource(make_tensors(BASE, 1))
    plan = build_plan(src.param_metas(), bucket_bytes=BUCKET_BYTES)
    failing = channel.peers[0].receive.remote(60.0)
    with pytest.raises(RemoteSyncError, match="injected engine failure while applying big"):
        Sender(channel.txs[0], BucketPool(bucket_bytes=BUCKET_BYTES)).send_sync("s1", 1, src, plan, timeout_s=60.0)
    # The receiver's error ends the sync; the sender never waits out its 60 s timeout.
    assert time.monotonic() - t < 30.0
    # The engine's failed receive (it drains the sync's remaining frames) ends before the next sync starts
    # (the peer serves two calls at once: a receive started now would read the drained sync's frames).
    res = ray.get(failing, timeout=60)
    assert not res["ok"] and "injected engine failure while applying big" in res["text"], res
    version, _, _ = ray.get(channel.peers[0].state.remote())
    assert version is None
    _, (res,), src = sync(channel, BASE, 2, version=2)
    assert res["ok"], res
    assert_state(channel.peers[0], src.tensors, 2)


@pytest.mark.parametrize("kind", KINDS)
def test_sender_calls_after_close_are_peer_lost(engines, kind):
    """A cancelled push closes its channel while the sender thread may still send or wait for a reply:
    those calls raise PeerLostError (the coordinator's 'peer lost' path), never an AttributeError of a
    half-torn-down transport; close twice is harmless."""
    ch = Channel(make_spec(kind), engines[:1])
    try:
        tx = ch.txs[0]
        tx.close()
        with pytest.raises(PeerLostError, match="closed"):
            tx.send(b"header", None, 1.0)
        with pytest.raises(PeerLostError, match="closed"):
            tx.poll_reply(0.1)
        tx.close()
    finally:
        ch.close()


MANY = [(f"w{i}", "float32", [16], False) for i in range(200)]


@pytest.mark.parametrize("kind", KINDS)
def test_receiver_dies_sender_fails_within_timeout(ray_cluster, kind):
    victim = EnginePeer.remote()
    ray.get(victim.pid.remote(), timeout=300)  # started (slow on a loaded machine) before the connect window opens
    ch = Channel(make_spec(kind), [victim])
    try:
        load(ch, MANY, 0)
        victim.receive.remote(30.0)
        src = TensorSource(make_tensors(MANY, 1))
        killer = threading.Timer(1.0, lambda: ray.kill(victim))
        killer.start()
        t = time.monotonic()
        with pytest.raises((PeerLostError, TimeoutError, RemoteSyncError)):
            Sender(ch.txs[0], BucketPool(bucket_bytes=BUCKET_BYTES)).send_sync(
                "d", 1, SlowSource(src.tensors, 0.02), build_plan(src.param_metas(), bucket_bytes=BUCKET_BYTES),
                timeout_s=8.0)
        # Bounded by the 8 s timeout plus teardown slack on a loaded 2-core machine: no hang.
        assert time.monotonic() - t < 30.0
    finally:
        for tx in ch.txs:
            tx.close()
        ch.host.close()


@pytest.mark.parametrize("kind", KINDS)
def test_sender_dies_receiver_fails_within_timeout(engines, kind):
    host = host_channel(make_spec(kind))
    trainer = TrainerPeer.remote()
    opened = trainer.open.remote(host.spec.to_bytes())
    ch = Channel(host.spec, engines[:1], senders_here=False, host=host)
    try:
        src, plan = load(ch, MANY, 0)
        ray.get(opened, timeout=60)
        future = engines[0].receive.remote(8.0)
        trainer.send.remote(encode(plan), MANY, 1, 0.02)
        time.sleep(1.0)
        ray.kill(trainer)
        res = ray.get(future, timeout=20)
        assert not res["ok"] and res["type"] in ("PeerLostError", "TimeoutError", "TransportError"), res
        assert res["s"] < 10.0
        assert ray.get(engines[0].state.remote())[0] is None
    finally:
        ch.close()
        host.close()


@pytest.mark.parametrize("kind", ["shm", "ray", "cuda_ipc-cpu", "cuda_ipc"])
def test_two_senders_one_receiver(engines, kind):
    ch = Channel(make_spec(kind, num_senders=2), engines[:1])
    try:
        tensors = make_tensors(BASE, 9)
        halves = [{k: tensors[k] for k in ("scalar", "big")}, {k: tensors[k] for k in ("empty", "strided")}]
        plans = [build_plan(TensorSource(h).param_metas(), bucket_bytes=BUCKET_BYTES, sender=s) for s, h in enumerate(halves)]
        plan = combine_plans(plans)
        ray.get(engines[0].load.remote(encode(plan), BASE, 0))
        future = engines[0].receive.remote(20.0)
        errors = []

        def run(s):
            try:
                Sender(ch.txs[s], BucketPool(bucket_bytes=BUCKET_BYTES), sender=s).send_sync(
                    "m", 3, TensorSource(halves[s]), plan, timeout_s=20)
            except Exception as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(s,)) for s in range(2)]
        [t.start() for t in threads]
        [t.join(30) for t in threads]
        res = ray.get(future, timeout=30)
        assert not errors and res["ok"], (errors, res)
        assert_state(engines[0], tensors, 3)
    finally:
        ch.close()


def plasma_objects() -> int:
    """Objects in the Ray object store (Ray's memory summary)."""
    import re

    from ray._private.internal_api import memory_summary

    text = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    return int(re.search(r"Plasma memory usage \d+ MiB, (\d+) objects", text).group(1))


def test_ray_objects_released_with_the_frames(engines):
    """Ray transport: buckets up to ``INLINE_BYTES`` create no object; larger ones create one each,
    dropped by every side once the receivers released it, so after 10 syncs of 20 such buckets to two
    engines the store is back where it started within Ray's batched deletion (1 s period)."""
    from sync_service.transports.ray_store import INLINE_BYTES

    big = [(f"w{i}", "float32", [INLINE_BYTES // 4 + 16], False) for i in range(20)]  # one bucket each
    bucket = 2 * INLINE_BYTES
    spec = TransportSpec(kind="ray", name="o" + uuid.uuid4().hex[:10], num_receivers=2, bucket_bytes=bucket,
                         connect_timeout_s=30.0, op_timeout_s=30.0)
    ch = Channel(spec, engines)
    try:
        src = TensorSource(make_tensors(big, 1))
        plan = build_plan(src.param_metas(), bucket_bytes=bucket)
        ray.get([p.load.remote(encode(plan), big, 0) for p in engines], timeout=30)
        base = plasma_objects()
        sender = Sender(ch.txs[0], BucketPool(bucket_bytes=bucket))
        for v in range(1, 11):
            futures = [p.receive.remote(30.0) for p in engines]
            assert sender.send_sync(f"o{v}", v, src, plan, timeout_s=30).buckets == 20
            assert all(r["ok"] for r in ray.get(futures, timeout=60))
        left = _settled_objects(base)
        assert left <= base, f"{left} objects left in the store (was {base} before 200 buckets)"
        for p in engines:
            assert_state(p, src.tensors, 10)
        small = (f"s{uuid.uuid4().hex[:4]}", "float32", [64], False)
        ray.get([p.load.remote(encode(build_plan(TensorSource(make_tensors([small], 0)).param_metas(),
                                                  bucket_bytes=bucket)), [small], 0) for p in engines], timeout=30)
        small_src = TensorSource(make_tensors([small], 2))
        futures = [p.receive.remote(30.0) for p in engines]
        sender.send_sync("small", 11, small_src, build_plan(small_src.param_metas(), bucket_bytes=bucket), timeout_s=30)
        assert all(r["ok"] for r in ray.get(futures, timeout=60))
        assert _settled_objects(base) <= base, "a small bucket left an object in the store"
    finally:
        ch.close()


def _settled_objects(base: int, timeout_s: float = 60.0) -> int:
    """Store object count once it is back at ``base``, or the count at the timeout: Ray deletes
    released objects in batches, later still on a loaded machine, so the bound is a timeout."""
    end = time.monotonic() + timeout_s
    while (left := plasma_objects()) > base and time.monotonic() < end:
        time.sleep(0.2)
    return left


def test_ray_chain_relays_every_frame_to_the_next_engine(engines):
    """``relay="chain"``: the sender hands each frame to receiver 0 only, which relays it (objects
    re-put on its side, inline frames as they are); both engines end bitwise equal to the source,
    full sync then delta."""
    from sync_service.transports.ray_store import INLINE_BYTES

    specs = [("big", "float32", [INLINE_BYTES // 4 + 16], False), *BASE]
    bucket = 2 * INLINE_BYTES
    spec = TransportSpec(kind="ray", name="r" + uuid.uuid4().hex[:10], num_receivers=2, bucket_bytes=bucket,
                         connect_timeout_s=30.0, op_timeout_s=30.0, relay="chain")
    ch = Channel(spec, engines)
    try:
        src = TensorSource(make_tensors(specs, 1))
        plan = build_plan(src.param_metas(), bucket_bytes=bucket)
        ray.get([p.load.remote(encode(plan), specs, 0) for p in engines], timeout=30)
        sender = Sender(ch.txs[0], BucketPool(bucket_bytes=bucket))
        for version, names in ((1, None), (2, {"big", "scalar"})):
            futures = [p.receive.remote(30.0) for p in engines]
            src = TensorSource(make_tensors(specs, 1 + version)) if names else src
            sender.send_sync(f"r{version}", version, src, plan, names=names, timeout_s=30)
            results = ray.get(futures, timeout=60)
            assert all(r["ok"] for r in results), results
        want = dict(make_tensors(specs, 1), big=src.tensors["big"], scalar=src.tensors["scalar"])
        for p in engines:
            assert_state(p, want, 2)
    finally:
        ch.close()


def test_ray_chain_relay_dies_the_next_engine_fails_naming_it(ray_cluster, engines):
    """The relaying engine (receiver 0) is killed mid-sync: the engine after it fails within seconds,
    naming it, not after its timeout; the sender fails within its own timeout."""
    victim = EnginePeer.remote()
    ray.get(victim.pid.remote(), timeout=300)
    ch = Channel(make_spec("ray", num_receivers=2, relay="chain"), [victim, engines[0]])
    try:
        load(ch, MANY, 0)
        victim.receive.remote(30.0)
        future = engines[0].receive.remote(30.0)
        src = TensorSource(make_tensors(MANY, 1))
        killer = threading.Timer(1.0, lambda: ray.kill(victim))
        killer.start()
        with pytest.raises((PeerLostError, TimeoutError, RemoteSyncError)):
            Sender(ch.txs[0], BucketPool(bucket_bytes=BUCKET_BYTES)).send_sync(
                "k", 1, SlowSource(src.tensors, 0.05), build_plan(src.param_metas(), bucket_bytes=BUCKET_BYTES),
                timeout_s=20.0)
        res = ray.get(future, timeout=40)
        assert not res["ok"] and res["type"] == "PeerLostError", res
        assert "receiver 0, which relays every frame to receiver 1" in res["text"], res
        assert res["s"] < 15.0, res
        assert ray.get(engines[0].state.remote(), timeout=30)[0] is None
    finally:
        for tx in ch.txs:
            tx.close()
        ray.get(engines[0].close.remote(), timeout=30)
        ch.host.close()
