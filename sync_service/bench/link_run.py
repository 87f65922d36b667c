"""``weightsync bench --link RATE,...``: the rows across hosts, one set of namespace hosts per rate.

Per rate (``run_links``, in the bench process): ``sync_service.netns.NamespaceHosts`` builds three
hosts — ``trainers`` behind an uplink shaped to the rate, ``engines0`` and ``engines1`` sharing it —
a Ray node runs in each (``sync_service.netns.RayHosts``: the head in ``trainers``, custom resource
``HOST_RESOURCE`` per host, Ray's token authentication with a token of the run's own), and a driver process inside ``trainers`` (``weightsync bench --link-driver SPEC``, so
every listener of a sync binds the trainers' address) runs ``link.run_link_rows`` per size and
writes its rows as JSON; everything is torn down before the next rate.

    rows, failed = run_links(cfg, {1: model}, say=print)   # as root; rows tagged Row.link
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from sync_service.bench.model import BenchModel, ModelShape
from sync_service.bench.rows import BenchConfig, Row, guarded
from sync_service.defaults import RAY_WORKER_ENV
from sync_service.netns import HostsConfig, NamespaceHosts, RayHosts, RayHostsConfig, host_from_dict, wait_for_nodes

__all__ = ["HOSTS", "drive", "run_links"]

HOSTS = ("trainers", "engines0", "engines1")
"""The namespace hosts of a link: the trainers' host first (behind the shaped uplink)."""
HOST_RESOURCE = "wsbench_{host}"
"""Custom Ray resource of each host's node; an actor asking 0.01 of it runs there."""


def run_links(cfg: BenchConfig, models: dict[int, BenchModel], say=print) -> tuple[list[Row], list[dict]]:
    """The link rows of every rate in ``cfg.links`` at the sizes of ``models``; returns (rows, failures
    as ``{"row", "size", "error"}``). Blocks; leaves no namespace or process behind."""
    rows: list[Row] = []
    failed: list[dict] = []
    for link in cfg.links:
        say(f"link {link}: namespace hosts {', '.join(HOSTS)} (trainers' uplink shaped to {link})")
        guarded(failed, f"link {link}", 0, say, lambda: rows.extend(_one_link(cfg, models, link, say, failed)))
    return rows, failed


def _one_link(cfg: BenchConfig, models: dict[int, BenchModel], link: str, say, failed: list[dict]) -> list[Row]:
    store = max(256 << 20, 3 * max(m.shape.bf16_bytes() for m in models.values()) // 2 + 4 * cfg.bucket_bytes)
    ray_config = RayHostsConfig(resources={h: {HOST_RESOURCE.format(host=h): 100} for h in HOSTS},
                                object_store_bytes=store, timeout_s=min(cfg.timeout_s, 600.0))
    with tempfile.TemporaryDirectory(prefix="wsl") as tmp, hosts_for_link(link, ray_config, Path(tmp)) as (net, cluster):
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "rows.json"
        spec.write_text(json.dumps(_spec(cfg, models, link, net, cluster.address, out, Path(tmp) / "work")))
        proc = net.popen(cluster.head, [sys.executable, "-m", "actors.cli", "bench", "--link-driver", str(spec)],
                         env=cluster.env)
        try:
            proc.wait(timeout=cfg.timeout_s * (len(models) * 4 + 1))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"bench --link {link}: the driver did not finish within its bound") from None
        if not out.exists():
            raise RuntimeError(f"bench --link {link}: the driver exited {proc.returncode} without rows (see above)")
        result = json.loads(out.read_text())
    failed.extend(result["failed"])
    return [Row(**r) for r in result["rows"]]


@contextlib.contextmanager
def _own_hosts(link: str, ray_config: RayHostsConfig, tmp: Path):
    """``HOSTS`` as namespace hosts (the trainers' uplink shaped to ``link``) with a Ray node each; torn down on exit."""
    with NamespaceHosts(HostsConfig(hosts=HOSTS, uplink_rate=link)) as net, \
            RayHosts(net, ray_config, temp_dir=tmp / "ray") as cluster:
        yield net, cluster


hosts_for_link = _own_hosts
"""``(link, ray_config, tmp) -> context manager of (NamespaceHosts, RayHosts)``: where the rows of a rate run.
A caller that already holds such hosts (``HOSTS``, the uplink at that rate, nodes advertising ``HOST_RESOURCE``
per host) may put a factory of its own here (the test suite shares one set of hosts between its tests)."""


def _spec(cfg: BenchConfig, models: dict[int, BenchModel], link: str, net: NamespaceHosts, address: str, out: Path,
          work: Path) -> dict:
    return {"link": link, "ray_address": address, "out": str(out), "work_dir": str(work),
            "config": {"bucket_bytes": cfg.bucket_bytes, "repeats": cfg.repeats, "quick": cfg.quick, "ep": cfg.ep,
                       "timeout_s": cfg.timeout_s, "link_transport": cfg.link_transport},
            "models": [{"size": s, "shape": dataclasses.asdict(m.shape), "base_dir": str(m.base_dir),
                        "adapter_dir": str(m.adapter_dir)} for s, m in sorted(models.items())],
            "hosts": [dataclasses.asdict(h) for h in net.hosts.values()]}


def drive(spec_path: Path, launcher, say=print) -> int:
    """The driver inside the trainers' host: connect to the head, run the link rows of the spec
    ``run_links`` wrote, write ``{"rows", "failed"}`` to its ``out``. Returns 0."""
    import ray

    from sync_service.bench.link import LinkSite, run_link_rows

    spec = json.loads(Path(spec_path).read_text())
    hosts = [host_from_dict(h) for h in spec["hosts"]]
    options = [{"resources": {HOST_RESOURCE.format(host=h.name): 0.01}} for h in hosts]
    site = LinkSite(trainer=hosts[0], engines=tuple(hosts[1:]), trainer_options=options[0],
                    engine_options=tuple(options[1:]))
    cfg = BenchConfig(sizes=tuple(m["size"] for m in spec["models"]), **spec["config"])
    rows: list[Row] = []
    failed: list[dict] = []
    work = Path(spec["work_dir"])
    work.mkdir(parents=True, exist_ok=True)
    ray.init(address=spec["ray_address"], log_to_driver=False, runtime_env={"env_vars": RAY_WORKER_ENV})
    try:
        wait_for_nodes(len(hosts), cfg.timeout_s)
        for m in spec["models"]:
            model = BenchModel(shape=ModelShape(**m["shape"]), base_dir=Path(m["base_dir"]), adapter_dir=Path(m["adapter_dir"]))
            say(f"{m['size']}x over {spec['link']}")
            run_link_rows(model, cfg, m["size"], spec["link"], site, rows, launcher, work,
                          lambda what, step, size=m["size"]: guarded(failed, what, size, say, step), say=say)
    finally:
        ray.shutdown()
        Path(spec["out"]).write_text(json.dumps({"rows": [dataclasses.asdict(r) for r in rows], "failed": failed}))
    return 0
