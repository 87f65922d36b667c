"""The served check in the engine's commit gate (``engines.served_check``, ``SyncConfig.check_served``), on the
transformers and memory engines: a version whose applied bytes were corrupted after the transport's checksum (a
fault in the engine's own ``apply``), one missing a tensor, and one that would serve NaN are refused under
``enforce`` before the engine votes — the previous version stays served, bit for bit — and committed with a
warning under ``log``. The receiver's side is ``AppliedDigests`` (what the verified buckets handed the engine)."""

from __future__ import annotations

import logging

import pytest
import torch

from sync_service.engines import faults
from sync_service.engines.commit_gate import CommitRefused
from sync_service.engines.hf import HFEngine
from sync_service.engines.memory import MemoryEngine
from sync_service.engines.served_check import AppliedDigests, findings, install
from tests.engines.test_hf_engine import tiny_model


def _engine(kind: str):
    model = tiny_model(0)
    return HFEngine(model) if kind == "hf" else MemoryEngine({n: p.detach().clone() for n, p in model.named_parameters()})


def _state(engine, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {m.name: torch.randn(m.shape, generator=gen).to(getattr(torch, m.dtype)) for m in engine.param_metas()}


def _push(updater, version: int, state: dict[str, torch.Tensor]) -> None:
    """Every tensor in two boxes along dim 0 (where it has two rows), through ``updater``; finish and commit."""
    updater.begin_update(version, list(state))
    for name, value in state.items():
        cut = value.shape[0] // 2 or value.shape[0]
        for lo, hi in ((0, cut), (cut, value.shape[0])):
            if hi > lo:
                box = ((lo, hi), *((0, d) for d in value.shape[1:]))
                updater.apply(name, box, value[lo:hi])
    updater.finish_update()
    updater.commit(version)


def _served(engine) -> dict[str, torch.Tensor]:
    return engine.served()[1]


@pytest.fixture
def fault(tmp_path, monkeypatch):
    """Arms the engines' test-only fault hook (``engines.faults``, in ``Staging.apply``) in this process:
    ``fault({"corrupt": [name]})``; ``fault(None)`` disarms."""
    path = tmp_path / "faults.json"
    monkeypatch.setenv(faults.ENV, str(path))
    return lambda spec: faults.arm(path, spec)


@pytest.mark.parametrize("kind", ["memory", "hf"])
def test_enforce_refuses_corrupt_missing_and_nonfinite_versions(kind, fault):
    """Faults armed in the engine's own apply (``engines.faults``): a byte flipped after the copy, a box counted
    as applied but never copied (a lost tensor), and a NaN the trainers sent. Each is refused naming the tensor;
    the previous version stays served bit for bit; the next clean version commits."""
    engine = _engine(kind)
    updater = install(engine, "enforce", "e0")
    assert isinstance(updater, AppliedDigests) and engine.commit_gate.check_names() == ["served"]
    v1 = _state(engine, 1)
    _push(updater, 1, v1)  # a clean version commits under enforce
    assert engine.weight_version() == 1
    served = _served(engine)
    name = next(n for n, t in v1.items() if t.shape[0] > 1)

    fault({"corrupt": [name]})
    with pytest.raises(CommitRefused, match=f"refused by the served check: .*{name}.*corrupted after the transport"):
        _push(updater, 2, _state(engine, 2))
    assert engine.weight_version() == 1 and all(torch.equal(served[n], t) for n, t in _served(engine).items())

    fault({"drop": [name]})
    with pytest.raises(CommitRefused, match=f"refused by the served check: .*{name}: box .*not applied"):
        _push(updater, 2, _state(engine, 2))
    fault(None)
    assert engine.weight_version() == 1 and all(torch.equal(served[n], t) for n, t in _served(engine).items())

    bad = _state(engine, 3)
    bad[name].view(-1)[3] = float("nan")
    with pytest.raises(CommitRefused, match=f"{name}: holds NaN/Inf"):
        _push(updater, 2, bad)
    assert engine.weight_version() == 1 and all(torch.equal(served[n], t) for n, t in _served(engine).items())

    v2 = _state(engine, 4)
    _push(updater, 2, v2)  # the engine takes the next clean version
    assert engine.weight_version() == 2 and all(torch.equal(v2[n], t) for n, t in _served(engine).items())


def test_log_commits_with_a_warning_and_off_installs_nothing(caplog, fault):
    engine = _engine("memory")
    updater = install(engine, "log", "e0")
    _push(updater, 1, _state(engine, 1))
    name = next(iter(_state(engine, 1)))
    fault({"corrupt": [name]})
    with caplog.at_level(logging.WARNING, logger="weightsync.served_check"):
        _push(updater, 2, _state(engine, 2))
    assert engine.weight_version() == 2 and f"{name}: box" in caplog.text and "committing anyway" in caplog.text
    check = engine.commit_gate.check("served").by_owner[""]
    assert (check.checked, check.refusals) == (2, 1)
    assert findings(engine) == 1 and findings(engine, "another owner") is None  # the receive report's count
    fault(None)
    _push(updater, 3, _state(engine, 3))
    assert findings(engine) == 0
    assert install(engine, "off", "e0") is engine and engine.commit_gate.check_names() == []
    assert findings(engine) is None
    with pytest.raises(ValueError, match="check_served='strict'"):
        install(engine, "strict", "e0")


def test_enforce_aborts_the_version_on_every_engine_through_ray(tmp_path):
    """Two transformers engines behind Ray; trainers whose base holds a NaN (``check_finite`` off, so they send it):
    each engine's served check refuses the version before it votes, ``push`` raises naming the tensor, and both
    engines keep serving the previous version; ``check_served="log"`` commits it. The same on a factor channel
    (``mode="factors"``: the engines merge the streamed factors themselves): a NaN in the base of a factor target
    (``q_proj``, sent as the pristine base) reaches only the engine's own merge, whose output the check refuses."""
    import shutil

    import ray
    from safetensors.torch import load_file, save_file

    from actors.launch import start_engines, start_trainers
    from sync_service.api import SyncConfig, SyncError, WeightSync
    from sync_service.synthetic import make_adapter, make_base
    from tests.ray_session import local_ray

    base = make_base("qwen3_moe", tmp_path / "base", hidden=32, intermediate=16, vocab_size=64)
    adapter = make_adapter("qwen3_moe", base, tmp_path / "lora", r=2, seed=1, kind="target_parameters",
                           target_modules=["q_proj"])
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    nan_bases = {}
    for tensor in ("model.norm.weight", q_proj):
        nan_bases[tensor] = shutil.copytree(base, tmp_path / f"nan_{len(nan_bases)}")
        weights = load_file(str(nan_bases[tensor] / "model.safetensors"))
        weights[tensor].view(-1)[0] = float("nan")
        save_file(weights, str(nan_bases[tensor] / "model.safetensors"), metadata={"format": "pt"})
    with local_ray():
        engines = start_engines(base, 2, prefix="e")
        trainers: list = []
        for nan, check, sync_mode, committed in ((None, "enforce", "merged", True),
                                                 (None, "enforce", "factors", True),
                                                 ("model.norm.weight", "enforce", "merged", False),
                                                 ("model.norm.weight", "log", "merged", True),
                                                 (q_proj, "enforce", "factors", False)):
            if not trainers or trainers[0] != nan:  # one set of trainers per base
                for t in trainers[1:]:
                    ray.kill(t)
                trainers = [nan, *start_trainers(base if nan is None else nan_bases[nan], adapter, ep=1)]
            sync = WeightSync(trainers=trainers[1:], engines=engines, config=SyncConfig(
                transport="shm", timeout_s=60, check_served=check, delta=False, mode=sync_mode))
            before = ray.get([e.served_weights.remote() for e in engines], timeout=60)
            version = max(w.version or 0 for w in before) + 1
            if committed:
                found = [e.served_findings for e in sync.push(version).engines]  # under log: committed, reported
                assert found == ([1, 1] if nan else [0, 0]), found
                assert ray.get([e.weight_version.remote() for e in engines], timeout=60) == [version] * 2
            else:
                with pytest.raises(SyncError, match=f"refused by the served check: .*{nan}: holds NaN/Inf"):
                    sync.push(version)
                after = ray.get([e.served_weights.remote() for e in engines], timeout=60)
                assert [a.digests() for a in after] == [b.digests() for b in before]  # the previous version, bitwise
                assert [a.version for a in after] == [b.version for b in before]
            sync.close()


def test_vllm_worker_store_checks_its_staging(tmp_path, fault):
    """The vLLM worker's half (``CheckpointStore.record_applied`` / ``staged_problems``, reached by the check through
    ``StagedUpdate.extra``): each box is read as it lands in the staging — a bit the copy flips (the fault hook, in
    the store's ``Staging.apply``), a box counted but never copied, and a NaN handed to it are named; a clean sync has
    no finding; not recording, nothing is compared."""
    from safetensors.torch import save_file

    from sync_service.engines.vllm.store import CheckpointStore

    save_file({"a.weight": torch.zeros(4, 3), "b.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    store = CheckpointStore(tmp_path, torch.float32)
    known = frozenset({"a.weight", "b.weight"})

    def sync(armed: dict | None = None, nan: bool = False, b: float = 1.0) -> list[str]:
        fault(armed)
        store.begin(["a.weight", "b.weight"], known)
        a = torch.arange(12.0).reshape(4, 3)
        store.apply("a.weight", ((0, 2), (0, 3)), a[:2])
        store.apply("a.weight", ((2, 4), (0, 3)), a[2:])
        store.apply("b.weight", ((0, 2),), torch.tensor([b, float("nan") if nan else 2.0]))
        store.check_complete()
        problems = store.staged_problems()
        store.drop()
        return problems

    assert sync({"corrupt": ["a.weight"]}) == []  # not recording
    store.record_applied(True)
    assert sync() == []
    (corrupted,) = sync({"corrupt": ["a.weight"]})
    assert corrupted.startswith("a.weight: box [[0, 2], [0, 3]] holds other bytes than the trainers sent")
    (dropped,) = sync({"drop": ["b.weight"]}, b=5.0)  # the staging keeps the last sync's 1.0
    assert dropped.startswith("b.weight: box [[0, 2]] holds other bytes than the trainers sent (not applied")
    assert sync(nan=True) == ["b.weight: holds NaN/Inf (would be served)"]


def test_each_channel_owner_has_its_own_check(fault):
    """Two channels (owners A and B) on one engine, both enforce: each update is judged by the check of the owner
    whose receiver began it — A's push after B's commits (a second WeightSync's check used to judge A's bytes with
    B's digests and refuse them as corrupted) — and B turning its check off leaves A's in force."""
    engine = _engine("memory")
    a, b = (install(engine, "enforce", "e0", owner) for owner in ("A", "B"))
    _push(a, 1, _state(engine, 1))
    _push(b, 2, _state(engine, 2))
    _push(a, 3, _state(engine, 3))
    assert engine.weight_version() == 3
    assert install(engine, "off", "e0", "B") is engine and engine.commit_gate.check_names() == ["served"]
    name = next(n for n, t in _state(engine, 4).items() if t.shape[0] > 1)
    fault({"corrupt": [name]})
    with pytest.raises(CommitRefused, match=f"refused by the served check: .*{name}.*corrupted after the transport"):
        _push(a, 4, _state(engine, 4))
    assert engine.weight_version() == 3


def test_the_fault_hook_is_off_without_its_environment(tmp_path, monkeypatch):
    """A fault file alone arms nothing: only a process whose environment names it (``WEIGHTSYNC_TEST_FAULTS``) reads
    it; a file that is not ``{kind: [names]}`` is refused naming the variable."""
    engine = _engine("memory")
    updater = install(engine, "enforce", "e0")
    name = next(iter(_state(engine, 1)))
    path = tmp_path / "faults.json"
    faults.arm(path, {"corrupt": [name]})
    monkeypatch.delenv(faults.ENV, raising=False)
    v1 = _state(engine, 1)
    _push(updater, 1, v1)
    assert engine.weight_version() == 1 and torch.equal(_served(engine)[name], v1[name])
    monkeypatch.setenv(faults.ENV, str(path))
    path.write_text('{"flip": ["x"]}')
    with pytest.raises(ValueError, match=f"{faults.ENV}=.*kinds"):
        faults.armed()


def test_the_receiver_hashes_the_landed_bytes(tmp_path, fault):
    """Through the receiver (``factor_stream.LocalSync``: trainer threads → shm buckets → a memory engine behind
    ``AppliedDigests``, as a rollout actor wires it): the bucket's xxh3_64 is taken over the bytes as they landed in
    the engine's staging (``AppliedDigests.apply_landed``). A clean full push commits; a bit the engine's copy flips
    (the fault hook) fails that hash while the payload is intact, so it is named as the engine's corruption and refused
    before the vote, not mistaken for the transport's; the previous version stays served, bit for bit. A NaN the
    trainers send is found as the bucket arrives (``AppliedDigests.received``) and refused."""
    from peft import PeftConfig
    from safetensors.torch import load_file

    from protocols.params import full_box
    from sync_service.factor_stream.local import LocalSync, LocalSyncConfig
    from sync_service.merge.base import SafetensorsBase
    from sync_service.synthetic import make_adapter, make_base

    base = make_base("qwen3_moe", tmp_path / "base", hidden=32, intermediate=16, vocab_size=64)
    lora = make_adapter("qwen3_moe", base, tmp_path / "lora", r=2, seed=1, kind="target_parameters")
    ckpt = SafetensorsBase(base)
    tensors = {m.name: ckpt.read(m.name, full_box(m.shape)).clone() for m in ckpt.metas()}
    state = load_file(str(lora / "adapter_model.safetensors"))
    tensors["model.layers.0.post_attention_layernorm.weight"][5] = float("nan")
    run = LocalSync(tensors, ckpt.layout, PeftConfig.from_pretrained(str(lora)), config=LocalSyncConfig(bucket_bytes=1 << 16))
    try:
        run.engine = install(run.memory, "enforce", "e0")
        with pytest.raises(RuntimeError, match="refused by the served check: .*post_attention_layernorm.weight: holds "
                                               "NaN/Inf"):
            run.push(1, state, full=True)
        assert run.memory.weight_version() is None
    finally:
        run.close()
    tensors["model.layers.0.post_attention_layernorm.weight"][5] = 1.0
    run = LocalSync(tensors, ckpt.layout, PeftConfig.from_pretrained(str(lora)), config=LocalSyncConfig(bucket_bytes=1 << 16))
    try:
        run.engine = install(run.memory, "enforce", "e0")
        run.push(1, state, full=True)
        served = run.engine_state()
        name = "model.layers.1.mlp.experts.gate_up_proj"
        fault({"corrupt": [name]})
        with pytest.raises(RuntimeError, match=f"refused by the served check: .*{name}: box .*corrupted after the "
                                               f"transport's checksum"):
            run.push(2, state, full=True)
        fault(None)
        assert run.memory.weight_version() == 1
        assert all(torch.equal(served[n], t) for n, t in run.engine_state().items())
        run.push(2, state, full=True)
        assert run.memory.weight_version() == 2
    finally:
        run.close()


def test_factor_pieces_are_compared_as_stored():
    """``AppliedDigests.check_landed``, which a factor receiver calls for every factor block and pristine base box it
    stores: the stored copy (bf16 on the wire widened to float32, as the receiver keeps factors) is compared by value
    with what the verified bucket handed over; a changed or non-finite stored value is named under the block."""
    engine = _engine("memory")
    updater = install(engine, "enforce", "e0")
    updater.begin_update(1, [])
    handed = torch.randn(4, 3).to(torch.bfloat16)
    updater.check_landed("layers.0.q_proj.lora_A#0", ((0, 12),), handed, handed.to(torch.float32))
    assert (updater.wrong, updater.nonfinite) == ({}, set())
    stored = handed.to(torch.float32)
    stored[1, 2] += 0.5
    updater.check_landed("layers.0.q_proj.lora_A#0", ((0, 12),), handed, stored)
    stored = handed.to(torch.float32).t()  # a stored copy that is no contiguous run: compared through the scratch
    stored[0, 0] = float("inf")
    updater.check_landed("layers.0.q_proj.lora_B#0", ((0, 12),), handed.t(), stored)
    problems = engine.commit_gate.check("served").by_owner[""].problems(
        engine.commit_gate.staged_update([]))
    assert problems == [
        "layers.0.q_proj.lora_A#0: box [[0, 12]] holds other bytes than the trainers sent (not applied, or corrupted "
        "after the transport's checksum)",
        "layers.0.q_proj.lora_B#0: box [[0, 12]] holds other bytes than the trainers sent (not applied, or corrupted "
        "after the transport's checksum)",
        "layers.0.q_proj.lora_B#0: holds NaN/Inf (would be served)"]
