"""``sync_service.netns.NamespaceHosts``: namespaces joined by a bridge, a shaped trainers' uplink, link
cuts, byte counters, listeners, and a teardown that leaves nothing behind (also after a crash)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from sync_service.netns import HostsConfig, HostsError, NamespaceHosts, available, cleanup_stale, parse_rate

pytestmark = [pytest.mark.multinode, pytest.mark.skipif(available() is not None, reason=str(available()))]

SERVER = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.settimeout(60); n = 0
while chunk := c.recv(1 << 20):
    n += len(chunk)
print(n, flush=True)
"""
CLIENT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
t0 = time.perf_counter(); c.sendall(bytes(int(sys.argv[3]))); c.close(); print(time.perf_counter() - t0)
"""
PAYLOAD_BYTES = 12 << 20


def namespaces() -> set[str]:
    return {line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                                       check=True, timeout=30).stdout.splitlines() if line.strip()}


def serve(net: NamespaceHosts, host: str) -> tuple[subprocess.Popen, int]:
    proc = net.popen(host, [sys.executable, "-c", SERVER, net.hosts[host].address], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def test_shaped_uplink_counters_link_cut_and_teardown():
    """200 Mbit/s on the trainers' link: 12 MiB take >= 0.4 s (a cap, never a speed demand), the veth
    counts them; the listener binds its namespace address; a cut port refuses, reconnected it works;
    on exit the namespaces and the processes inside are gone."""
    config = HostsConfig(hosts=("trainers", "engines0", "engines1"), uplink_rate="200mbit", timeout_s=60)
    with NamespaceHosts(config) as net:
        assert {h.netns for h in net.hosts.values()} | {net.switch} <= namespaces()
        assert [h.address for h in net.hosts.values()] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
        server, port = serve(net, "engines0")
        assert [(x.address, x.port) for x in net.listeners("engines0")] == [("10.77.0.2", port)]
        assert net.listeners("engines1") == []
        before = net.wire_bytes("trainers")
        seconds = float(net.run("trainers", [sys.executable, "-c", CLIENT, "10.77.0.2", str(port), str(PAYLOAD_BYTES),
                                             "60"], timeout_s=120).stdout)
        assert int(server.stdout.readline()) == PAYLOAD_BYTES
        sent = net.wire_bytes("trainers").tx - before.tx
        assert PAYLOAD_BYTES <= sent < PAYLOAD_BYTES * 1.1, sent
        assert seconds >= 0.8 * PAYLOAD_BYTES * 8 / parse_rate("200mbit"), f"{seconds:.2f}s: faster than the cap"

        toward = "from sync_service.transports.store import local_address_toward as f; print(f('10.77.0.1', 9))"
        assert net.run("engines0", [sys.executable, "-c", toward], timeout_s=60).stdout.strip() == "10.77.0.2", \
            "a gloo rank on another host listens on its own address toward the store"

        server, port = serve(net, "engines1")
        net.set_link("engines1", up=False)
        with pytest.raises(HostsError, match="exit"):
            net.run("trainers", [sys.executable, "-c", CLIENT, "10.77.0.3", str(port), "1", "2"], timeout_s=60)
        net.set_link("engines1", up=True)
        net.run("trainers", [sys.executable, "-c", CLIENT, "10.77.0.3", str(port), "1000", "30"], timeout_s=60)
        assert int(server.stdout.readline()) == 1000
        sleeper = net.popen("engines1", ["sleep", "600"])
        made = {h.netns for h in net.hosts.values()} | {net.switch}
    assert sleeper.poll() is not None and not made & namespaces()


def test_a_crashed_runs_namespaces_are_cleaned_by_the_next_run():
    """Namespaces named after a pid that no longer runs go, with what runs inside; a live owner's stay."""
    pid = subprocess.Popen(["true"])
    pid.wait(timeout=30)
    stale, live = f"wsnet{pid.pid}-x", f"wsnet{os.getpid()}-y"
    for ns in (stale, live):
        subprocess.run(["ip", "netns", "add", ns], check=True, timeout=30)
    inside = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "600"])
    try:
        deadline = time.monotonic() + 30
        while not subprocess.run(["ip", "netns", "pids", stale], capture_output=True, text=True, timeout=30).stdout:
            assert time.monotonic() < deadline, "sleep did not start inside the namespace"
            time.sleep(0.05)
        assert cleanup_stale("wsnet") == [stale]
        assert inside.wait(timeout=30) != 0
        assert stale not in namespaces() and live in namespaces()
    finally:
        inside.kill()
        for ns in (stale, live):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def test_a_refused_second_instance_leaves_the_live_ones_namespaces():
    """A second ``NamespaceHosts`` of the same prefix in the same process is refused (its namespaces exist);
    its teardown removes only what it added: the live instance's namespaces and processes stay."""
    cfg = HostsConfig(hosts=("a", "b"), prefix="wstwo")
    with NamespaceHosts(cfg) as one:
        proc, _ = serve(one, "b")
        with pytest.raises(HostsError, match="File exists"):
            with NamespaceHosts(cfg):
                pass
        assert {one.switch, *(h.netns for h in one.hosts.values())} <= namespaces()
        assert proc.poll() is None, "the live instance's process was killed"
    assert not any(ns.startswith(f"wstwo{os.getpid()}-") for ns in namespaces())


@pytest.mark.parametrize("kwargs, match", [
    (dict(hosts=("trainers",)), "2-8 distinct"), (dict(hosts=("a", "a")), "2-8 distinct"),
    (dict(hosts=("a", "sw")), "not 'sw'"), (dict(uplink_rate="fast"), "'1gbit'"), (dict(uplink_rate="0gbit"), "unit"),
    (dict(subnet="8.8.8"), "private range"), (dict(mtu=100), "576-65535"), (dict(uplink_delay_ms=-1), "0-10000"),
])
def test_bad_configs_are_refused_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HostsConfig(**kwargs)
