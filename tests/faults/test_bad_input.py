"""Bad input end to end through WeightSync and real engines: tampered buckets on the wire, a version
regression, plans that do not fit an engine, NaN/Inf in merged weights. Each: a clear error naming
the thing, and every engine still serves its previous version, bit for bit."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import ray
from safetensors.torch import load_file, save_file

from sync_service.api import PlanMismatchError, SyncConfig, SyncError, WeightSync
from actors.launch import start_engines
from tests.faults import inject
from tests.faults.conftest import TIMEOUT_S, assert_equal_state, engine_state

pytestmark = pytest.mark.faults

CONFIG = SyncConfig(transport="shm", bucket_bytes=1 << 10, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def synced(pool):
    """Two trainers (EP=2) and two engines with one version committed; yields (sync, trainers, engines)."""
    trainers, engines = pool.trainers(ep=2), pool.engines[:2]
    sync = WeightSync(trainers=trainers, engines=engines, config=CONFIG)
    sync.push(pool.next_version())
    yield sync, trainers, engines
    sync.close()


def served(engines) -> tuple[list, list]:
    return ray.get([e.weight_version.remote() for e in engines], timeout=30), [engine_state(e) for e in engines]


def assert_unchanged(engines, before, what: str) -> None:
    versions, states = before
    assert ray.get([e.weight_version.remote() for e in engines], timeout=30) == versions, what
    for e, state in zip(engines, states):
        assert_equal_state(e, state, what)


@pytest.mark.parametrize("mode,field", [("corrupt", "header.checksum"), ("truncate", "header.payload_nbytes"),
                                        ("duplicate", "header.seq"), ("reorder", "header.seq")])
def test_tampered_bucket_refused_nothing_applied(pool, synced, mode, field):
    """A trainer's bucket 1 is altered after sealing (a flipped payload byte, one byte short, sent
    twice, swapped with bucket 0): every engine refuses it, the push fails naming the field, no
    engine changes, and the next push goes through."""
    sync, trainers, engines = synced
    step = pool.next_version()  # one step for every rank: replicas must agree
    ray.get([t.train_step.remote(step) for t in trainers], timeout=30)
    before = served(engines)
    ray.get(trainers[0].__ray_call__.remote(inject.tamper_frames, mode), timeout=30)
    with pytest.raises(SyncError, match=field.replace(".", r"\.")) as err:
        sync.push(pool.next_version())
    assert not any(e.committed for e in err.value.metrics.engines)
    assert_unchanged(engines, before, f"after a {mode} bucket")
    v = pool.next_version()
    assert all(e.committed for e in sync.push(v).engines)
    assert ray.get([e.weight_version.remote() for e in engines], timeout=30) == [v, v]


def test_version_regression_refused_nothing_applied(pool, synced):
    sync, trainers, engines = synced
    v = pool.next_version()
    sync.push(v)
    ray.get([t.train_step.remote(v) for t in trainers], timeout=30)
    before = served(engines)
    for stale in (v - 1, v):
        with pytest.raises(ValueError, match=rf"push_async\({stale}\): versions must increase; the last push was {v}"):
            sync.push(stale)
    for bad in (v + 0.5, True, str(v + 1)):  # refused on the driver, before any snapshot or byte
        with pytest.raises(TypeError, match=rf"push_async\({bad!r}\): version must be an int"):
            sync.push(bad)
    for bad in (2**63, 2**70, -1):  # past int64 it once failed in the trainer, "Integer value out of range"
        with pytest.raises(ValueError, match=rf"push_async\({bad}\): version must be in \[0, 2\*\*63 - 1\]"):
            sync.push(bad)
    assert_unchanged(engines, before, "after a refused version regression")
    assert sync.latest_version == v


def test_push_after_close_refused_before_any_snapshot(pool, synced):
    """A second WeightSync on the module's actors (reconfiguring them with ``pool.trainers`` would close
    every channel of theirs): closed, it refuses a push before any snapshot; the first one keeps working
    (the next test pushes through it)."""
    _, trainers, engines = synced
    sync = WeightSync(trainers=trainers, engines=engines, config=CONFIG)
    sync.close()
    before = served(engines)
    with pytest.raises(RuntimeError, match=r"push_async\(\d+\): this WeightSync is closed"):
        sync.push(pool.next_version())
    assert_unchanged(engines, before, "after a push on a closed WeightSync")


def test_non_finite_factors_refused_on_every_push(pool, synced):
    """A training step that leaves NaN in a LoRA factor: the next push (whose adapter is refreshed in
    place, not normalised again) is refused naming the factor key; nothing is applied; once the
    factor is finite again the push goes through with the new values."""
    sync, trainers, engines = synced
    sync.push(pool.next_version())  # a delta sync on the cached adapter first
    before = served(engines)
    factors = ray.get(trainers[1].local_factors.remote(), timeout=30)
    key = sorted(k for k in factors if "layers.1" in k and "lora_B" in k)[0]
    poisoned = factors[key].copy()
    poisoned.flat[5] = np.nan
    ray.get(trainers[1].set_factors.remote({key: poisoned}), timeout=30)
    try:
        with pytest.raises(SyncError, match=rf"adapter key {key.replace('.', r'[.]')}: holds NaN or Inf") as err:
            sync.push(pool.next_version())
        assert not any(e.committed for e in err.value.metrics.engines)
        assert_unchanged(engines, before, "after a NaN factor was refused")
    finally:
        ray.get(trainers[1].set_factors.remote({key: factors[key]}), timeout=30)
    step = pool.next_version()  # one step for every rank: replicas must agree
    ray.get([t.train_step.remote(step) for t in trainers], timeout=30)
    v = pool.next_version()
    assert all(e.committed for e in sync.push(v).engines)
    assert ray.get([e.weight_version.remote() for e in engines], timeout=30) == [v, v]


def test_non_finite_merged_weights_refused_with_the_tensor_name(pool, synced):
    """With ``SyncConfig.check_finite`` the trainers check every merged box: finite factors whose
    product overflows fp32 (Inf), and a NaN in a base tensor (full fine-tuning), are refused naming
    the tensor; nothing is applied. (Non-finite factors are refused anyway, by the adapter check.)"""
    sync, trainers, engines = synced
    before = served(engines)
    factors = ray.get(trainers[1].local_factors.remote(), timeout=30)
    pair = sorted(k for k in factors if "layers.1" in k and "experts" in k and "base_layer" in k)
    assert len(pair) == 2, pair  # lora_A, lora_B of layers.1 experts gate_up_proj
    norm = "model.layers.0.post_attention_layernorm.weight"
    owner = next(t for t in trainers if any(m.name == norm for m in ray.get(t.owned_metas.remote(), timeout=30)))
    base = ray.get(owner.local_base.remote(), timeout=30)
    sync.config.check_finite = True
    try:
        ray.get(trainers[1].set_factors.remote({k: np.full_like(factors[k], 1e30) for k in pair}), timeout=30)
        with pytest.raises(SyncError, match=r"merged model\.layers\.1\.mlp\.experts\.gate_up_proj has NaN or Inf") as err:
            sync.push(pool.next_version())
        assert not any(e.committed for e in err.value.metrics.engines)
        assert_unchanged(engines, before, "after an Inf version was refused")
        ray.get(trainers[1].set_factors.remote({k: factors[k] for k in pair}), timeout=30)
        poisoned = base[norm].copy()
        poisoned.flat[3] = np.nan
        ray.get(owner.update_base.remote({norm: poisoned}), timeout=30)
        with pytest.raises(SyncError, match=rf"merged {norm.replace('.', r'[.]')} has NaN or Inf"):
            sync.push(pool.next_version())
        assert_unchanged(engines, before, "after a NaN version was refused")
        ray.get(owner.update_base.remote({norm: base[norm]}), timeout=30)
    finally:
        sync.config.check_finite = False
        ray.get(trainers[1].set_factors.remote({k: factors[k] for k in pair}), timeout=30)


def _altered_checkpoint(base, out, name: str, change) -> str:
    shutil.copytree(base, out)
    tensors = load_file(str(out / "model.safetensors"))
    tensors[name] = change(tensors[name])
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


@pytest.mark.parametrize("change,needle", [
    (lambda t: t.to(__import__("torch").float16), r"model\.norm\.weight: sent float32\[16\] vs engine float16\[16\]"),
    (lambda t: t[:8].clone(), r"model\.norm\.weight: sent float32\[16\] vs engine float32\[8\]"),
    (None, r"model\.norm\.weight"),
], ids=["dtype", "shape", "unknown_name"])
def test_plan_mismatch_refused_before_any_byte(pool, synced, tmp_path, change, needle):
    """An engine whose table differs (a dtype, a shape, a name the trainers send that it lacks) is
    refused by ``add_engine`` naming the tensor; the members are untouched and keep syncing."""
    sync, trainers, engines = synced
    if change is None:
        out = tmp_path / "ckpt"
        shutil.copytree(pool.base, out)
        tensors = load_file(str(out / "model.safetensors"))
        del tensors["model.norm.weight"]
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        ckpt = str(out)
    else:
        ckpt = _altered_checkpoint(pool.base, tmp_path / "ckpt", "model.norm.weight", change)
    [odd] = start_engines(ckpt, 1, engine="memory", prefix="odd", timeout_s=600)
    try:
        members = dict(sync.engine_versions())
        with pytest.raises(PlanMismatchError, match=needle):
            sync.add_engine(odd)
        assert ray.get(odd.weight_version.remote(), timeout=30) is None
        assert sync.engine_versions() == members
        v = pool.next_version()
        sync.push(v)
        assert set(sync.engine_versions().values()) == {v}
    finally:
        ray.kill(odd)


def test_versions_survive_a_new_weightsync(pool, synced):
    """Versions outlive a WeightSync: over engines an earlier one synced, a new one asks the engines
    (before any push), refuses a version at or below what they serve in one line naming the engine, its
    version and ``reset_versions``, and goes on above it; ``reset_versions=True`` accepts a lower one."""
    _, trainers, engines = synced
    first = WeightSync(trainers=trainers, engines=engines[:1], config=CONFIG)
    v0, v1 = pool.next_version(), pool.next_version()
    for v in (v0, v1):
        first.push(v)
    first.close()
    (name,) = ray.get([engines[0].engine_name.remote()], timeout=30)
    again = WeightSync(trainers=trainers, engines=engines[:1], config=CONFIG)
    try:
        assert again.engine_versions() == {name: v1} and again.latest_version is None
        before = served(engines[:1])
        for stale in (v0, v1):
            with pytest.raises(ValueError, match=rf"push_async\({stale}\): engine {name} already serves version {v1} "
                                                 rf".*push version {v1 + 1} or later.*reset_versions=True") as err:
                again.push(stale)
            assert "\n" not in str(err.value)
        assert_unchanged(engines[:1], before, "after a refused version below the served one")
        v2 = pool.next_version()
        assert again.push(v2).engines[0].committed and again.engine_versions() == {name: v2}
    finally:
        again.close()
    reset = WeightSync(trainers=trainers, engines=engines[:1], config=SyncConfig(
        transport="shm", bucket_bytes=1 << 10, timeout_s=TIMEOUT_S, reset_versions=True))
    try:
        assert reset.push(v0).engines[0].committed and reset.engine_versions() == {name: v0}
        with pytest.raises(ValueError, match="versions must increase"):
            reset.push(v0)
    finally:
        reset.close()
    assert pool.next_version() > v2  # the module's later pushes stay above every version served
