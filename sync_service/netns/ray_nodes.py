"""A Ray cluster across namespace hosts: the head on one host, one worker node on each other host.

    from sync_service.netns import HostsConfig, NamespaceHosts, RayHosts, RayHostsConfig

    with NamespaceHosts(HostsConfig(hosts=("trainers", "engines0", "engines1"), uplink_rate="1gbit")) as net, \\
            RayHosts(net, RayHostsConfig(resources={"trainers": {"trainer": 2}, "engines0": {"rollout": 1},
                                                    "engines1": {"rollout": 1}}), temp_dir=tmp) as cluster:
        # a driver in the head's namespace: ray.init(address=cluster.address) inside it
        cluster.run_driver([sys.executable, "-m", "my.driver"], timeout_s=300)

Each node is ``ray start --block --node-ip-address <host address>`` inside its namespace, so Ray's
raylet, object manager and workers talk over the hosts' veths (and the trainers' shaped uplink);
nothing of it listens outside the namespaces. The cluster authenticates with a token of its own
(``RAY_AUTH_MODE=token``, a fresh random token in ``temp_dir``), never the user's ``~/.ray``
token. ``RayHosts`` starts the nodes one at a time and returns once every node printed that its runtime started; the driver still
waits for the nodes to register (``wait_for_nodes``). On exit the nodes get SIGTERM (they stop their
processes), and ``NamespaceHosts`` kills whatever is left in the namespaces.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from sync_service.netns.hosts import HostsError, NamespaceHosts

__all__ = ["RayHosts", "RayHostsConfig", "wait_for_nodes"]

STARTED = "Ray runtime started."
"""What ``ray start`` prints once its node is up."""
STARTS = 3
"""Tries of one node's start (``ray start`` gives up after 30 s of a busy GCS)."""


@dataclass(kw_only=True, slots=True)
class RayHostsConfig:
    """What ``RayHosts`` starts."""

    resources: dict[str, dict[str, float]] = field(default_factory=dict)
    """Host name → the custom resources its node advertises (e.g. ``{"rollout": 1}``); every host of
    the ``NamespaceHosts`` runs a node, those not listed advertise none."""
    head: str | None = None
    """Host of the head node; ``None``: the first (trainers') host."""
    gcs_port: int = 6379
    """The head's GCS port. Fixed is safe here: the head's namespace is fresh, nothing else listens in it."""
    num_cpus: int = 0
    """CPUs each node advertises (0: actors must ask for ``num_cpus=0``; no workers are prestarted)."""
    object_store_bytes: int = 80 << 20
    """Object store of each node, bytes."""
    worker_ports: tuple[int, int] = (20000, 20999)
    """Ports of Ray's worker processes (``--min/max-worker-port``): their gRPC servers listen on every
    interface of their namespace, on one of these, so a check of listeners can tell them apart."""
    timeout_s: float = 180.0
    """Bound of the start (every node up) and of the stop, seconds."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of every node and driver, e.g. Ray's system settings
    (``RAY_health_check_failure_threshold``: how long a node may be cut off before it is declared dead)."""


class RayHosts:
    """Ray nodes on ``net``'s hosts (see the module docstring); logs and the token under ``temp_dir``.

    Raises (enter): HostsError naming the node that exited or did not start in time, with its log's tail.
    """

    def __init__(self, net: NamespaceHosts, config: RayHostsConfig, *, temp_dir: str | Path) -> None:
        unknown = set(config.resources) - set(net.hosts) | ({config.head} - set(net.hosts) if config.head else set())
        if unknown:
            raise ValueError(f"RayHostsConfig names hosts {sorted(unknown)} that are not in {list(net.hosts)}")
        self.net, self.config, self.temp_dir = net, config, Path(temp_dir)
        self.head = config.head or next(iter(net.hosts))
        self.address = f"{net.hosts[self.head].address}:{config.gcs_port}"
        token = self.temp_dir / "auth_token"
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
                    "RAY_TMPDIR": str(self.temp_dir), "RAY_USAGE_STATS_ENABLED": "0", **config.env}
        """The environment of every node and driver (the cluster's token, its temp dir)."""
        self._token = token
        self._nodes: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> "RayHosts":
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._token, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        end = time.monotonic() + self.config.timeout_s
        try:
            for host in (self.head, *(h for h in self.net.hosts if h != self.head)):
                self._start_node(host, end)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _argv(self, host: str) -> list[str]:
        c, ray = self.config, str(Path(sys.executable).with_name("ray"))
        where = ["--head", "--port", str(c.gcs_port), "--include-dashboard", "false"] if host == self.head else \
            ["--address", self.address]
        return [ray, "start", "--block", *where, "--node-ip-address", self.net.hosts[host].address,
                "--num-cpus", str(c.num_cpus), "--resources", json.dumps(c.resources.get(host, {})),
                "--object-store-memory", str(c.object_store_bytes), "--temp-dir", str(self.temp_dir / "ray"),
                "--min-worker-port", str(c.worker_ports[0]), "--max-worker-port", str(c.worker_ports[1]),
                "--disable-usage-stats"]

    def log(self, host: str) -> Path:
        """The ``ray start`` output of ``host``'s node."""
        return self.temp_dir / f"node-{host}.log"

    def _start_node(self, host: str, end: float) -> None:
        """Start ``host``'s node and wait until it is up, one node at a time (a loaded machine starts
        them faster than all at once). ``ray start`` gives a node 30 s to register with the GCS and
        exits when it did not: such a start is tried again until ``end``."""
        for attempt in range(1, STARTS + 1):
            with open(self.log(host), "wb") as log:
                proc = self._nodes[host] = self.net.popen(host, self._argv(host), env=self.env, stdout=log,
                                                          stderr=subprocess.STDOUT)
            while STARTED not in (text := self.log(host).read_text(errors="replace")):
                if proc.poll() is not None:
                    if attempt < STARTS and time.monotonic() < end:
                        break
                    raise HostsError(f"Ray node on {host} exited ({proc.returncode}): {text[-1500:]}")
                if time.monotonic() > end:
                    raise HostsError(f"Ray node on {host} not started within {self.config.timeout_s:.0f}s; "
                                     f"see {self.log(host)}")
                time.sleep(0.2)
            else:
                return

    def run_driver(self, argv: list[str], *, timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
        """Run a driver process to its end in the head's namespace with the cluster's ``env``
        (``NamespaceHosts.run``; raises HostsError when it fails or overruns ``timeout_s``)."""
        return self.net.run(self.head, argv, timeout_s=timeout_s, env={**self.env, **kwargs.pop("env", {})}, **kwargs)

    def close(self) -> None:
        """SIGTERM every node (its ``ray start --block`` stops the node's processes), wait up to
        ``timeout_s`` in all; what still runs is killed with the namespaces. Idempotent."""
        for proc in self._nodes.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + self.config.timeout_s
        for proc in self._nodes.values():
            try:
                proc.wait(timeout=max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        self._nodes.clear()


def wait_for_nodes(count: int, timeout_s: float) -> list[dict]:
    """In a driver connected with ``ray.init(address=...)``: block until ``count`` nodes are alive;
    returns ``ray.nodes()`` of the alive ones. Raises TimeoutError naming how many registered."""
    import ray

    end = time.monotonic() + timeout_s
    while True:
        alive = [n for n in ray.nodes() if n["Alive"]]
        if len(alive) >= count:
            return alive
        if time.monotonic() > end:
            raise TimeoutError(f"{len(alive)} of {count} Ray nodes registered within {timeout_s:.0f}s: "
                               f"{sorted(n['NodeManagerAddress'] for n in alive)}")
        time.sleep(0.2)
