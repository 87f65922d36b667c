"""Syncs across hosts: three network namespaces on one machine (``sync_service.netns``), a Ray node in
each (the session's shared ``netns_hosts``: ``tests/shared_hosts.py``); trainers (EP=2) in one, an engine in
each of the two others, the trainers' link shaped to 1 Gbit/s.

The driver (``netns_driver.py``) runs inside the trainers' namespace and reports; here: the fan-out to
both engine hosts relayed (each byte once over the trainers' link), and the relay's death; every version
of merged and factor mode equals PEFT's merge on both engines, factor mode bitwise equal to merged
mode; the ``"torch"`` transport's listeners bind only their own host's address; a link cut mid-push
fails that engine within the timeout, naming it, while the other commits; reconnected, it catches up
exactly.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.shared_hosts import RAY, available

pytestmark = [pytest.mark.multinode, pytest.mark.skipif(available() is not None, reason=str(available())),
              pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60.0
CUT_TIMEOUT_S = 30.0
"""The push timeout while the link is cut (the failed push ends within it + the coordinator's grace); it
also bounds the reopen for the survivor, which starts new mailbox actors (processes) on a loaded machine."""


@pytest.fixture(scope="module")
def wide_files(tmp_path_factory):
    """A ~8 MB Qwen3-MoE base (H=256, E=8, vocab 2048) and a rank-2 LoRA: the fan-out's bytes."""
    from sync_service.synthetic import make_adapter, make_base

    root = tmp_path_factory.mktemp("wide")
    base = make_base("qwen3_moe", root / "base", num_experts=8, num_layers=1, hidden=256, intermediate=128,
                     vocab_size=2048)
    return base, make_adapter("qwen3_moe", base, root / "lora", kind="target_parameters", r=2)


@pytest.fixture(scope="module")
def report(tiny_files, wide_files, netns_hosts):
    base, adapter = tiny_files
    work = Path(tempfile.mkdtemp(prefix="wsnetns", dir="/tmp"))
    net, cluster = netns_hosts.net, netns_hosts.cluster
    try:
        args = {"address": cluster.address, "hosts": [asdict(h) for h in net.hosts.values()], "base": str(base),
                "adapter": str(adapter), "wide_base": str(wide_files[0]), "wide_adapter": str(wide_files[1]),
                "timeout_s": TIMEOUT_S, "cut_timeout_s": CUT_TIMEOUT_S, "work": str(work)}
        (work / "args.json").write_text(json.dumps(args))
        out = subprocess.run(net.argv("trainers", [sys.executable, "-m", "tests.deploy.netns_driver",
                                                   str(work / "args.json"), str(work / "out.json")]),
                             cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=720)
        result = json.loads((work / "out.json").read_text()) if (work / "out.json").exists() else {}
        yield {"rc": out.returncode, "log": out.stderr[-4000:], "hosts": net.hosts, **result}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_actors_run_on_their_hosts(report):
    assert report["rc"] == 0, (report["log"], {k: v for k, v in report.items() if k in ("phase_s", "cut")})
    hosts = report["hosts"]
    assert report["nodes"] == sorted(h.address for h in hosts.values())
    assert report["placed"] == {"trainers": [hosts["trainers"].address] * 2,
                                "engines": [hosts["engines0"].address, hosts["engines1"].address]}


def engines_exact(row: dict, version: int) -> None:
    """Every engine of ``row`` committed ``version`` and equals PEFT's merge, bitwise the merged-mode result."""
    assert all(e["committed"] for e in row["engines"]), row["engines"]
    for check in row["checks"]:
        assert check["version"] == version and check["peft_ok"] and check["bitwise_merged"], check
    assert len({c["digest"] for c in row["checks"]}) == 1, "the engines differ"


def test_fan_out_to_two_hosts_sends_each_byte_once_over_the_trainers_link(report):
    """The default relay chains the two engine hosts: the trainers' uplink carries the payload once
    (< 1.15 x, Ray's control traffic included; seen 1.02 x, and 1.28 x for ``relay="direct"`` alongside,
    where Ray fetches part of the second copy from the first engine's node, up to 2 x on a slow link),
    both engines equal PEFT's merge; the relaying engine killed mid-push: the push names it, the other
    engine commits."""
    direct, chain = report["fan_out"]["rows"]
    for row in (direct, chain):
        assert row["full"], row
        engines_exact(row, row["version"])
    assert chain["uplink_tx"] < 1.15 * chain["bytes"], (chain["uplink_tx"], chain["bytes"], direct["uplink_tx"])
    killed = report["fan_out"]["relay_killed"]
    by_name = {e["engine"]: e for e in killed["engines"]}
    assert not by_name["wide0"]["committed"] and "engine wide0 died" in by_name["wide0"]["error"], by_name
    assert by_name["wide1"]["committed"], by_name
    assert killed["checks"][0]["version"] == killed["version"] and killed["checks"][0]["peft_ok"], killed
    assert killed["seconds"] < TIMEOUT_S, killed["seconds"]


def test_merged_then_factor_mode_three_versions_exact_on_both_hosts(report):
    rows = report["modes"]
    assert [(r["mode"], r["full"]) for r in rows] == [("merged", True), ("merged", False), ("merged", False),
                                                      ("factors", True), ("factors", False), ("factors", False)]
    for row in rows:
        engines_exact(row, row["version"])
    merged_delta, factor_delta = rows[1]["bytes"], rows[4]["bytes"]
    assert 0 < factor_delta < merged_delta, (factor_delta, merged_delta)


def test_torch_transport_listens_only_on_each_hosts_own_address(report):
    """The store (coordinator) and gloo (trainer, engines) each bind their namespace's address: seen
    with ``ss -ltnp`` inside every namespace while the channel was open."""
    torch_run, hosts = report["torch"], report["hosts"]
    for row in torch_run["rows"]:
        engines_exact(row, row["version"])
    first, last = RAY.worker_ports
    for name, opened in torch_run["opened"].items():
        ours = [(address, port, process) for address, port, process in opened
                if not (address == "*" and first <= port <= last)]  # Ray's own worker servers (RayHostsConfig)
        assert ours, f"nothing new listens on {name}: the channel's gloo pairs were not seen"
        assert {address for address, _, _ in ours} == {hosts[name].address}, (name, ours)


def test_link_cut_mid_push_fails_that_engine_the_other_commits_then_it_catches_up(report):
    assert "cut_failed" not in report, report["cut_failed"]
    cut = report["cut"]
    assert "outcome" in cut, cut.get("error")
    by_name = {e["engine"]: e for e in cut["outcome"]["engines"]}
    assert by_name["engine0"]["committed"] and not by_name["engine1"]["committed"], by_name
    assert "engine engine1 did not answer" in by_name["engine1"]["error"], by_name["engine1"]["error"]
    # the coordinator gives up after timeout_s + its 30 s grace; then the survivor gets the snapshot again
    assert cut["seconds"] < CUT_TIMEOUT_S + 30 + TIMEOUT_S, cut["seconds"]
    assert cut["survivor"][0]["version"] == cut["version"] and cut["survivor"][0]["peft_ok"]
    rejoin = report["rejoin"]  # at the fleet's version by a peer copy, or by the next push (full for it)
    if "source='next-push'" not in rejoin["join"]:
        assert rejoin["checks"][0]["version"] == cut["version"] and rejoin["checks"][0]["peft_ok"], rejoin
    assert [e["engine"] for e in report["after"]["engines"]] == ["engine0", rejoin["name"]]
    engines_exact(report["after"], cut["version"] + 1)
