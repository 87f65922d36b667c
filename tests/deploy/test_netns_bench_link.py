"""``weightsync bench --link 1gbit --link-only --quick``: every row across namespace hosts runs once, its
bytes are counted at the hosts' interfaces, and the JSON has the documented shape.

Not a timed test: it checks structure and consistency (ratios equal the rows' quotients, wire bytes
cover the payload), not speed. Skipped with the reason where network namespaces are not allowed. The rows
run on the session's shared namespace hosts (``netns_hosts``, ``tests/shared_hosts.py``: the bench's
``link_run.hosts_for_link`` hands them over instead of building its own), and the bench leaves them standing.
It lives next to ``test_netns_sync.py``, the other user of those hosts, so they are not held idle in between.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess

import pytest

from actors.cli import main
from sync_service.bench import link_run
from sync_service.bench.link_report import LINK_GOALS
from sync_service.bench.rows import LINK_ROW_KINDS
from tests.shared_hosts import HOSTS

pytestmark = pytest.mark.multinode


@pytest.fixture(scope="module")
def report(tmp_path_factory, netns_hosts):
    tmp = tmp_path_factory.mktemp("benchlink")
    out = tmp / "bench.json"

    @contextlib.contextmanager
    def shared(link, ray_config, _tmp):
        assert (link, HOSTS.uplink_rate, tuple(netns_hosts.net.hosts)) == ("1gbit", "1gbit", link_run.HOSTS)
        assert ray_config.object_store_bytes <= netns_hosts.cluster.config.object_store_bytes, ray_config
        yield netns_hosts.net, netns_hosts.cluster

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(link_run, "hosts_for_link", shared)
        rc = main(["bench", "--quick", "--link-only", "--link", "1gbit", "--repeats", "1", "--bucket-mb", "1",
                   "--cache-dir", str(tmp / "cache"), "--timeout", "300", "--json", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0, result["failed"]
    return result


@pytest.mark.timeout(900)
def test_every_link_row_ran_and_was_counted_at_the_interfaces(report):
    assert report["failed"] == [] and report["rows"] == [] and list(report["links"]) == ["1gbit"]
    part = report["links"]["1gbit"]
    by = {r["kind"]: r for r in part["rows"]}
    assert set(by) == set(LINK_ROW_KINDS) and all(r["link"] == "1gbit" and r["size"] == 1 for r in part["rows"])
    for kind, r in by.items():
        assert len(r["seconds"]) == 1 and r["seconds"][0] > 0, kind
        assert r["wire_bytes"] >= r["bytes"] > 0, (kind, r["wire_bytes"], r["bytes"])  # frames carry the payload
        assert r["ratio_to_floor"] == pytest.approx(r["median_s"] / by["floor"]["median_s"])
    floor = by["floor"]
    assert floor["bytes"] == by["delta"]["bytes"] and floor["wire_rx_bytes"][0] >= floor["bytes"]
    assert floor["wire_bytes"] <= 1.5 * floor["bytes"] + (1 << 20), "the floor moves its bytes once"
    assert by["delta_fanout2"]["engines"] == 2 and all(b >= by["delta"]["bytes"] for b in by["delta_fanout2"]["wire_rx_bytes"])
    assert by["factors"]["bytes"] < by["delta"]["bytes"], "factor streaming moves fewer payload bytes than merged"
    fp8 = by["delta_fp8"]  # FP8 values (1 byte) + float32 scales per 32x32 block where the bf16 delta sent 2 bytes
    assert fp8["engines"] == 1 and 0.5 * by["delta"]["bytes"] < fp8["bytes"] < 0.6 * by["delta"]["bytes"]
    assert fp8["wire_bytes"] < 0.7 * by["delta"]["wire_bytes"], "half the bytes cross the link"
    assert set(by["disk"]["stages"]) == {"merge_s", "pack_s", "transfer_s", "apply_s"}


@pytest.mark.timeout(900)
def test_link_ratios_and_goals(report):
    part = report["links"]["1gbit"]
    by = {r["kind"]: r for r in part["rows"]}
    for name, ((num, a), (den, b), _) in LINK_GOALS.items():
        assert part["ratios"][name] == pytest.approx(by[num][a] / by[den][b]), name
        assert part["goals"][name]["met"] in (True, False)
    assert report["config"]["links"] == ["1gbit"]


def test_no_namespace_left_behind(report, netns_hosts):
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert f"wsnet{os.getpid()}-" not in listed
    assert netns_hosts.net.switch in listed, "the bench tore down hosts it did not build"


@pytest.mark.parametrize("argv, message", [
    (["--link", "1gb"], "link rate '1gb'"),
    (["--link", "1gbit,1gbit"], "appears twice"),
    (["--link-only"], "without links"),
    (["--sizes", "2", "--link", "1gbit"], "link_max_size"),
])
def test_bad_link_flags_are_one_line_exit_2(argv, message, capsys):
    try:
        rc = main(["bench", *argv])
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.startswith("weightsync bench: error:") and err.count("\n") == 1, err
