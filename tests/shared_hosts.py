"""The namespace hosts the tests share (``tests/conftest.py``'s ``netns_hosts`` fixture): one set-up of three
network-namespace hosts with a Ray node in each, for every test that syncs across hosts.

Building them (``sync_service.netns.NamespaceHosts``: namespaces, bridge, shaped uplink; ``RayHosts``: a
``ray start`` per host, one at a time) takes about a minute on a loaded 2-core machine, so the tests that need
"trainers behind a 1 Gbit/s uplink, two engine hosts, a Ray cluster across them" share one:

    def test_mine(netns_hosts):                      # or a module-scoped fixture that takes it
        net, cluster = netns_hosts.net, netns_hosts.cluster    # NamespaceHosts, RayHosts (entered)
        out = cluster.run_driver([sys.executable, "-m", "my.driver", ...], timeout_s=600)
        # actors: resources {"trainer": 1} on trainers, {"host_engines0": 1} / {"host_engines1": 1} on the
        # engine hosts (``RESOURCES``), num_cpus=0 (the nodes advertise no CPUs)

What it is: ``HOSTS`` (hosts ``trainers``, ``engines0``, ``engines1``; the trainers' uplink shaped to 1gbit; its
own namespace prefix, so a test that builds its own ``NamespaceHosts`` with the default prefix does not
collide) and ``RAY`` (the resources of the deploy tests and of ``weightsync bench --link``'s rows). Built
on the first test that asks for it, torn down after the last test of the session that asks for it.

Between tests every link is up again (a test may cut one); nothing else is reset: a test kills the actors
it started (they die with their driver anyway) and reads byte counters as differences.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from sync_service.netns import HostsConfig, NamespaceHosts, RayHosts, RayHostsConfig, available

__all__ = ["HOSTS", "RAY", "RESOURCES", "SharedHosts", "available"]

HOSTS = HostsConfig(hosts=("trainers", "engines0", "engines1"), uplink_rate="1gbit", prefix="wsshare", timeout_s=60)
"""The shared hosts: the trainers' host first, behind the shaped uplink."""
BENCH_RESOURCE = "wsbench_{host}"
"""``sync_service.bench.link_run.HOST_RESOURCE``'s per-host resource (its rows place actors by it)."""
RESOURCES = {"trainers": {"trainer": 4, BENCH_RESOURCE.format(host="trainers"): 100},
             "engines0": {"host_engines0": 2, BENCH_RESOURCE.format(host="engines0"): 100},
             "engines1": {"host_engines1": 2, BENCH_RESOURCE.format(host="engines1"): 100}}
"""Custom resources of each host's Ray node: the deploy tests' (``trainer``, ``host_<name>``) and the bench's."""
RAY = RayHostsConfig(resources=RESOURCES, object_store_bytes=256 << 20,
                     # a cut of minutes is not a node death; the host's memory is shared with other jobs, whose
                     # use must not get our workers killed by Ray's memory monitor (the kernel's still guards)
                     env={"RAY_health_check_failure_threshold": "100", "RAY_memory_monitor_refresh_ms": "0"})
"""The shared Ray cluster (object store: the bench's floor for its --quick models)."""


@dataclass
class SharedHosts:
    """The session's namespace hosts and Ray cluster (module docstring); ``ensure`` builds them."""

    net: NamespaceHosts | None = None
    cluster: RayHosts | None = None
    builds: int = 0
    _tmp: Path | None = field(default=None, repr=False)

    def ensure(self) -> "SharedHosts":
        """Build the hosts and the cluster if they are not up. Raises HostsError as ``RayHosts`` does."""
        if self.cluster is not None:
            return self
        self._tmp = Path(tempfile.mkdtemp(prefix="wssh", dir="/tmp"))  # short: Ray's socket paths live under it
        self.net = NamespaceHosts(HOSTS).__enter__()
        try:
            self.cluster = RayHosts(self.net, RAY, temp_dir=self._tmp / "ray").__enter__()
        except BaseException:
            self.stop()
            raise
        self.builds += 1
        return self

    def clean(self) -> None:
        """Every link up again (a test that failed mid-cut may leave one down)."""
        if self.net is not None:
            for name in self.net.hosts:
                self.net.set_link(name, up=True)

    def stop(self) -> None:
        """Stop the Ray nodes, remove the namespaces (and what runs inside) and the temp dir. Idempotent."""
        try:
            if self.cluster is not None:
                self.cluster.close()
        finally:
            self.cluster = None
            if self.net is not None:
                self.net.close()
            self.net = None
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
