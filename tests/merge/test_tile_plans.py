"""``TilePlans`` keeps plans up to its tile budget and rebuilds the rest per call."""

from __future__ import annotations

from sync_service.merge.tile_plans import TilePlans


def test_plans_kept_until_the_tile_budget_then_built_per_call():
    plans, built = TilePlans(max_tiles=3), []

    def build(n):
        def make():
            built.append(n)
            return list(range(n))
        return make

    assert plans.get("a", build(2)) == [0, 1]
    assert plans.get("a", build(2)) == [0, 1]       # kept
    assert plans.get("b", build(2)) == [0, 1]       # 2 + 2 > 3: not kept
    assert plans.get("b", build(2)) == [0, 1]
    assert plans.get("c", build(1)) == [0]          # 2 + 1 <= 3: kept
    assert plans.get("c", build(1)) == [0]
    assert built == [2, 2, 2, 1]
