"""The toy GRPO loop learns only because the weights arrive: with sync the reward rises, in the
control run (sync disabled after version 0; same trainers, same sampling seeds) it does not."""

from __future__ import annotations

import json

import pytest

from sync_service.entrypoints.rl import RLConfig
from actors.launch import RayLauncher
from sync_service.entrypoints.rl.loop import run_rl, window_means
from sync_service.entrypoints.rl.plot import save_reward_plot
from sync_service.synthetic import make_adapter, make_base
from sync_service.synthetic.demo_files import DEMO_ADAPTER, DEMO_MODEL


@pytest.fixture(scope="module")
def demo_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    model = dict(DEMO_MODEL)
    family = model.pop("family")
    base = make_base(family, root / "base", **model)
    return base, make_adapter(family, base, root / "lora", **DEMO_ADAPTER)


def test_reward_rises_with_sync_and_stays_flat_without(ray_local, demo_files, tmp_path):
    config = RLConfig(steps=16, window=4, seed=0, max_staleness=1, max_in_flight=1)
    result = run_rl(*demo_files, config, vocab_size=DEMO_MODEL["vocab_size"], launcher=RayLauncher())
    s0, s1 = window_means(result.synced.rewards, config.window)
    c0, c1 = window_means(result.control.rewards, config.window)
    assert s1 - s0 >= 0.15 and s1 >= c1 + 0.15, (result.synced.rewards, result.control.rewards)
    assert c1 - c0 < 0.1, result.control.rewards
    # every rollout is tagged; synced ones are within the staleness bound and follow the pushes,
    # the control's all come from version 0 while its trainers moved on
    assert all(lag <= config.max_staleness for lag in result.synced.lag)
    assert result.synced.versions[-1] and min(result.synced.versions[-1]) >= config.steps - 1 - config.max_staleness
    assert {v for vs in result.control.versions for v in vs} == {0}
    assert [p["version"] for p in result.synced.pushes] == list(range(1, config.steps + 1))
    assert not any(p["full"] for p in result.synced.pushes)  # version 0 was the only full sync
    assert result.synced.ranks_agree and result.control.ranks_agree
    doc = result.to_json()
    assert {"reward_curve", "control_reward_curve", "versions_seen"} <= set(json.loads(json.dumps(doc)))
    png = save_reward_plot(result, tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
