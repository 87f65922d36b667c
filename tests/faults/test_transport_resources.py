"""Transport resources, with real actors and real foreign processes: the torch transport's rendezvous
(a fresh port per channel, a store only the channel's processes can use) and /dev/shm segments
(none outlives its session on any exit path). Each test asserts the error the caller sees, that it
came before the timeout, and that the engines hold exactly a committed version afterwards."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import psutil
import pytest

from sync_service.api import SyncConfig, WeightSync
from sync_service.transports import TransportSpec
from sync_service.transports.shm import SEGMENT_PREFIX, SHM_DIR, ShmSender, segment_owner
from tests.faults import inject
from tests.faults.conftest import TIMEOUT_S, assert_equal_state, assert_oracle_state
from tests.ray_session import ROOT

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.faults

BUCKET_BYTES = 1 << 10


def segments_of(pids) -> list[str]:
    """This host's ring segments created by one of ``pids``."""
    return sorted(f for f in os.listdir(SHM_DIR)
                  if f.startswith(SEGMENT_PREFIX) and segment_owner(f"{SHM_DIR}/{f}") in set(pids))


def wait_until(predicate, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= end:
            return False
        time.sleep(0.05)
    return True


def listening_ports() -> set[int]:
    return {c.laddr.port for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def run_python(code: str, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """``code`` (dedented) in a fresh interpreter with this checkout on its path."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=timeout_s, env=dict(os.environ, PYTHONPATH=ROOT))


def delay_receiver_open(actor, delay_s: float) -> None:
    """Inside an engine process: every ``open_receiver`` sleeps ``delay_s`` first (0: restored)."""
    import sync_service.transports as transports

    original = transports.__dict__.setdefault("_undelayed_open_receiver", transports.open_receiver)
    transports.open_receiver = original if not delay_s else (
        lambda *args, **kw: (time.sleep(delay_s), original(*args, **kw))[1])


def pids_of(actors) -> list[int]:
    return ray.get([a.__ray_call__.remote(inject.pid) for a in actors], timeout=30)


# -- torch transport ---------------------------------------------------------------------

def test_torch_transport_push_after_add_engine_takes_a_fresh_port(pool):
    """Adding an engine reopens the channel: the new rendezvous takes a free port of
    ``SyncConfig.port_range`` on ``bind_host`` (never a fixed one), and every push works."""
    trainers, engines = pool.trainers(ep=1), pool.engines[:2]
    replay = pool.replay()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        first = probe.getsockname()[1]
    port_range = (first, min(first + 40, 65535))
    before = listening_ports()
    sync = WeightSync(trainers=trainers, engines=engines[:1], config=SyncConfig(
        transport="torch", bucket_bytes=BUCKET_BYTES, timeout_s=TIMEOUT_S, bind_host="127.0.0.1", port_range=port_range))
    try:
        ports = listening_ports() - before
        assert len(ports) == 1 and port_range[0] <= min(ports) <= port_range[1], (ports, port_range)
        sync.push(pool.next_version())
        sync.add_engine(engines[1])
        for step in (1, 2):
            replay.step(trainers, step)
            v = pool.next_version()
            t0 = time.monotonic()
            metrics = sync.push(v)
            assert time.monotonic() - t0 < TIMEOUT_S and all(e.committed for e in metrics.engines), metrics
            assert sync.engine_versions() == {n: v for n in sync.engine_versions()}
            for e in engines:
                assert_oracle_state(e, replay.oracle(), f"after push({v}) with the joined engine")
        assert len(listening_ports() - before) == 1, "the old channel's rendezvous must be closed"
    finally:
        sync.close()
    assert not listening_ports() - before, "close() must stop the rendezvous"


FOREIGN_CLIENT = """
    import json, os, socket, sys
    from datetime import timedelta
    host, port = sys.argv[1], int(sys.argv[2])
    out = {}
    try:  # a torch.distributed TCPStore client: what a local user would try first
        import torch.distributed as dist
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False)
        out["tcpstore"] = "keys: %r" % (store.list_keys(),)
        store.set("reply", b"fake reply")
    except Exception as exc:
        out["tcpstore"] = "refused: %s" % type(exc).__name__
    from sync_service.transports.store import StoreClient
    try:  # our own client, with a guessed key
        StoreClient(host, port, os.urandom(32), 5.0).push("reply", b"fake reply")
        out["wrong_key"] = "accepted"
    except Exception as exc:
        out["wrong_key"] = "refused: %s" % exc
    with socket.create_connection((host, port), timeout=5) as s:  # raw bytes instead of the handshake
        s.settimeout(15)
        data = b""
        try:
            s.sendall(b"\\x00\\x00\\x00\\x0bfake reply!" * 4)
            while chunk := s.recv(4096):
                data += chunk
            out["raw"] = "closed after %d bytes" % len(data)
        except ConnectionResetError:
            out["raw"] = "closed (reset) after %d bytes" % len(data)
    print(json.dumps(out))
"""


def test_torch_store_refuses_a_foreign_client_pushes_unaffected(pool):
    """A process without the channel's key connects to the rendezvous store (TCPStore client, a
    guessed key, raw bytes): it is disconnected before it can list or write anything, and the pushes
    around it commit, each before the timeout."""
    trainers, engine = pool.trainers(ep=1), pool.engines[0]
    replay = pool.replay()
    before = listening_ports()
    sync = WeightSync(trainers=trainers, engines=[engine], config=SyncConfig(
        transport="torch", bucket_bytes=BUCKET_BYTES, timeout_s=TIMEOUT_S))
    try:
        [port] = listening_ports() - before
        sync.push(pool.next_version())
        foreign = run_python(FOREIGN_CLIENT, "127.0.0.1", str(port))
        assert foreign.returncode == 0, foreign.stderr[-3000:]
        report = json.loads(foreign.stdout.strip().splitlines()[-1])
        assert report["tcpstore"].startswith("refused"), report
        assert report["wrong_key"].startswith("refused") and "refused the channel's key" in report["wrong_key"], report
        assert report["raw"].startswith("closed"), report
        for step in (1, 2, 3):
            replay.step(trainers, step)
            v = pool.next_version()
            t0 = time.monotonic()
            sync.push(v)
            assert time.monotonic() - t0 < TIMEOUT_S
            assert ray.get(engine.weight_version.remote(), timeout=30) == v
        assert_oracle_state(engine, replay.oracle(), "after pushes next to a foreign client")
    finally:
        sync.close()


# -- /dev/shm segments -------------------------------------------------------------------

def test_failed_constructor_leaves_no_segment_and_no_change(pool):
    """``WeightSync(timeout_s=0.001)`` fails (the engines come 2 s late to attach): the error names
    the segment, comes long before a normal timeout, the trainers' segments are gone within the
    connect window, and the engines keep exactly the version they served."""
    trainers, engines = pool.trainers(ep=2), pool.engines[:2]
    served = {e: ray.get(e.weight_version.remote(), timeout=30) for e in engines}
    states = {e: ray.get(e.state.remote(), timeout=60) for e in engines}
    trainer_pids = pids_of(trainers)
    ray.get([e.__ray_call__.remote(delay_receiver_open, 2.0) for e in engines], timeout=30)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"shm segment /dev/shm/weightsync-\S+ did not appear") as err:
            WeightSync(trainers=trainers, engines=engines, config=SyncConfig(transport="shm", bucket_bytes=BUCKET_BYTES,
                                                                             timeout_s=0.001))
        assert time.monotonic() - t0 < 30.0, err.value
    finally:
        ray.get([e.__ray_call__.remote(delay_receiver_open, 0) for e in engines], timeout=30)
    assert wait_until(lambda: not segments_of(trainer_pids), 10.0), segments_of(trainer_pids)
    for e in engines:
        assert ray.get(e.weight_version.remote(), timeout=30) == served[e]
        assert_equal_state(e, states[e], "after the failed constructor")


def test_segment_unlinked_once_attached_then_ray_shutdown_leaves_nothing(pool, model_files):
    """A WeightSync built in another driver, then ``ray.shutdown()`` before the first push: the
    segments were unlinked as soon as every engine had mapped them, so nothing is left when Ray
    kills the actors."""
    base, adapter = model_files
    ray_dir = tempfile.mkdtemp(prefix="wss", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    proc = run_python(f"""
        import json, os, ray
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir={ray_dir!r}, log_to_driver=False,
                 runtime_env={{"env_vars": {{"PYTHONPATH": {ROOT!r}, "OMP_NUM_THREADS": "1"}}}})
        from sync_service.api import SyncConfig, WeightSync
        from actors.launch import start_engines, start_trainers
        from tests.faults import inject
        from tests.faults.test_transport_resources import segments_of
        trainers = start_trainers({str(base)!r}, {str(adapter)!r}, ep=2, timeout_s=300)
        engines = start_engines({str(base)!r}, 1, timeout_s=300)
        pids = ray.get([t.__ray_call__.remote(inject.pid) for t in trainers])
        sync = WeightSync(trainers=trainers, engines=engines, config=SyncConfig(transport="shm", bucket_bytes=1 << 20))
        print(json.dumps({{"pids": pids, "while_open": segments_of(pids)}}), flush=True)
        ray.shutdown()
    """, timeout_s=400)
    shutil.rmtree(ray_dir, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["while_open"] == [], report
    assert segments_of(report["pids"]) == []


def test_interpreter_exit_and_sigkill_leave_no_segment():
    """A sender whose receivers never came: a normal interpreter exit removes its segment
    (finalizer); after a SIGKILL the segment names a dead owner and the next sender removes it."""
    code = """
        import sys, time
        from sync_service.transports import TransportSpec
        from sync_service.transports.shm import ShmSender
        s = ShmSender(TransportSpec(kind="shm", name=sys.argv[1], bucket_bytes=4096, connect_timeout_s=600), 0)
        print(s.path, flush=True)
        if sys.argv[2] == "hang":
            time.sleep(600)
    """
    done = run_python(code, "x" + uuid.uuid4().hex[:8], "exit")
    assert done.returncode == 0 and done.stdout.strip().startswith(f"{SHM_DIR}/{SEGMENT_PREFIX}"), done.stderr[-2000:]
    assert not os.path.exists(done.stdout.strip())

    hung = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), "x" + uuid.uuid4().hex[:8], "hang"],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        path = hung.stdout.readline().strip()
        assert os.path.exists(path) and segment_owner(path) == hung.pid
    finally:
        hung.send_signal(signal.SIGKILL)
        hung.wait(30)
    assert os.path.exists(path), "SIGKILL runs no finalizer: the segment is still there"
    sender = ShmSender(TransportSpec(kind="shm", name="x" + uuid.uuid4().hex[:8], bucket_bytes=4096), 0)
    try:
        assert not os.path.exists(path), "a new sender removes segments of dead owners"
    finally:
        sender.close()
    assert not os.path.exists(sender.path)


def test_trainer_group_rendezvous_binds_its_own_address(pool):
    """The trainer group's TCPStore serves on the socket rank 0 reserved on 127.0.0.1 (by itself,
    ``init_process_group("tcp://...")`` listens on every interface): the listeners a (re)made group
    adds to rank 0 are on no wildcard address, and the group works (a push over it commits)."""
    def listening(pid: int) -> set[tuple[str, int]]:
        return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp")
                if c.status == psutil.CONN_LISTEN}

    [pid] = pids_of(pool.trainers(ep=2)[:1])
    before = listening(pid)  # Ray's own worker server among them
    trainers = pool.trainers(ep=2)  # a new group: new store and gloo listeners
    new = listening(pid) - before
    assert new and not {ip for ip, _ in new} & {"0.0.0.0", "::"}, sorted(new)
    assert any(ip == "127.0.0.1" for ip, _ in new), sorted(new)
    sync = WeightSync(trainers=trainers, engines=pool.engines[:1],
                      config=SyncConfig(transport="shm", bucket_bytes=BUCKET_BYTES, timeout_s=TIMEOUT_S))
    try:
        v = pool.next_version()
        t0 = time.monotonic()
        sync.push(v)
        assert time.monotonic() - t0 < TIMEOUT_S
        assert_oracle_state(pool.engines[0], pool.replay().oracle(), f"push({v}) over 2 ranks")
    finally:
        sync.close()
