"""Trainer ranks on two hosts (network namespaces on this machine, ``sync_service.netns``): rank 0 reserves the
trainer group's rendezvous on its address toward the other rank's host (not 127.0.0.1, which the other host
cannot reach), listening there only; both ranks join the gloo group and load their expert shards."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sync_service.netns import HostsConfig, NamespaceHosts, available

pytestmark = [pytest.mark.multinode, pytest.mark.skipif(available() is not None, reason=str(available())),
              pytest.mark.timeout(600)]

TIMEOUT_S = 240.0
"""Bound of each rank's process (imports, the group's rendezvous, loading its shard) on a loaded machine."""
RANK = """
import json, sys
from actors.trainer import TrainerShardCore
rank, base, peer = int(sys.argv[1]), sys.argv[2], sys.argv[3]
core = TrainerShardCore(base_dir=base, adapter_dir=None, rank=rank, ep=2)
if rank == 0:
    host, port = core.rendezvous_address([peer])
    print(json.dumps([host, port]), flush=True)
else:
    host, port = json.loads(sys.stdin.readline())
print(json.dumps({"boxes": core.setup(host, port, %r)}), flush=True)
""" % TIMEOUT_S


def test_rank0_rendezvous_reachable_from_another_host(tmp_path):
    from sync_service.synthetic import make_base

    base = make_base("qwen3_moe", tmp_path / "base", num_experts=4, num_layers=1)
    config = HostsConfig(hosts=("rank0", "rank1"), subnet="10.78.0", prefix="wstr", timeout_s=60)
    with NamespaceHosts(config) as net:
        a, b = net.hosts["rank0"].address, net.hosts["rank1"].address
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0"}  # gloo's device: the namespaces resolve no host name
        ranks = [net.popen(h, [sys.executable, "-c", RANK, str(r), str(base), peer], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for r, (h, peer) in enumerate((("rank0", b), ("rank1", a)))]
        host, port = json.loads(ranks[0].stdout.readline() or "null") or (None, None)
        assert (host, port) != (None, None), ranks[0].communicate(timeout=TIMEOUT_S)[1][-2000:]
        assert host == a, f"rank 0 bound {host}, not its address toward {b}"
        assert [(x.address, x.port) for x in net.listeners("rank0") if x.port == port] == [(a, port)]
        ranks[1].stdin.write(json.dumps([host, port]) + "\n")
        ranks[1].stdin.flush()
        outs = [r.communicate(timeout=TIMEOUT_S) for r in ranks]
    for r, (proc, (out, err)) in enumerate(zip(ranks, outs)):
        assert proc.returncode == 0, (r, err[-3000:])
        assert json.loads(out.splitlines()[-1])["boxes"] > 0, (r, out)
