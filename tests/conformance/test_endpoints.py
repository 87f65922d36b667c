"""Endpoint conformance: every endpoint implementation (the ``TrainerShard`` and ``RolloutEngine``
actors, a live training rank's endpoint, the vLLM-server actor) answers every call of
``protocols.endpoints`` with the declared parameters; real actors return the declared report types,
with values that match what moved (one real sync, driven call by call as the coordinator does)."""

from __future__ import annotations

import inspect
import uuid

import pytest
import ray
import torch
import xxhash

from actors.rollout import RolloutEngineCore
from actors.trainer import TrainerShardCore
from actors.vllm_server import VLLMServerActorCore
from protocols.endpoints import (
    EndpointError, ExportReport, FactorCost, FactorStateReport, FactorTrainerEndpoint, OpenChannel, ReceiveReport,
    RolloutEndpoint, SendReport, SendRequest, SnapshotReport, TrainerEndpoint,
)
from protocols.params import ParamMeta
from protocols.readback import ServedWeights
from protocols.recipe import Recipe
from protocols.wire import encode
from sync_service.live.endpoint import TrainerEndpoint as LiveTrainerEndpoint
from sync_service.megatron.attach import MegatronEndpoint


IMPLEMENTATIONS = [(TrainerShardCore, TrainerEndpoint), (TrainerShardCore, FactorTrainerEndpoint),
                   (LiveTrainerEndpoint, TrainerEndpoint), (MegatronEndpoint, TrainerEndpoint),
                   (RolloutEngineCore, RolloutEndpoint), (VLLMServerActorCore, RolloutEndpoint)]


def _calls(protocol) -> list[str]:
    return sorted(n for n, v in vars(protocol).items() if inspect.isfunction(v) and not n.startswith("_"))


@pytest.mark.parametrize(("impl", "protocol"), IMPLEMENTATIONS, ids=lambda x: x.__name__)
def test_every_declared_call_is_answered_with_the_declared_parameters(impl, protocol):
    assert issubclass(impl, protocol)
    for name in _calls(protocol) + (_calls(TrainerEndpoint) if protocol is FactorTrainerEndpoint else []):
        want = [p for p in inspect.signature(getattr(protocol, name)).parameters if p != "self"]
        got = [p for p in inspect.signature(getattr(impl, name)).parameters if p != "self"]
        assert got[:len(want)] == want, f"{impl.__name__}.{name}{got} does not take {protocol.__name__}'s {want}"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from sync_service.synthetic import make_adapter, make_base

    root = tmp_path_factory.mktemp("endpoints")
    base = make_base("qwen3_moe", root / "base", num_experts=4, num_layers=1)
    return base, make_adapter("qwen3_moe", base, root / "lora", kind="target_parameters", r=2)


def test_actor_reports_are_the_declared_types(ray_local, files, tmp_path):
    """One sync of version 1 from one trainer to one engine, call by call; then a peer copy."""
    from actors.launch import start_engines, start_trainers
    from sync_service.coordinator import build_sync_plan
    from sync_service.transports import TransportSpec

    base, adapter = files
    (trainer,) = start_trainers(base, adapter)
    engine, joiner = start_engines(base, 2, prefix="conf")  # transformers engines (they can export)
    try:
        owned = ray.get(trainer.owned_metas.remote(), timeout=60)
        table = ray.get(engine.param_metas.remote(), timeout=60)
        assert owned and all(type(m) is ParamMeta for m in (*owned, *table))
        assert ray.get(engine.engine_name.remote(), timeout=60) == "conf0"
        assert ray.get(engine.weight_version.remote(), timeout=60) is None
        plan = build_sync_plan([list(owned)], bucket_bytes=1 << 20)
        spec = TransportSpec(kind="shm", name="ep" + uuid.uuid4().hex[:8], num_senders=1, num_receivers=1,
                             bucket_bytes=plan.bucket_bytes, connect_timeout_s=60, op_timeout_s=60)
        owner = "conformance"
        snap = ray.get(trainer.snapshot.remote(1), timeout=60)
        assert type(snap) is SnapshotReport and snap.version == 1
        with pytest.raises(Exception, match="send before open_transport"):  # a cancel that overtook the send
            ray.get(trainer.send.remote(SendRequest(owner=owner, session="s0", version=1, names=None, timeout_s=5.0)),
                    timeout=60)
        opened = [a.open_transport.remote(OpenChannel(owner=owner, spec=spec.to_bytes(), plan=encode(plan), index=0))
                  for a in (trainer, engine)]
        assert ray.get(opened, timeout=120) == [None, None]  # the refused send left the snapshot for the retry
        received = engine.receive.remote(owner, 60.0)
        sent = ray.get(trainer.send.remote(SendRequest(owner=owner, session="s1", version=1, names=None,
                                                       timeout_s=60.0)), timeout=120)
        got = ray.get(received, timeout=60)
        assert type(sent) is SendReport and type(got) is ReceiveReport
        assert (got.engine, got.version, got.payload_bytes, got.buckets) == ("conf0", 1, sent.payload_bytes, sent.buckets)
        values = sum(e.nbytes for e in plan.entries)  # + at most 63 bytes of alignment per entry
        assert sent.entries == len(plan.entries) and values <= sent.payload_bytes < values + 64 * len(plan.entries)
        _check_refused_commit(engine, trainer, owner, base)
        ray.get(engine.commit.remote(owner, 1), timeout=60)
        assert ray.get(engine.weight_version.remote(), timeout=60) == 1
        _check_served_weights(engine, base, adapter, table)
        _check_digests_file(engine, tmp_path / "digests.json")
        _check_factor_calls(trainer, [m.name for m in owned])
        assert type(ray.get(engine.factor_state.remote(), timeout=60)) is FactorStateReport
        _check_export(engine, joiner, table)
        ray.get([a.close_transport.remote(owner) for a in (trainer, engine)], timeout=60)
        with pytest.raises(RuntimeError, match="receive before open_transport"):
            ray.get(engine.receive.remote(owner, 1.0), timeout=60)
    finally:
        for a in (trainer, engine, joiner):
            ray.kill(a)


def _base_digests(base) -> dict[str, str]:
    from protocols.params import full_box
    from sync_service.engines.readback import tensor_digest
    from sync_service.merge.base import SafetensorsBase

    ckpt = SafetensorsBase(base)
    return {m.name: tensor_digest(ckpt.read(m.name, full_box(m.shape))) for m in ckpt.metas()}


def _check_refused_commit(engine, trainer, owner: str, base) -> None:
    """A replayed sync's commit of another version is refused and drops the staged sync: the engine serves
    its last committed weights (the base's), and the next sync of the version begins and is received."""
    with pytest.raises(Exception, match=r"commit\(101\).*dropped"):
        ray.get(engine.commit.remote(owner, 101), timeout=60)
    served = ray.get(engine.served_weights.remote(), timeout=60)
    assert served.version is None and ray.get(engine.weight_version.remote(), timeout=60) is None
    assert {n: d["xxh3_64"] for n, d in served.digests().items()} == _base_digests(base)
    received = engine.receive.remote(owner, 60.0)  # was: "begin_update(1) while version 1 is in progress"
    ray.get(trainer.send.remote(SendRequest(owner=owner, session="s2", version=1, names=None, timeout_s=60.0)),
            timeout=120)
    assert ray.get(received, timeout=60).version == 1


def _check_served_weights(engine, base, adapter, table) -> None:
    """The served digests, computed on the engine, against PEFT's float64 merge cast once: a digest is
    equal exactly where the bytes are, and the bytes are the merge's within its rounding."""
    from sync_service.engines.readback import tensor_digest
    from sync_service.verify.peft_oracle import compare_state, peft_merged_state

    served = ray.get(engine.served_weights.remote(values=True), timeout=60)
    assert type(served) is ServedWeights and served.engine == "conf0" and served.version == 1
    assert {(t.name, t.dtype, t.shape) for t in served.tensors} == {(m.name, m.dtype, m.shape) for m in table}
    oracle = peft_merged_state(base, adapter)
    equal = 0
    for t in served.tensors:
        want = oracle[t.name].contiguous()
        same_bytes = t.values == want.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert (t.xxh3_64 == tensor_digest(want)) == same_bytes, t.name
        assert t.xxh3_64 == xxhash.xxh3_64_hexdigest(t.values)
        equal += same_bytes
    assert 0 < equal < len(served.tensors)  # untouched tensors equal; the adapter changed the others
    got = {t.name: torch.frombuffer(bytearray(t.values), dtype=oracle[t.name].dtype).reshape(t.shape)
           for t in served.tensors}
    assert compare_state(got, oracle).ok
    (one,) = ray.get(engine.served_weights.remote([table[0].name]), timeout=60).tensors
    assert one.values is None and one.xxh3_64 == served.digests()[table[0].name]["xxh3_64"]
    with pytest.raises(Exception, match="not served here"):
        ray.get(engine.served_weights.remote(["no.such.tensor"]), timeout=60)


def _check_digests_file(engine, path) -> None:
    """``weightsync sync --digests FILE``'s writer: one entry per version, the engine's own digests."""
    import json

    from sync_service.entrypoints.sync_cli import write_digests

    served = ray.get(engine.served_weights.remote(), timeout=60)
    for version in (0, 1):
        write_digests(path, version, [engine], timeout_s=60)
    doc = json.loads(path.read_text())
    assert [v["version"] for v in doc["versions"]] == [0, 1]
    assert doc["versions"][1]["engines"] == {"conf0": {"version": 1, "tensors": served.digests()}}


def _check_factor_calls(trainer, names: list[str]) -> None:
    costs = ray.get(trainer.factor_costs.remote(), timeout=60)
    assert costs and all(type(c) is FactorCost and c.name in names for c in costs)
    eligible = sorted(c.name for c in costs if not c.why_not)
    recipes = ray.get(trainer.factor_recipes.remote(eligible, 2, 1 << 20), timeout=60)
    assert recipes and all(isinstance(r, Recipe) for r in recipes)


def _check_export(engine, joiner, table) -> None:
    from protocols.endpoints import ExportRequest
    from sync_service.coordinator.join import peer_plan
    from sync_service.transports import TransportSpec

    assert ray.get(engine.can_export.remote(), timeout=60) is True
    plan = peer_plan(table, bucket_bytes=1 << 20)
    spec = TransportSpec(kind="shm", name="ex" + uuid.uuid4().hex[:8], num_senders=1, num_receivers=1,
                         bucket_bytes=plan.bucket_bytes, connect_timeout_s=60, op_timeout_s=60)
    opened = joiner.open_transport.remote(OpenChannel(owner="join", spec=spec.to_bytes(), plan=encode(plan), index=0))
    sent = engine.send_weights.remote(ExportRequest(spec=spec.to_bytes(), plan=encode(plan), session="j1", version=1,
                                                    timeout_s=60.0))  # creates the channel the joiner attaches to
    ray.get(opened, timeout=120)
    received = joiner.receive.remote("join", 60.0)
    report = ray.get(sent, timeout=120)
    assert type(report) is ExportReport and report.payload_bytes == ray.get(received, timeout=60).payload_bytes
    ray.get(joiner.commit.remote("join", 1), timeout=60)
    assert ray.get(joiner.weight_version.remote(), timeout=60) == 1
    ray.get(joiner.close_transport.remote("join"), timeout=60)


def _open_channel(owner: str, plan, actors) -> None:
    from sync_service.transports import TransportSpec

    spec = TransportSpec(kind="shm", name="f" + uuid.uuid4().hex[:8], num_senders=1, num_receivers=1,
                         bucket_bytes=plan.bucket_bytes, connect_timeout_s=60, op_timeout_s=60)
    ray.get([a.open_transport.remote(OpenChannel(owner=owner, spec=spec.to_bytes(), plan=encode(plan), index=0))
             for a in actors], timeout=120)


def _sync(trainer, engine, owner: str, version: int):
    """Phase 1 of one sync of ``version`` over ``owner``'s channel: (the receive's ref, the send's ref)."""
    received = engine.receive.remote(owner, 60.0)
    sent = trainer.send.remote(SendRequest(owner=owner, session=f"{owner}-{uuid.uuid4().hex[:6]}", version=version,
                                           names=None, timeout_s=60.0))
    return received, sent


@pytest.fixture(scope="module")
def fence_actors(ray_local, files):
    """One trainer and two memory engines (cheap), shared by the fencing tests of this module."""
    from actors.launch import start_engines, start_trainers

    base, adapter = files
    (trainer,) = start_trainers(base, adapter)
    engines = start_engines(base, 2, prefix="fence", engine="memory")
    yield trainer, engines
    for a in (trainer, *engines):
        ray.kill(a)


def test_two_owners_on_one_engine_are_fenced_by_the_engine(fence_actors):
    """Two syncs (owners A: v10, B: v11) on one engine, interleaved call by call: B's begin is refused while A's
    update is staged (naming version 10), B's abort and B's commit leave A's update alone, A commits 10; B's
    next push begins once the engine is free and commits 11; a stale 10 is refused by the engine itself."""
    from sync_service.coordinator import build_sync_plan

    trainer, (engine, _) = fence_actors
    plan = build_sync_plan([list(ray.get(trainer.owned_metas.remote(), timeout=60))], bucket_bytes=1 << 20)
    for owner in ("A", "B"):
        _open_channel(owner, plan, (trainer, engine))
    ray.get([trainer.snapshot.remote(10), trainer.snapshot.remote(11)], timeout=60)
    received, sent = _sync(trainer, engine, "A", 10)
    ray.get(sent, timeout=120)
    staged = ray.get(received, timeout=60)
    assert staged.version == 10 and staged.update_id  # A's update: staged, acked, not committed
    received, sent = _sync(trainer, engine, "B", 11)
    with pytest.raises(Exception, match=r"begin_update\(11\) refused: version 10 is in progress"):
        ray.get(received, timeout=60)
    with pytest.raises(Exception, match="version 10 is in progress"):
        ray.get(sent, timeout=120)  # the trainer hears the engine's refusal
    ray.get(engine.abort.remote("B"), timeout=60)  # the coordinator of B aborts its sync: A's update survives
    with pytest.raises(Exception, match="staged no update here"):
        ray.get(engine.commit.remote("B", 11), timeout=60)
    with pytest.raises(Exception, match="not the one staged"):
        ray.get(engine.commit.remote("B", 10, "0123456789abcdef"), timeout=60)  # a forged token commits nothing
    ray.get(engine.commit.remote("A", 10, staged.update_id), timeout=60)
    assert ray.get(engine.weight_version.remote(), timeout=60) == 10
    received, sent = _sync(trainer, engine, "B", 11)  # B is not fenced out for good
    ray.get(sent, timeout=120)
    ray.get(engine.commit.remote("B", 11, ray.get(received, timeout=60).update_id), timeout=60)
    assert ray.get(engine.weight_version.remote(), timeout=60) == 11
    ray.get(trainer.snapshot.remote(10), timeout=60)
    received, sent = _sync(trainer, engine, "A", 10)  # A's replay of 10 after 11: never served again
    with pytest.raises(Exception, match=r"begin_update\(10\) refused: this engine serves version 11"):
        ray.get(received, timeout=60)
    with pytest.raises(Exception):
        ray.get(sent, timeout=120)
    ray.get(engine.abort.remote("A"), timeout=60)
    assert ray.get(engine.weight_version.remote(), timeout=60) == 11
    ray.get([a.close_transport.remote(None) for a in (trainer, engine)], timeout=60)


def test_reset_versions_is_explicit_at_the_engine(fence_actors):
    """A version at or below the served one commits only when the receive asked for ``reset_versions``."""
    from sync_service.coordinator import build_sync_plan

    trainer, (_, engine) = fence_actors
    plan = build_sync_plan([list(ray.get(trainer.owned_metas.remote(), timeout=60))], bucket_bytes=1 << 20)
    _open_channel("R", plan, (trainer, engine))
    for version, reset in ((5, False), (3, True)):
        ray.get(trainer.snapshot.remote(version), timeout=60)
        received = engine.receive.remote("R", 60.0, reset)
        ray.get(trainer.send.remote(SendRequest(owner="R", session=f"r{version}", version=version, names=None,
                                                timeout_s=60.0)), timeout=120)
        ray.get(engine.commit.remote("R", version, ray.get(received, timeout=60).update_id), timeout=60)
        assert ray.get(engine.weight_version.remote(), timeout=60) == version
    ray.get([a.close_transport.remote(None) for a in (trainer, engine)], timeout=60)


def _refuse_next_commit(actor) -> None:
    """Inside a RolloutEngine actor: its next ``commit`` finds its update dropped by an operator's abort (the
    engine's own refusal: "no finished update of that version")."""
    engine = actor.engine
    commit = engine.commit

    def refused(version, update_id=None):
        engine.commit = commit
        engine.abort()
        return commit(version, update_id)

    engine.commit = refused


def test_returned_means_committed_on_every_member(fence_actors):
    """``push`` returns only when every member engine committed: an engine that refuses its commit makes the
    push raise ``SyncError`` naming it (it serves its previous version); the others committed."""
    from sync_service.api import SyncConfig, SyncError, WeightSync

    trainer, engines = fence_actors
    sync = WeightSync(trainers=[trainer], engines=engines, config=SyncConfig(timeout_s=60, reset_versions=True))
    try:
        assert all(e.committed for e in sync.push(20).engines)
        ray.get(engines[1].__ray_call__.remote(_refuse_next_commit), timeout=60)
        with pytest.raises(SyncError, match=r"push\(21\) not committed on every member: engine fence1 did not "
                                            r"commit.*version 20 stays served.*committed on: fence0") as err:
            sync.push_async(21).result(120)
        assert {e.engine: e.committed for e in err.value.metrics.engines} == {"fence0": True, "fence1": False}
        assert ray.get([e.weight_version.remote() for e in engines], timeout=60) == [21, 20]
        assert all(e.committed for e in sync.push(22).engines)  # the next push commits everywhere
    finally:
        sync.close()


def test_add_engine_never_takes_an_engine_back(fence_actors, files):
    """An engine serving a version above the fleet's is refused in one line naming both versions and
    ``reset_versions``; ``continue_above`` admits it and the fleet's next push must go above it."""
    from actors.launch import start_engines
    from sync_service.api import SyncConfig, WeightSync

    trainer, engines = fence_actors
    (joiner,) = start_engines(files[0], 1, prefix="joiner", engine="memory")
    ahead = WeightSync(trainers=[trainer], engines=[joiner], config=SyncConfig(timeout_s=60, reset_versions=True))
    try:
        ahead.push(50)
    finally:
        ahead.close()
    fleet = WeightSync(trainers=[trainer], engines=engines[:1], config=SyncConfig(timeout_s=60, reset_versions=True))
    try:
        fleet.push(12)
        with pytest.raises(ValueError, match=r"engine joiner0 serves version 50, above this fleet's 12.*reset_versions"):
            fleet.add_engine(joiner)
        assert ray.get(joiner.weight_version.remote(), timeout=60) == 50 and fleet.engine_versions() == {"fence0": 12}
        fleet.add_engine(joiner, continue_above=True)
        with pytest.raises(ValueError, match="joiner0 already serves version 50"):
            fleet.push(13)
        assert all(e.committed for e in fleet.push(51).engines)
        assert fleet.engine_versions() == {"fence0": 51, "joiner0": 51}
    finally:
        fleet.close()
        ray.kill(joiner)


def test_endpoint_errors_are_one_line_and_name_the_endpoint():
    err = EndpointError("engine e0", "receive", "ProtocolError", "header.mac: missing or wrong HMAC")
    assert str(err) == "engine e0: receive failed: ProtocolError: header.mac: missing or wrong HMAC"
    import pickle

    again = pickle.loads(pickle.dumps(err))
    assert (type(again), str(again)) == (EndpointError, str(err))
