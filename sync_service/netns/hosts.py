"""Hosts on one machine: network namespaces joined through a bridge, the first behind a shaped uplink.

    from sync_service.netns import HostsConfig, NamespaceHosts, available

    if (why := available()) is None:
        with NamespaceHosts(HostsConfig(hosts=("trainers", "engines0", "engines1"), uplink_rate="1gbit")) as net:
            trainers = net.hosts["trainers"]                 # Host(name, netns, address="10.77.0.1", ...)
            proc = net.popen("engines0", ["python", "-m", "my.server", "--host", net.hosts["engines0"].address])
            net.run("trainers", ["python", "-m", "my.client", "10.77.0.2"], timeout_s=60)
            print(net.wire_bytes("trainers"))               # WireBytes(tx=..., rx=...) at the host's veth
            net.set_link("engines1", up=False)               # cut a host off the switch (and back: up=True)
        # every process started through net, every process left inside the namespaces, and the
        # namespaces themselves are gone here, also after an exception

Topology: a switch namespace ``<prefix><pid>-sw`` holds bridge ``br0``; host ``i`` is namespace
``<prefix><pid>-<name>`` with ``lo`` and ``eth0`` (address ``<subnet>.<i+1>/24``), a veth pair whose
other end ``p<i>`` is a bridge port in the switch namespace. Host 0 is the trainers' host: its link
is shaped in both directions (``tc tbf`` at ``uplink_rate`` on its ``eth0`` and on ``p0``), so every
other host shares that one link, as engines on two nodes share a trainer node's NIC in a rack.
Nothing is created in the machine's own namespace and no address leaves it; two runs at once (even
of the same subnet) are separate islands. The namespaces carry the owner's pid, so a run that
crashed is cleaned up by the next one (``cleanup_stale``) without touching a live run's.

Built with iproute2's ``ip`` and ``tc`` (present wherever network namespaces are managed; a
Python binding would add a dependency for a dozen commands). Needs root (CAP_NET_ADMIN).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Host", "HostsConfig", "HostsError", "Listener", "NamespaceHosts", "WireBytes", "available",
           "cleanup_stale", "host_from_dict", "listeners", "parse_rate", "set_link", "wire_bytes"]

RATE_UNITS: dict[str, int] = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
"""``tc`` rate suffixes (SI, bits per second) accepted by ``parse_rate``."""
SWITCH = "sw"
"""Name suffix of the switch namespace (holds the bridge)."""
TBF_LATENCY_MS = 50
"""``tc tbf latency``: longest a packet waits in the shaper's queue before it is dropped."""


class HostsError(RuntimeError):
    """A namespace, link or shaper could not be made or changed; the message has the command and its stderr."""


def parse_rate(rate: str) -> int:
    """``"1gbit"`` → 1_000_000_000: a ``tc`` rate (number + one of ``RATE_UNITS``) in bits per second.

    Raises: ValueError naming the value and the accepted units.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*", str(rate).lower())
    if m is None or m.group(2) not in RATE_UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"link rate {rate!r}: give a positive number and a unit of {tuple(RATE_UNITS)}, e.g. '1gbit'")
    return int(float(m.group(1)) * RATE_UNITS[m.group(2)])


@dataclass(kw_only=True, slots=True)
class HostsConfig:
    """What ``NamespaceHosts`` builds."""

    hosts: tuple[str, ...] = ("trainers", "engines0", "engines1")
    """Host names (1-8 of ``[a-z0-9]``, 2-8 hosts); the first is the trainers' host behind the shaped uplink."""
    uplink_rate: str | None = None
    """The trainers' link rate in each direction (``tc`` units, e.g. ``"1gbit"``); ``None``: unshaped."""
    uplink_delay_ms: float = 0.0
    """One-way delay added on the trainers' link (``tc netem``); > 0 raises HostsError where netem is missing."""
    subnet: str = "10.77.0"
    """First three octets of the private /24 the hosts live in; host ``i`` gets ``<subnet>.<i+1>``."""
    mtu: int = 1500
    """MTU of every veth, bytes (9000: jumbo frames)."""
    prefix: str = "wsnet"
    """Namespace name prefix (``<prefix><pid>-<host>``); ``cleanup_stale`` removes dead owners' namespaces by it."""
    timeout_s: float = 30.0
    """Bound of every ``ip`` / ``tc`` command and of the teardown's waits, seconds."""

    def __post_init__(self) -> None:
        if not 2 <= len(self.hosts) <= 8 or len(set(self.hosts)) != len(self.hosts) or \
                not all(re.fullmatch(r"[a-z0-9]{1,8}", h) and h != SWITCH for h in self.hosts):
            raise ValueError(f"HostsConfig.hosts={self.hosts!r}: 2-8 distinct names of 1-8 chars [a-z0-9], not {SWITCH!r}")
        if self.uplink_rate is not None:
            parse_rate(self.uplink_rate)
        if not 0 <= self.uplink_delay_ms <= 10_000:
            raise ValueError(f"HostsConfig.uplink_delay_ms={self.uplink_delay_ms!r}: give 0-10000")
        if not re.fullmatch(r"(10|172\.(1[6-9]|2\d|3[01])|192\.168)(\.\d{1,3}){1,2}", self.subnet) or \
                self.subnet.count(".") != 2:
            raise ValueError(f"HostsConfig.subnet={self.subnet!r}: three octets of a private range, e.g. '10.77.0'")
        if not 576 <= self.mtu <= 65535:
            raise ValueError(f"HostsConfig.mtu={self.mtu!r}: give 576-65535")
        if not re.fullmatch(r"[a-z]{1,8}", self.prefix):
            raise ValueError(f"HostsConfig.prefix={self.prefix!r}: 1-8 letters a-z")


@dataclass(frozen=True, slots=True)
class Host:
    """One namespace host (plain values: ship it to a process as ``dataclasses.asdict``)."""

    name: str
    netns: str
    """The network namespace (``ip netns exec <netns> ...``)."""
    address: str
    """The host's own IPv4 address on ``eth0``; what its listeners bind."""
    switch: str
    """The switch namespace."""
    port: str
    """The host's bridge port (veth end) in the switch namespace."""


@dataclass(frozen=True, slots=True)
class WireBytes:
    """Byte counters of a host's ``eth0`` (``ip -s link``: Ethernet frames incl. headers and retransmits)."""

    tx: int
    rx: int


@dataclass(frozen=True, slots=True)
class Listener:
    """One listening TCP socket inside a namespace (``ss -ltnp``)."""

    address: str
    port: int
    process: str
    """``ss``'s process column (``users:(("name",pid=N,fd=M))``), empty when unknown."""


def available() -> str | None:
    """``None`` when namespace hosts can be built here, else the reason (for ``pytest.skip``)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run as root"
    missing = [tool for tool in ("ip", "tc", "ss") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found; install iproute2"
    probe = f"wsprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe, timeout_s=10)
        _ip("netns", "del", probe, timeout_s=10)
    except HostsError as exc:
        return f"cannot create a network namespace here: {exc}"
    return None


def _cmd(argv: list[str], timeout_s: float) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise HostsError(f"{' '.join(argv)}: no answer within {timeout_s:.0f}s") from None
    if out.returncode:
        raise HostsError(f"{' '.join(argv)}: {out.stderr.strip() or f'exit {out.returncode}'}")
    return out.stdout


def _ip(*args: str, ns: str | None = None, timeout_s: float = 30.0) -> str:
    return _cmd(["ip", *(["-n", ns] if ns else []), *args], timeout_s)


def _pids(ns: str, timeout_s: float) -> list[int]:
    try:
        return [int(p) for p in _ip("netns", "pids", ns, timeout_s=timeout_s).split()]
    except HostsError:
        return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_netns(names: list[str], timeout_s: float) -> None:
    """SIGTERM every process inside the namespaces ``names``, SIGKILL what still runs after
    ``timeout_s / 3``, wait up to as long again; then delete them."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in (p for ns in names for p in _pids(ns, timeout_s)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + timeout_s / 3
        while any(_pids(ns, timeout_s) for ns in names) and time.monotonic() < end:
            time.sleep(0.1)
    for ns in names:
        try:
            _ip("netns", "del", ns, timeout_s=timeout_s)
        except HostsError:
            pass  # already gone


def cleanup_stale(prefix: str = "wsnet", timeout_s: float = 30.0) -> list[str]:
    """Remove the namespaces ``<prefix><pid>-*`` whose owner ``pid`` no longer runs (a crashed run's),
    with every process left inside; returns their names. Live runs' namespaces are kept."""
    stale = []
    for line in _ip("netns", "list", timeout_s=timeout_s).splitlines():
        m = re.match(rf"({re.escape(prefix)}(\d+)-[a-z0-9]+)\b", line)
        if m and not _alive(int(m.group(2))):
            stale.append(m.group(1))
    if stale:
        _remove_netns(stale, timeout_s)
    return stale


def _shape(dev: str, ns: str, config: HostsConfig) -> None:
    """tbf at ``uplink_rate`` (burst: 10 ms of it, >= 64 KiB), with netem under it for the delay."""
    rate = parse_rate(config.uplink_rate) if config.uplink_rate else None
    t = config.timeout_s
    if config.uplink_delay_ms:
        _cmd(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "netem", "delay",
              f"{config.uplink_delay_ms}ms", "limit", "100000"], t)
    if rate:
        parent = ["parent", "1:1"] if config.uplink_delay_ms else ["root"]
        burst = max(rate // 8 // 100, 64 << 10)
        _cmd(["tc", "-n", ns, "qdisc", "replace", "dev", dev, *parent, "handle", "2:", "tbf", "rate", f"{rate}bit",
              "burst", str(burst), "latency", f"{TBF_LATENCY_MS}ms"], t)


class NamespaceHosts:
    """The hosts of ``config`` (see the module docstring); a context manager that builds on enter and
    tears everything down on exit. ``hosts``: name → ``Host``, in ``config.hosts`` order.

    Raises (enter): HostsError naming the command that failed (what was built is removed again).
    """

    def __init__(self, config: HostsConfig | None = None) -> None:
        self.config = config or HostsConfig()
        tag = f"{self.config.prefix}{os.getpid()}"
        self.switch = f"{tag}-{SWITCH}"
        self.hosts = {h: Host(name=h, netns=f"{tag}-{h}", address=f"{self.config.subnet}.{i + 1}", switch=self.switch,
                              port=f"p{i}") for i, h in enumerate(self.config.hosts)}
        self._procs: list[subprocess.Popen] = []
        self._created: list[str] = []  # namespaces this instance added: the only ones close() removes

    def __enter__(self) -> "NamespaceHosts":
        cleanup_stale(self.config.prefix, self.config.timeout_s)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        c, t = self.config, self.config.timeout_s
        for ns in (self.switch, *(h.netns for h in self.hosts.values())):
            _ip("netns", "add", ns, timeout_s=t)  # HostsError when it exists: never adopted, never removed
            self._created.append(ns)
            _ip("link", "set", "lo", "up", ns=ns, timeout_s=t)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch, timeout_s=t)
        _ip("link", "set", "br0", "up", ns=self.switch, timeout_s=t)
        for h in self.hosts.values():
            _ip("link", "add", h.port, "mtu", str(c.mtu), "type", "veth", "peer", "name", "eth0", "mtu", str(c.mtu),
                "netns", h.netns, ns=self.switch, timeout_s=t)
            _ip("link", "set", h.port, "master", "br0", "up", ns=self.switch, timeout_s=t)
            _ip("addr", "add", f"{h.address}/24", "dev", "eth0", ns=h.netns, timeout_s=t)
            _ip("link", "set", "eth0", "up", ns=h.netns, timeout_s=t)
        if c.uplink_rate or c.uplink_delay_ms:
            first = next(iter(self.hosts.values()))
            _shape("eth0", first.netns, c)
            _shape(first.port, self.switch, c)

    def argv(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` prefixed to run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host].netns, *argv]

    def popen(self, host: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``host`` (own session; ``kwargs`` go to ``subprocess.Popen``); it is
        killed on exit if still running. Does not block."""
        proc = subprocess.Popen(self.argv(host, argv), start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: str, argv: list[str], *, timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``host`` to its end (stdout/stderr captured as text).

        Raises: HostsError with its stderr's tail when it fails or runs past ``timeout_s``.
        """
        proc = self.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise HostsError(f"{' '.join(argv)} in {host}: still running after {timeout_s:.0f}s (killed)") from None
        if proc.returncode:
            raise HostsError(f"{' '.join(argv)} in {host}: exit {proc.returncode}: {err.strip()[-2000:]}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def set_link(self, host: str, *, up: bool) -> None:
        """Cut ``host`` off the switch (``up=False``: its bridge port goes down, packets are lost as on
        a pulled cable; its own address stays) or reconnect it (then every host forgets the failed
        address resolutions of the cut, so connecting works at once instead of after ARP's backoff)."""
        set_link(self.hosts[host], up=up, peers=list(self.hosts.values()), timeout_s=self.config.timeout_s)

    def wire_bytes(self, host: str) -> WireBytes:
        """Bytes sent and received so far by ``host``'s ``eth0``."""
        return wire_bytes(self.hosts[host], timeout_s=self.config.timeout_s)

    def listeners(self, host: str) -> list[Listener]:
        """Every listening TCP socket inside ``host`` right now."""
        return listeners(self.hosts[host], timeout_s=self.config.timeout_s)

    def close(self) -> None:
        """Kill what was started here and everything left inside the namespaces this instance added, remove
        them (a namespace of the same name that existed before — e.g. another live instance's — is left). Idempotent."""
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self._procs:
            try:
                proc.wait(timeout=self.config.timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        created, self._created = self._created, []
        _remove_netns(created, self.config.timeout_s)


def set_link(host: Host, *, up: bool, peers: Sequence[Host] = (), timeout_s: float = 30.0) -> None:
    """``NamespaceHosts.set_link`` for a ``Host`` shipped to another process (needs root there).
    Reconnecting flushes the neighbour caches of ``peers`` (give every host); a host left out
    reaches the reconnected one once its failed address resolutions expire (seconds)."""
    _ip("link", "set", host.port, "up" if up else "down", ns=host.switch, timeout_s=timeout_s)
    for peer in peers if up else ():
        _ip("neigh", "flush", "dev", "eth0", ns=peer.netns, timeout_s=timeout_s)


def wire_bytes(host: Host, *, timeout_s: float = 30.0) -> WireBytes:
    """``NamespaceHosts.wire_bytes`` for a ``Host`` shipped to another process."""
    stats = json.loads(_ip("-j", "-s", "link", "show", "dev", "eth0", ns=host.netns, timeout_s=timeout_s))[0]
    stats = stats.get("stats64", stats.get("stats"))
    return WireBytes(tx=int(stats["tx"]["bytes"]), rx=int(stats["rx"]["bytes"]))


def listeners(host: Host, *, timeout_s: float = 30.0) -> list[Listener]:
    """``NamespaceHosts.listeners`` for a ``Host`` shipped to another process."""
    out = _cmd(["ip", "netns", "exec", host.netns, "ss", "-Hltnp"], timeout_s)
    found = []
    for line in out.splitlines():
        cols = line.split()
        if len(cols) < 4:
            continue
        address, _, port = cols[3].rpartition(":")
        found.append(Listener(address=address.strip("[]"), port=int(port), process=" ".join(cols[5:])))
    return found


def host_from_dict(raw: dict) -> Host:
    """A ``Host`` from ``dataclasses.asdict(host)`` (e.g. read back from JSON)."""
    return Host(**{f.name: str(raw[f.name]) for f in dataclasses.fields(Host)})
