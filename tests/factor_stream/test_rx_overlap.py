"""The receiver merges each factor-mode target while the stream goes on, and only the targets a sync changes.

A real ``MemoryEngine`` under the ``FactorEngine``, recorded by a thin pass-through that logs which
tensors it stages and holds the stream's last tensor until a target has been merged; the values are checked bitwise against a
merged-mode sync of the same versions (``LocalSync``, real shm transport, real merge core).
"""

from __future__ import annotations

import threading
import time

from sync_service.factor_stream.choose import FactorPolicy
from sync_service.factor_stream.plan import factor_targets
from sync_service.factor_stream.rx_merge import busy_span_s
from tests.factor_stream.conftest import differing
from tests.factor_stream.test_delta import A_KEY, B_KEY, E, R, pair

GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


class Recorder:
    """Pass-through ``EngineAdapter`` over a real engine that logs the names it stages. ``hold``: a plain
    tensor whose apply waits (bounded) until some factor-mode target in ``targets`` has been staged, so
    a merge that waits for the end of the stream cannot pass."""

    def __init__(self, inner, targets: frozenset[str], hold: str, timeout_s: float = 60.0) -> None:
        self.inner, self.targets, self.hold, self.timeout_s = inner, targets, hold, timeout_s
        self.staged: list[str] = []
        self._merged = threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def begin_update(self, version, names):
        self.staged.clear()
        self._merged.clear()
        self.inner.begin_update(version, names)

    def apply(self, name, box, data):
        if name == self.hold and not self._merged.wait(self.timeout_s):
            raise AssertionError(f"no factor target was merged before the stream's last tensor {name}")
        self.staged.append(name)
        if name in self.targets:
            self._merged.set()
        self.inner.apply(name, box, data)


def test_targets_merge_during_the_stream_and_a_delta_merges_only_changed_targets(model_factory):
    model = model_factory("qwen3_moe", "float32")
    runs = pair(model, FactorPolicy(mode="factors", experts_per_recipe=1), ep=1)  # one sender: a fixed order
    factors = runs["factors"]
    try:
        state = dict(model.state)
        for run in runs.values():
            run.push(0, state)  # builds the FactorEngine; its first (full) sync
        targets = factor_targets(factors.plan)
        last = [e.name for e in factors.plan.entries if e.recipe is None and e.name not in targets][-1]
        rec = factors.engine.inner = Recorder(factors.memory, targets, hold=last)
        assert len(targets) >= 4 and GATE_UP in targets
        for run in runs.values():
            run.push(1, state, full=True)
        # full sync: every target merged once, the first ones while the stream still went on
        assert factors.engine.merged_targets == len(targets)
        assert sorted(n for n in rec.staged if n in targets) == sorted(targets)
        assert factors.engine.merge_s > 0
        assert not differing(runs["merged"].engine_state(), factors.engine_state())

        state = dict(state)  # change only layer 0's gate_up factors (expert 1)
        state[A_KEY] = state[A_KEY].clone()
        state[A_KEY][1 * R:2 * R] += 0.5
        state[B_KEY] = state[B_KEY].clone()
        state[B_KEY][:, [k * E + 1 for k in range(R)]] -= 0.25
        rec.hold = None
        for run in runs.values():
            run.push(2, state)
        assert factors.engine.merged_targets == 1
        assert {n for n in rec.staged if n in targets} == {GATE_UP}
        assert not differing(runs["merged"].engine_state(), factors.engine_state())
        assert differing(factors.engine_state(), model.tensors)
    finally:
        for run in runs.values():
            run.close()


def test_busy_span_counts_overlapping_merges_once():
    t = time.perf_counter()
    assert busy_span_s([]) == 0.0
    assert abs(busy_span_s([(t, t + 2), (t + 1, t + 3), (t + 5, t + 6)]) - 4.0) < 1e-9
    assert abs(busy_span_s([(t + 1, t + 2), (t, t + 4)]) - 4.0) < 1e-9
