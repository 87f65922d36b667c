"""Who may send weights: a per-session HMAC secret end to end, rogue senders refused, transports
listening only on the address they are given, secrets read only from safe files."""

from __future__ import annotations

import os
import uuid

import msgpack
import pytest
import ray
import torch

from protocols.endpoints import OpenChannel
from protocols.wire import BucketHeader, ProtocolError, encode, seal
from protocols.wire_check import decode
from sync_service.api import SyncConfig, WeightSync
from sync_service.security import SECRET_FILE_ENV, fingerprint, new_secret, read_secret_file, resolve_secret
from sync_service.streaming import TensorSource, build_plan
from sync_service.transports import ChannelHost, TransportSpec, host_channel, open_sender
from tests.conformance.peers import forge_frames
from tests.faults import inject
from tests.faults.conftest import TIMEOUT_S, assert_equal_state, engine_state

pytestmark = pytest.mark.faults

SECRET = new_secret()


def spec_for(kind: str, bucket_bytes: int) -> ChannelHost:
    """A hosted channel (torch_dist: its rendezvous store, on 127.0.0.1); the caller closes it."""
    return host_channel(TransportSpec(kind=kind, name="r" + uuid.uuid4().hex[:10], bucket_bytes=bucket_bytes,
                                      max_header_bytes=64 << 10, connect_timeout_s=TIMEOUT_S * 3,
                                      op_timeout_s=TIMEOUT_S))


def listening(pid_or_self) -> set[tuple[str, int]]:
    import psutil

    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid_or_self).net_connections("tcp") if c.status == "LISTEN"}


def sealed(frames, secret: bytes | None):
    out = []
    for header, payload in frames:
        msg = decode(header)
        if isinstance(msg, BucketHeader) and secret is not None:
            header = encode(seal(msg, secret))
        out.append((header, payload))
    return out


@pytest.mark.parametrize("kind", ["shm", "ray", "torch_dist"])
def test_rogue_sender_without_the_secret_gets_nothing_applied(pool, kind):
    """A process that opens the channel from its spec and sends well-formed buckets — without a mac,
    or sealed with another secret — is refused (``header.mac``) by an engine holding the session
    secret; nothing is applied. The same frames sealed with the right secret are applied (so the
    refusal is the secret's doing). torch_dist: the transport listens on 127.0.0.1 only."""
    engine = pool.engines[2]
    state = engine_state(engine)
    rogue_values = {n: torch.from_numpy(a + 1.0) for n, a in state.items()}
    source = TensorSource(rogue_values)
    plan = build_plan(source.param_metas(), bucket_bytes=64 << 10)
    engine_pid = ray.get(engine.__ray_call__.remote(inject.pid), timeout=30)
    for attempt, (secret, expect_ok) in enumerate([(None, False), (new_secret(), False), (SECRET, True)]):
        before_here, before_engine = listening(os.getpid()), listening(engine_pid)
        host = spec_for(kind, plan.bucket_bytes)
        spec = host.spec
        opening = engine.open_transport.remote(OpenChannel(owner="rogue", spec=spec.to_bytes(), plan=encode(plan),
                                                           index=0, secret=SECRET))
        tx = open_sender(spec, 0)
        try:
            ray.get(opening, timeout=TIMEOUT_S * 3)
            new = (listening(os.getpid()) - before_here) | (listening(engine_pid) - before_engine)
            assert all(ip == "127.0.0.1" for ip, _ in new), f"{kind} listens beyond loopback: {sorted(new)}"
            if kind == "torch_dist":
                assert ("127.0.0.1", spec.port) in new
            received = engine.receive.remote("rogue", TIMEOUT_S)
            version = max(10_000, (ray.get(engine.weight_version.remote(), timeout=30) or 0) + 1)  # above the served:
            # the engine's own version fence refuses anything else first (engines.commit_gate); the mac is under test
            for header, payload in sealed(forge_frames(plan, source, f"rogue{attempt}", version), secret):
                tx.send(header, payload, TIMEOUT_S)
            if expect_ok:
                ray.get(received, timeout=TIMEOUT_S + 10)
                ray.get(engine.commit.remote("rogue", version), timeout=30)
                assert ray.get(engine.weight_version.remote(), timeout=30) == version
                assert_equal_state(engine, {n: t.numpy() for n, t in rogue_values.items()}, "sealed with the secret")
            else:
                with pytest.raises(ProtocolError, match="header.mac: missing or wrong HMAC"):
                    ray.get(received, timeout=TIMEOUT_S + 10)
                assert_equal_state(engine, state, f"after a rogue sync ({'no mac' if secret is None else 'wrong secret'})")
        finally:
            ray.get(engine.close_transport.remote("rogue"), timeout=30)
            tx.close()
            host.close()


def test_weightsync_generates_a_per_session_secret(pool):
    trainers, engines = pool.trainers(ep=2), pool.engines[:1]
    a = WeightSync(trainers=trainers, engines=engines, config=SyncConfig(timeout_s=TIMEOUT_S))
    try:
        secret = a._coordinator._secret
        assert isinstance(secret, bytes) and len(secret) == 32
        assert "secret" not in repr(a.config)
        a.push(pool.next_version())  # trainers seal, the engine verifies: the push goes through
    finally:
        a.close()
    b = WeightSync(trainers=trainers, engines=engines, config=SyncConfig(timeout_s=TIMEOUT_S, secret=SECRET))
    try:
        assert b._coordinator._secret == SECRET != secret
        b.push(pool.next_version())
    finally:
        b.close()
    with pytest.raises(ValueError, match="need >= 16"):
        SyncConfig(secret=b"short")


def test_secret_files(tmp_path):
    """Key files are text (``openssl rand -hex 32``, as docs/deploy.md says), surrounding whitespace stripped."""
    key = SECRET.hex().encode()
    path = tmp_path / "secret"
    path.write_bytes(key + b"\n")
    path.chmod(0o600)
    assert read_secret_file(path) == key
    assert resolve_secret(None, {SECRET_FILE_ENV: str(path)}) == key
    assert resolve_secret(None, {}) is None
    assert fingerprint(key) == fingerprint(read_secret_file(path)) != fingerprint(new_secret())
    path.chmod(0o666)
    with pytest.raises(PermissionError, match="chmod 600"):
        read_secret_file(path)
    path.chmod(0o600)
    path.write_bytes(b"too short\n")
    with pytest.raises(ValueError, match="need >= 16"):
        read_secret_file(path)
    with pytest.raises(FileNotFoundError):
        read_secret_file(tmp_path / "missing")


def test_nothing_received_is_unpickled_or_imported():
    """Audit of the data plane: the modules that handle received bytes use msgpack and raw buffers
    only — no pickle, eval/exec or import by name (Ray pickles only the control-plane calls between
    our own actors, inside the trusted cluster)."""
    import ast
    import inspect

    import protocols.recipe_check
    import protocols.wire
    import protocols.wire_check
    import sync_service.streaming.receiver
    import sync_service.streaming.sender
    import sync_service.transports.shm
    import sync_service.transports.torch_dist

    banned_modules = {"pickle", "cloudpickle", "dill", "marshal", "importlib", "shelve", "ray"}
    banned_calls = {"eval", "exec", "__import__", "loads", "load", "import_module"}
    for module in (protocols.wire, protocols.wire_check, protocols.recipe_check, sync_service.streaming.receiver,
                   sync_service.streaming.sender, sync_service.transports.shm, sync_service.transports.torch_dist):
        found = []
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.Import):
                found += [a.name for a in node.names if a.name.split(".")[0] in banned_modules]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in banned_modules:
                found.append(node.module)
            elif isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                if name in banned_calls:
                    found.append(ast.unparse(f))
        assert not found, f"{module.__name__} uses {found}"
    # receiver errors travel to the sender as a wire Error (msgpack strings), not a pickled exception
    raw = msgpack.unpackb(encode(decode(encode(_error()))), raw=False)
    assert all(isinstance(v, (int, str)) for v in raw)


def _error():
    from protocols.wire import Error

    return Error(session="s", version=1, receiver=0, field="header.mac", message="refused")
