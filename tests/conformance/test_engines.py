"""Engine conformance: every ``EngineAdapter`` keeps the same contract (``protocols.interfaces``).

Parametrized over every adapter of ``engine_cases.CASES`` (in-memory, transformers, vLLM in process, a
vLLM server through its handle), one engine per adapter for the module; each test leaves its engine
serving the checkpoint's values (``versions["a"]``), so the order of the tests does not matter.
"""

from __future__ import annotations

import threading
import time
import typing

import pytest

from protocols.interfaces import EngineAdapter, FinishReport
from tests.conformance.engine_cases import CASES, MARKS, halves, make_checkpoint

pytestmark = pytest.mark.timeout(1200)

GENERATIONS_DURING_COMMITS = 3
"""Generations that must run while commits happen in the atomicity test (bounded by DEADLINE_S)."""
DEADLINE_S = 300.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("engine_conformance"))


@pytest.fixture(scope="module", params=[pytest.param(k, marks=[getattr(pytest.mark, m) for m in MARKS.get(k, ())])
                                        for k in CASES])
def case(request, checkpoint):
    with pytest.MonkeyPatch.context() as monkeypatch, CASES[request.param](checkpoint, monkeypatch) as built:
        assert isinstance(built.engine, EngineAdapter)
        yield built


def test_incomplete_plan_is_refused_at_finish(case):
    engine, a = case.engine, case.versions["a"]
    before, version_before = case.served(), engine.weight_version()
    first, second = sorted(n for n, t in a.items() if t.dim() >= 1 and t.shape[0] >= 2)[:2]
    version = case.next_version()
    engine.begin_update(version, [first, second])
    engine.apply(first, *_box_and_data(case.versions["b"][first], None))
    half = halves(tuple(a[second].shape))[0]  # only the first half of the second tensor
    engine.apply(second, *_box_and_data(case.versions["b"][second], half))
    with pytest.raises(ValueError, match="incomplete"):
        engine.finish_update()
    with pytest.raises(RuntimeError):
        engine.commit(version)  # nothing of an unfinished sync is ever served
    engine.abort()
    assert engine.weight_version() == version_before
    assert case.served() == before


def test_abort_restores_the_served_version_bitwise(case):
    engine = case.engine
    before, version_before = case.served(), engine.weight_version()
    case.push("b", commit=False)  # applied and finished (post-load processing ran), not committed
    engine.abort()
    assert engine.weight_version() == version_before
    assert case.served() == before
    engine.abort()  # idempotent
    assert case.served() == before


def test_a_refused_commit_leaves_the_engine_ready_for_the_next_sync(case):
    """A replayed sync's commit of a version that is not the one staged is refused, drops the staged
    update, and the engine keeps serving its last committed version; the next sync begins and commits."""
    engine = case.engine
    before, version_before = case.served(), engine.weight_version()
    staged = case.push("b", commit=False)
    with pytest.raises(RuntimeError, match=f"commit\\({staged + 1000}\\)"):
        engine.commit(staged + 1000)
    assert engine.weight_version() == version_before and case.served() == before
    with pytest.raises(RuntimeError):
        engine.commit(staged)  # dropped: the refused commit left nothing to commit
    assert engine.weight_version() == version_before and case.served() == before
    version = case.push("b")  # begins cleanly (was: "begin_update(...) while version ... is in progress")
    assert engine.weight_version() == version and case.served() != before
    case.push("a")
    assert case.served() == before


FOREIGN = "0123456789abcdef"
"""An update token no engine handed out (another sync's, or a forged one)."""


def _finished(case, version: int, which: str, **begin) -> str | None:
    """A full sync of ``versions[which]`` as ``version``, finished, not committed; the engine's update token
    (``begin_update``'s answer, or for an engine that begins at the stream the one it reported then)."""
    engine, values = case.engine, case.versions[which]
    token = engine.begin_update(version, list(values), **begin)
    for name, value in values.items():
        for box in halves(value.shape):
            engine.apply(name, box, value[tuple(slice(a, b) for a, b in box)])
    engine.finish_update()
    return token or getattr(engine, "update_id", None)


def test_versions_are_fenced_at_the_engine(case):
    """Every engine kind is the authority on its versions: a version at or below the served one is refused
    (unless ``reset_versions``, explicit at the engine), whatever the caller checked; a commit or abort with a
    token that is not the staged update's leaves that update alone; a second update is refused while one is
    staged (where the engine begins at ``begin_update``)."""
    engine = case.engine
    served = case.push("a")
    before = case.served()
    for stale in (served, served - 1):
        with pytest.raises(RuntimeError, match=f"\\({stale}\\) refused: this engine serves version {served}"):
            _finished(case, stale, "b")
        engine.abort()
        assert engine.weight_version() == served and case.served() == before
    version = case.next_version()
    token = _finished(case, version, "b")
    assert token
    engine.abort(FOREIGN)  # another sync's abort: nothing happens
    with pytest.raises(RuntimeError, match="is not the one staged"):
        engine.commit(version, FOREIGN)
    assert engine.weight_version() == served  # (vLLM holds generation from finish to commit: not asked here)
    if engine.commit_gate is not None:  # the server adapter stages locally; the server begins at the stream
        with pytest.raises(RuntimeError, match=f"begin_update\\({version + 1}\\) refused: version {version} is in "
                                               f"progress"):
            engine.begin_update(version + 1, list(case.versions["a"]))
    engine.commit(version, token)  # the staged update survived all of it
    assert engine.weight_version() == version and case.served() != before
    reset = _finished(case, served, "a", reset_versions=True)  # back below, explicitly
    engine.commit(served, reset)
    assert engine.weight_version() == served and case.served() == before
    case.next_version()  # the version numbers of later tests stay above the served one


def test_a_pre_commit_check_refusal_keeps_the_served_version(case):
    """A check plugged into the engine's gate (``CommitGate.set_check``) votes at the end of ``finish_update``:
    its refusal aborts the update there (named), the engine serves its previous version bitwise, and the next
    sync commits once the check passes. (The server's gate lives in its worker: checked there by the served
    check's own tests.)"""
    from sync_service.engines.commit_gate import CommitRefused

    engine = case.engine
    if engine.commit_gate is None:
        pytest.skip("the gate lives in the server's worker process")
    before, served = case.served(), engine.weight_version()
    seen = []

    def check(update):
        seen.append((update.version, update.served, len(update.names), sum(update.applied.values())))
        raise CommitRefused("model.norm.weight: injected refusal")

    engine.commit_gate.set_check("probe", check)
    try:
        version = case.next_version()
        with pytest.raises(CommitRefused, match=f"version {version} refused by the probe check: model.norm.weight"):
            _finished(case, version, "b")
    finally:
        engine.commit_gate.set_check("probe", None)
    numel = sum(t.numel() for t in case.versions["b"].values())
    assert seen and seen[0][:2] == (version, served) and seen[0][3] == numel  # every element applied once
    assert engine.weight_version() == served and case.served() == before
    with pytest.raises(RuntimeError):
        engine.commit(version)  # the refused update is gone
    assert case.served() == before
    case.push("a")


def test_commit_is_atomic_under_concurrent_generation(case):
    expected = {}
    va = case.push("a")
    expected["a"] = case.generate()
    vb = case.push("b")
    expected["b"] = case.generate()
    assert expected["a"][1] == va and expected["b"][1] == vb
    assert expected["a"][0] != expected["b"][0], "versions a and b serve the same output: the test could not fail"
    which = {va: "a", vb: "b"}
    seen: list[tuple[object, int | None]] = []
    stop = threading.Event()

    def generate_until_stopped():
        while not stop.is_set():
            seen.append(case.generate())

    thread = threading.Thread(target=generate_until_stopped, daemon=True)
    thread.start()
    deadline = time.monotonic() + DEADLINE_S
    commits = 0
    try:
        while (len(seen) < GENERATIONS_DURING_COMMITS or commits < 2) and time.monotonic() < deadline:
            name = "a" if commits % 2 else "b"
            which[case.push(name)] = name
            commits += 1
    finally:
        stop.set()
        thread.join(DEADLINE_S)
    case.push("a")
    assert len(seen) >= GENERATIONS_DURING_COMMITS, f"only {len(seen)} generations ran alongside {commits} commits"
    for output, version in seen:
        assert version in which, f"a generation reported version {version}, never committed"
        assert output == expected[which[version]][0], f"generation under version {version} mixes two versions"


@pytest.mark.parametrize("bad", ["past_the_end", "negative", "empty", "wrong_ndim", "data_shape"])
def test_boxes_out_of_range_are_refused(case, bad):
    engine, a = case.engine, case.versions["a"]
    name = sorted(n for n, t in a.items() if t.dim() == 2)[0]
    rows, cols = a[name].shape
    before, version_before = case.served(), engine.weight_version()
    box, data = {
        "past_the_end": (((0, rows + 1), (0, cols)), a[name].new_zeros(rows + 1, cols)),
        "negative": (((-1, rows), (0, cols)), a[name].new_zeros(rows + 1, cols)),
        "empty": (((1, 1), (0, cols)), a[name].new_zeros(0, cols)),
        "wrong_ndim": (((0, rows),), a[name].new_zeros(rows)),
        "data_shape": (((0, rows), (0, cols)), a[name].new_zeros(rows, cols + 1)),
    }[bad]
    version = case.next_version()
    engine.begin_update(version, [name])
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        engine.apply(name, box, data)
    with pytest.raises(KeyError):
        engine.apply(*_named(sorted(set(a) - {name})[0], a[sorted(set(a) - {name})[0]]))  # not announced
    engine.abort()
    assert engine.weight_version() == version_before
    assert case.served() == before


def test_post_load_processing_runs_once_per_sync(case):
    engine, a = case.engine, case.versions["a"]
    version = case.next_version()
    engine.begin_update(version, list(a))
    for name, value in a.items():
        engine.apply(*_named(name, value))
    report = engine.finish_update()
    assert report.tensors == len(a) and report.seconds >= 0 and report.modules >= 0
    with pytest.raises(RuntimeError, match="finish_update"):
        engine.finish_update()  # a second post-load processing of the same sync is refused
    engine.commit(version)
    assert engine.weight_version() == version
    with pytest.raises(RuntimeError):
        engine.finish_update()  # and none without a sync


def test_finish_update_returns_the_declared_type(case):
    declared = typing.get_type_hints(EngineAdapter.finish_update)["return"]
    assert declared is FinishReport
    assert typing.get_type_hints(type(case.engine).finish_update)["return"] is declared
    engine, a = case.engine, case.versions["a"]
    name = sorted(a)[0]
    version = case.next_version()
    engine.begin_update(version, [name])
    engine.apply(*_named(name, a[name]))
    report = engine.finish_update()
    assert type(report) is FinishReport and report.tensors == 1
    assert isinstance(report.modules, int) and isinstance(report.seconds, float)
    engine.commit(version)


def _box_and_data(value, box):
    box = box if box is not None else tuple((0, n) for n in value.shape)
    return box, value[tuple(slice(a, b) for a, b in box)]


def _named(name, value):
    box, data = _box_and_data(value, None)
    return name, box, data
