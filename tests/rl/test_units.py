"""Pure parts of live refresh: the GRPO task and advantages, the version board, config checks."""

from __future__ import annotations

import threading
import time

import pytest

from sync_service.api import SyncConfig
from sync_service.coordinator.versions import VersionBoard
from sync_service.entrypoints.rl import RLConfig, TargetTokenTask, group_advantages
from sync_service.synthetic.tokenizer import vocabulary


def test_task_rewards_first_token_in_targets():
    task = TargetTokenTask.from_vocab(128)
    vocab = vocabulary(128)
    assert {len(p) for p in task.prompts} == {3} and vocab["red"] in task.targets and vocab["cat"] not in task.targets
    assert task.rewards([[[vocab["red"], 0], [vocab["cat"]], []]]) == [[1.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="vocab_size=40"):
        TargetTokenTask.from_vocab(40)


def test_group_advantages_normalise_per_group():
    adv = group_advantages([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    std = 0.5  # Bessel: sqrt((0.75² + 3·0.25²) / 3)
    assert adv[0][0] == pytest.approx(0.75 / (std + 1e-4)) and adv[0][1] == pytest.approx(-0.25 / (std + 1e-4))
    assert sum(adv[0]) == pytest.approx(0.0, abs=1e-9) and adv[1] == [0.0] * 4


def test_version_board_waits_for_the_lowest_member():
    board = VersionBoard()
    board.admit("a", None)
    board.admit("b", 3)
    assert board.min_committed() is None
    threading.Timer(0.2, board.record, (["a", "b"], 5)).start()
    t0 = time.monotonic()
    assert board.wait_min(4, 5.0, hopeless=lambda: None) == 5
    assert 0.1 < time.monotonic() - t0 < 5.0  # woken by record(), before the 5 s timeout
    with pytest.raises(TimeoutError, match="version 9"):
        board.wait_min(9, 0.3, hopeless=lambda: None)
    with pytest.raises(RuntimeError, match="no push in flight"):
        board.wait_min(9, 5.0, hopeless=lambda: "no push in flight")
    board.remove("a")
    assert board.snapshot() == {"b": 5}


@pytest.mark.parametrize("kwargs,match", [({"max_in_flight": 0}, "max_in_flight=0"), ({"max_staleness": -1}, "max_staleness=-1")])
def test_sync_config_rejects_bad_live_refresh_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyncConfig(**kwargs)


def test_rl_config_needs_two_windows():
    with pytest.raises(ValueError, match="steps=6"):
        RLConfig(steps=6, window=4)
