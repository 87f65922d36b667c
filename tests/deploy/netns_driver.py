"""The driver of ``test_netns_sync.py``: runs inside the trainers' namespace, connected to the Ray
cluster across the namespace hosts, and writes what it saw as JSON (the test asserts on it).

    python -m tests.deploy.netns_driver ARGS.json OUT.json

ARGS: ``address`` (Ray), ``hosts`` (``dataclasses.asdict`` of each ``Host``, trainers' first),
``base``, ``adapter``, ``wide_base``, ``wide_adapter`` (~8 MB: the fan-out's bytes dwarf Ray's own
traffic), ``timeout_s``, ``cut_timeout_s``, ``work`` (a directory for gate files and
oracle adapters). Every engine check compares with PEFT's ``merge_and_unload`` (float64, cast once).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import ray

from actors.launch import start_engines, start_trainers
from sync_service.api import SyncConfig, WeightSync
from sync_service.entrypoints.local import AdapterReplay
from sync_service.verify.peft_oracle import compare_state, peft_merged_state
from sync_service.netns import host_from_dict, listeners, set_link, wait_for_nodes
from tests.faults import inject
from tests.oracle import our_merge

ENV = {"OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
BUCKET_BYTES = 16 << 10


class Run:
    """Actors and the reference replays of one driver run."""

    def __init__(self, args: dict) -> None:
        self.args, self.hosts = args, [host_from_dict(h) for h in args["hosts"]]
        self.trainer_host, self.engine_hosts = self.hosts[0], self.hosts[1:]
        self.base, self.timeout_s = args["base"], float(args["timeout_s"])
        self.work = Path(args["work"])
        self.trainers = start_trainers(self.base, args["adapter"], ep=2, timeout_s=self.timeout_s,
                                       actor_options={"num_cpus": 0, "resources": {"trainer": 1}})
        self.engines = start_engines(self.base, len(self.engine_hosts), engine="memory", timeout_s=self.timeout_s,
                                     actor_options=[{"num_cpus": 0, "resources": {f"host_{h.name}": 1}}
                                                    for h in self.engine_hosts])
        self.replay = AdapterReplay(args["adapter"])
        self.version = 0

    def config(self, **overrides) -> SyncConfig:
        return SyncConfig(**{"transport": "ray", "bucket_bytes": BUCKET_BYTES, "timeout_s": self.timeout_s,
                             "bind_host": self.trainer_host.address, **overrides})

    def step(self, trainers=None, replay=None) -> int:
        """One training step on the trainers and the replay; returns the version to push."""
        self.version += 1
        ray.get([t.train_step.remote(self.version) for t in (trainers or self.trainers)], timeout=self.timeout_s)
        (replay or self.replay).step(self.version)
        return self.version

    def check(self, engines, replay=None, base=None) -> list[dict]:
        """Per engine: its version, whether it equals PEFT's merge of the replay's adapter, whether it
        is bitwise merged mode's result (``tests.oracle.our_merge``: weightsync's merge of the whole base)."""
        replay, base = replay or self.replay, base or self.base
        with tempfile.TemporaryDirectory(dir=self.work) as tmp:
            oracle = peft_merged_state(base, replay.save(Path(tmp) / "adapter"))
        ours = {n: t.float().numpy() for n, t in our_merge(base, replay).items()}
        out = []
        for engine in engines:
            state = ray.get(engine.state.remote(), timeout=self.timeout_s)
            check = compare_state(state, oracle)
            out.append({"version": ray.get(engine.weight_version.remote(), timeout=self.timeout_s),
                        "peft_ok": check.ok, "max_abs_diff": check.max_abs_diff, "digest": digest(state),
                        "bitwise_merged": set(state) == set(ours) and all(
                            np.array_equal(state[n].astype(np.float32), ours[n]) for n in ours)})
        return out


def digest(state: dict) -> str:
    """A content hash of an engine's state (bitwise comparison between engines and modes)."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(np.ascontiguousarray(state[name]).tobytes())
    return h.hexdigest()


def until(ready, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(0.02)


def answering(actor, timeout_s: float) -> None:
    """Wait until ``actor`` answers again (Ray reports it unavailable while its connections recover)."""
    from ray.exceptions import ActorUnavailableError, GetTimeoutError

    end = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.weight_version.remote(), timeout=10)
            return
        except (ActorUnavailableError, GetTimeoutError):
            if time.monotonic() > end:
                raise
            time.sleep(0.5)


def metrics_row(m) -> dict:
    return {"version": m.version, "full": m.full, "mode": m.mode, "bytes": m.bytes, "seconds": m.seconds,
            "engines": [{"engine": r.engine, "committed": r.committed, "error": r.error} for r in m.engines]}


def modes(run: Run) -> list[dict]:
    """Three versions in merged mode, then three in factor mode, each checked on every engine."""
    rows = []
    for mode in ("merged", "factors"):
        sync = WeightSync(trainers=run.trainers, engines=run.engines, config=run.config(mode=mode))
        try:
            for _ in range(3):
                m = sync.push(run.step())
                rows.append({**metrics_row(m), "checks": run.check(run.engines)})
        finally:
            sync.close()
    return rows


def torch_transport(run: Run) -> dict:
    """The ``"torch"`` transport (one trainer shard: it carries one sender) across the hosts: two
    versions, checked; every listener opened meanwhile, per host (read while the channel is open)."""
    before = {h.name: set(listeners(h)) for h in run.hosts}
    trainer = start_trainers(run.base, run.args["adapter"], ep=1, timeout_s=run.timeout_s,
                             actor_options={"num_cpus": 0, "resources": {"trainer": 1}})
    replay = AdapterReplay(run.args["adapter"])
    sync = WeightSync(trainers=trainer, engines=run.engines, config=run.config(transport="torch"))
    try:
        rows = []
        for _ in range(2):
            m = sync.push(run.step(trainer, replay))
            rows.append({**metrics_row(m), "checks": run.check(run.engines, replay)})
        opened = {h.name: sorted(dataclasses.astuple(x) for x in set(listeners(h)) - before[h.name]) for h in run.hosts}
    finally:
        sync.close()
        ray.kill(trainer[0])
    return {"rows": rows, "opened": opened}


def fan_out(run: Run) -> dict:
    """The wider model's full sync to an engine on each engine host, ``relay="auto"`` (a chain here)
    then ``"direct"``, the trainers' uplink tx counted around each; then, in the chain, a push whose
    relaying engine (the first) is killed mid-push: the push names it and the other engine commits."""
    from sync_service.bench.wire import WireMeter

    base, replay, meter = run.args["wide_base"], AdapterReplay(run.args["wide_adapter"]), WireMeter(run.trainer_host)
    trainers = start_trainers(base, run.args["wide_adapter"], ep=1, timeout_s=run.timeout_s,
                              actor_options={"num_cpus": 0, "resources": {"trainer": 1}})
    engines = start_engines(base, 2, engine="memory", timeout_s=run.timeout_s, prefix="wide", actor_options=[
        {"num_cpus": 0, "resources": {f"host_{h.name}": 1}} for h in run.engine_hosts])
    out: dict = {"rows": []}
    try:
        for relay in ("direct", "auto"):
            sync = WeightSync(trainers=trainers, engines=engines, config=run.config(relay=relay, bucket_bytes=1 << 20))
            try:
                version = run.step(trainers, replay)
                meter.start()
                m = sync.push(version)
                wire = meter.stop()
                out["rows"].append({**metrics_row(m), "relay": relay, "uplink_tx": wire.uplink_tx,
                                    "checks": run.check(engines, replay, base)})
                if relay == "auto":
                    out["relay_killed"] = relay_killed(run, sync, trainers, engines, replay)
            finally:
                sync.close()
    finally:
        for actor in [*trainers, *engines]:
            ray.kill(actor)
    return out


def relay_killed(run: Run, sync, trainers, engines, replay) -> dict:
    """A push held at the trainers' fill; the relaying engine killed; the gate opened."""
    gate = run.work / "relay-gate"
    gate.mkdir()
    ray.get([t.__ray_call__.remote(inject.gate_fill, str(gate)) for t in trainers], timeout=run.timeout_s)
    version = run.step(trainers, replay)
    handle = sync.push_async(version)
    until(lambda: (gate / "reached").exists(), run.timeout_s, "a trainer's fill at the gate")
    ray.kill(engines[0])
    t0 = time.monotonic()
    (gate / "open").touch()
    m = handle.result(run.timeout_s * 4)
    return {**metrics_row(m), "seconds": time.monotonic() - t0,
            "checks": run.check(engines[1:], replay, run.args["wide_base"])}


def link_cut(run: Run, done) -> None:
    """A full sync to both engines; then a push held by a gate in the trainers' fill until the cut:
    the last engine host's link goes down mid-push, the gate opens; the push's outcome is recorded.
    The link comes back, the engine is admitted again (catch-up), the next push is checked.
    ``done(phase, **found)`` records each part."""
    cut_host, victim = run.engine_hosts[-1], run.engines[-1]
    sync = WeightSync(trainers=run.trainers, engines=run.engines, config=run.config(timeout_s=run.args["cut_timeout_s"]))
    out: dict = {}
    try:
        sync.push(run.step())
        gate = run.work / "gate"
        gate.mkdir()
        ray.get([t.__ray_call__.remote(inject.gate_fill, str(gate)) for t in run.trainers], timeout=run.timeout_s)
        v = run.step()
        handle = sync.push_async(v)
        until(lambda: (gate / "reached").exists(), run.timeout_s, "a trainer's fill at the gate")
        set_link(cut_host, up=False)
        t0 = time.monotonic()
        (gate / "open").touch()
        try:
            out["cut"] = {"outcome": metrics_row(handle.result(run.timeout_s * 4))}
        except Exception as exc:  # noqa: BLE001 - recorded; the test says what is acceptable
            out["cut"] = {"error": f"{type(exc).__name__}: {exc}"}
        out["cut"].update(seconds=time.monotonic() - t0, version=v, survivor=run.check(run.engines[:-1]))
        done("cut", **out)
        ray.get([t.__ray_call__.remote(inject.heal_trainer) for t in run.trainers], timeout=run.timeout_s)
        set_link(cut_host, up=True, peers=run.hosts)
        answering(victim, run.timeout_s * 2)
        name = sync.add_engine(victim)
        out["rejoin"] = {"name": name, "join": str(sync.joins[-1]), "checks": run.check([victim])}
        m = sync.push(run.step())
        out["after"] = {**metrics_row(m), "checks": run.check(run.engines)}
        done("rejoin", **out)
    finally:
        sync.close()


def main(args_path: str, out_path: str) -> None:
    args = json.loads(Path(args_path).read_text())
    ray.init(address=args["address"], log_to_driver=False, runtime_env={"env_vars": ENV})
    report: dict = {"phase_s": {}}
    t0 = time.monotonic()

    def done(phase: str, **found) -> None:  # the report so far, after every phase
        report.update(found)
        report["phase_s"][phase] = round(time.monotonic() - t0, 1)
        Path(out_path).write_text(json.dumps(report, indent=1, default=str))

    try:
        done("nodes", nodes=sorted(n["NodeManagerAddress"] for n in wait_for_nodes(len(args["hosts"]), 120)))
        run = Run(args)
        done("actors", placed={"trainers": ray.get([t.__ray_call__.remote(inject.node_ip) for t in run.trainers]),
                               "engines": ray.get([e.__ray_call__.remote(inject.node_ip) for e in run.engines])})
        done("fan_out", fan_out=fan_out(run))
        done("modes", modes=modes(run))
        done("torch", torch=torch_transport(run))
        try:
            link_cut(run, done)
        except Exception:  # noqa: BLE001 - recorded for the link-cut test; the other phases stand
            done("cut_failed", cut_failed=traceback.format_exc()[-3000:])
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
