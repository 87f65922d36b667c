"""``TilePlans``: the merge's per-box tile plans, kept across syncs up to a bounded number of tiles."""

from __future__ import annotations

from collections.abc import Callable, Hashable

__all__ = ["TilePlans"]


class TilePlans:
    """Tile plans (``MergedSource``: tiles of a box, their indices, the term views per tile) by key.

    A trainer merges the same boxes every sync, so their plans are built once; only the values behind
    the term views change (``LoraAdapter.refresh`` writes in place). At most ``max_tiles`` tiles are
    kept (each ~0.5 KB of Python objects); boxes beyond that are planned per call, as before.
    """

    def __init__(self, max_tiles: int = 16384) -> None:
        self.max_tiles = max_tiles
        self._plans: dict[Hashable, list] = {}
        self._tiles = 0

    def get(self, key: Hashable, build: Callable[[], list]) -> list:
        """The plan of ``key``: kept, or built by ``build()`` (and kept while under ``max_tiles``)."""
        plan = self._plans.get(key)
        if plan is None:
            plan = build()
            if self._tiles + len(plan) <= self.max_tiles:
                self._plans[key] = plan
                self._tiles += len(plan)
        return plan
