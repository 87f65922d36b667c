"""``engine_rollout_func`` refuses bad arguments at once, naming each (an unbounded ``timeout_s`` would wait forever)."""

from __future__ import annotations

import pytest


def test_engine_rollout_func_names_every_bad_argument_at_once():
    from sync_service.integrations.trl import engine_rollout_func

    with pytest.raises(ValueError, match=r"engines=\[None\]: a non-empty list of RolloutEngine actors; "
                                         r"max_new_tokens=1.5: an int in \[1, 2\*\*20\]; timeout_s=None: a finite"):
        engine_rollout_func([None], max_new_tokens=1.5, timeout_s=None)
    with pytest.raises(ValueError, match="engines=None"):
        engine_rollout_func(None, max_new_tokens=4)
