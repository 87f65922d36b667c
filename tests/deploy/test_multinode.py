"""``weightsync run`` placement on a real multi-node Ray cluster (one machine, 3-4 Ray nodes).

Trainer shards and rollout engines are placed by the custom resources of the config
(``sync_service.cluster.placement.Deployment``), every version is compared with PEFT's ``merge_and_unload`` of
the replayed adapter (float64, cast once; ``tests.oracle``) and the engines bitwise with each other, and a
rollout node is removed while a push is in flight.
"""

from __future__ import annotations

import os
import time

import pytest
import ray

from actors.launch import RayLauncher
from sync_service.api import SyncConfig, WeightSync
from sync_service.cluster.config import parse_config
from sync_service.entrypoints.local import AdapterReplay
from sync_service.cluster.placement import Deployment
from sync_service.entrypoints.run_cli import run_versions
from tests.oracle import assert_engines_bitwise, assert_engines_match

pytestmark = pytest.mark.multinode

# Ray's object store between the nodes; 45 s: a busy machine takes > 15 s to start a mailbox worker on
# a fresh node, and the node-loss push waits this long (the trainers wait for the lost engine's ack)
SYNC = SyncConfig(transport="ray", bucket_bytes=8 << 10, timeout_s=45)


def config(base, adapter) -> object:
    return parse_config({
        "model": {"base": str(base), "adapter": str(adapter)},
        "trainers": {"ep": 2, "resource": "trainer", "resource_per_shard": 1, "placement": "PACK"},
        "engines": {"count": 2, "engine": "memory", "resource": "rollout", "resource_per_engine": 1,
                    "placement": "STRICT_SPREAD"},
        "sync": {"transport": "auto", "bucket_bytes": SYNC.bucket_bytes, "timeout_s": 120},
        "run": {"versions": 3, "verify": True},
        "cluster": {"trainer_group": {"resource_amount": 2}, "rollout_group": {"replicas": 2}}})


def test_weightsync_run_cli_on_the_cluster(cluster, tiny_files, tmp_path):
    """``weightsync run --config FILE --address HOST:PORT --json PATH`` as a separate driver process."""
    import json
    import subprocess
    import sys

    import yaml

    base, adapter = tiny_files
    doc = {"model": {"base": str(base), "adapter": str(adapter)}, "trainers": {"ep": 1},
           "engines": {"count": 1, "engine": "memory"}, "run": {"versions": 2},
           "sync": {"bucket_bytes": 8192, "timeout_s": 120}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(doc))
    out = subprocess.run([sys.executable, "-m", "actors.cli", "run", "--config", str(tmp_path / "run.yaml"),
                          "--address", cluster.address, "--json", str(tmp_path / "run.json")],
                         capture_output=True, text=True, timeout=240, env={**os.environ, "RAY_TMPDIR": os.environ["RAY_TMPDIR"]})
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    result = json.loads((tmp_path / "run.json").read_text())
    assert result["ok"] and [v["version"] for v in result["versions"]] == [0, 1]
    # verified against PEFT's merge_and_unload (float64, cast once): equal up to fp32-merge rounding
    assert all(e["verified"] and e["max_abs_diff"] < 1e-6 for v in result["versions"] for e in v["engines"])
    placed = result["placement"]
    assert placed["trainer_nodes"] == [cluster.head_node.node_id]
    assert placed["engine_nodes"][0] in {n.node_id for n in cluster.rollout_nodes}
    assert placed["transport"] == "shm", "auto: every Ray node of this cluster is on one host"
    assert "transport shm" in out.stdout and "all versions committed and verified" in out.stdout


@pytest.fixture(scope="module")
def deployed(cluster, tiny_files):
    """The config placed on the cluster, a WeightSync over Ray's object store, the adapter replay."""
    cfg = config(*tiny_files)
    dep = Deployment.start(cfg, RayLauncher())
    sync = WeightSync(trainers=dep.trainers, engines=dep.engines, config=SYNC)
    state = {"cfg": cfg, "dep": dep, "sync": sync, "replay": AdapterReplay(tiny_files[1]), "next_version": 0}
    try:
        yield state
    finally:
        state["sync"].close()
        dep.close()


def test_actors_placed_by_resource_and_three_versions_exact(cluster, deployed, peft_oracle):
    dep, cfg = deployed["dep"], deployed["cfg"]
    head = cluster.head_node.node_id
    rollout = {n.node_id for n in cluster.rollout_nodes}
    assert dep.trainer_nodes() == [head, head], "PACK on the only node advertising 'trainer'"
    engine_nodes = dep.engine_nodes()
    assert len(set(engine_nodes)) == 2 and set(engine_nodes) == rollout, "STRICT_SPREAD: one engine per rollout node"
    actor_nodes = {a["ActorID"]: a["Address"]["NodeID"] for a in ray._private.state.actors().values()}
    for engine, node in zip(dep.engines, engine_nodes):
        assert actor_nodes[engine._actor_id.hex()] == node, "engine actor runs on its bundle's node"
    assert dep.transport() == ("shm", "every actor on host " + ray.util.get_node_ip_address())

    rows = run_versions(cfg, dep, deployed["sync"], replay=deployed["replay"])
    deployed["next_version"] = 3
    assert [r.version for r in rows] == [0, 1, 2] and [r.full for r in rows] == [True, False, False]
    assert all(r.verified for r in rows), [r.engines for r in rows]
    # verified against PEFT's merge (float64, cast once: fp32-merge rounding apart); the engines bitwise alike
    assert all(e["max_abs_diff"] < 1e-6 and e["weight_version"] == r.version for r in rows for e in r.engines)
    assert_engines_match(dep.engines, peft_oracle.state(cfg.model.base, deployed["replay"]), what="version 2")
    assert_engines_bitwise(dep.engines[1:], ray.get(dep.engines[0].state.remote(), timeout=60), what="version 2")


@pytest.fixture(scope="module")
def node_lost(cluster, deployed):
    """Version v pushed while the node of engine 1 is removed; records the push outcome."""
    dep, sync, replay = deployed["dep"], deployed["sync"], deployed["replay"]
    v = max(deployed["next_version"], 1)
    ray.get([t.train_step.remote(v) for t in dep.trainers], timeout=60)
    replay.step(v)
    victim = next(n for n in cluster.rollout_nodes if n.node_id == dep.engine_nodes()[1])
    survivor, dead = dep.engines[0], dep.engines[1]
    t0 = time.monotonic()
    handle = sync.push_async(v)
    cluster.remove_node(victim)
    try:
        outcome = handle.result(SYNC.timeout_s * 2 + 90)
    except Exception as exc:  # recorded; the tests below say what is acceptable
        outcome = exc
    deployed["next_version"] = v + 1
    return {"version": v, "outcome": outcome, "seconds": time.monotonic() - t0, "survivor": survivor, "dead": dead}


def test_node_loss_mid_push_the_live_engine_commits(deployed, node_lost, peft_oracle):
    """The lost engine leaves the membership and is reported; the live one commits the same snapshot."""
    v, m = node_lost["version"], node_lost["outcome"]
    assert not isinstance(m, BaseException), f"push({v}) raised {type(m).__name__}: {m}"
    by_name = {r.engine: r for r in m.engines}
    assert by_name["engine0"].committed and not by_name["engine1"].committed
    assert "died" in by_name["engine1"].error, by_name["engine1"].error
    assert deployed["sync"].engine_versions() == {"engine0": v}
    replay = deployed["replay"]
    assert_engines_match([node_lost["survivor"]], peft_oracle.state(deployed["cfg"].model.base, replay),
                         what=f"survivor at version {v}")


def test_replacement_engine_on_a_new_node_catches_up_exactly(cluster, deployed, node_lost, peft_oracle):
    """A replacement node joins, Ray reschedules the lost bundle onto it, a fresh engine starts there
    and is admitted: it reaches the latest version (peer copy or the next push), then every engine
    equals PEFT's merge of the next version, the replacement bitwise the survivor."""
    dep, sync, replay, v = deployed["dep"], deployed["sync"], deployed["replay"], node_lost["version"]
    base = deployed["cfg"].model.base
    new_node = cluster.add_node(num_cpus=0, resources={"rollout": 1}, object_store_memory=80 << 20)
    cluster.rollout_nodes.append(new_node)
    replacement = dep.replace_engine(1)
    assert dep.engine_nodes()[1] == new_node.node_id
    name = sync.add_engine(replacement)
    if ray.get(replacement.weight_version.remote(), timeout=30) == v:  # caught up at admission (peer copy)
        assert_engines_match([replacement], peft_oracle.state(base, replay), what=f"replacement at version {v}")
    ray.get([t.train_step.remote(v + 1) for t in dep.trainers], timeout=60)
    replay.step(v + 1)
    m = sync.push(v + 1)
    assert all(r.committed for r in m.engines) and len(m.engines) == 2
    assert sync.engine_versions() == {"engine0": v + 1, name: v + 1}
    assert_engines_match([node_lost["survivor"], replacement], peft_oracle.state(base, replay),
                         what=f"version {v + 1} after node loss")
    assert_engines_bitwise([replacement], ray.get(node_lost["survivor"].state.remote(), timeout=60),
                           what=f"version {v + 1}: replacement vs survivor")
