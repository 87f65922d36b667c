"""``VersionBoard``: the committed weight version of every member engine, as the coordinator saw it
commit (driver side, thread safe), and waiting for a minimum version.

The coordinator records a version when an engine acked and committed it (a push, or a late joiner's
peer copy), so reading the board costs no round trip to the engines; ``WeightSync.engine_versions()``
asks the engines themselves.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

__all__ = ["VersionBoard"]


class VersionBoard:
    """Per-engine committed versions (``None``: nothing committed through this coordinator yet)."""

    def __init__(self) -> None:
        self._versions: dict[str, int | None] = {}
        self._cond = threading.Condition()

    def admit(self, name: str, version: int | None) -> None:
        with self._cond:
            self._versions[name] = version
            self._cond.notify_all()

    def remove(self, name: str) -> None:
        with self._cond:
            self._versions.pop(name, None)
            self._cond.notify_all()

    def record(self, names: Iterable[str], version: int) -> None:
        """``names`` committed ``version``."""
        with self._cond:
            for name in names:
                self._versions[name] = version
            self._cond.notify_all()

    def snapshot(self) -> dict[str, int | None]:
        with self._cond:
            return dict(self._versions)

    def min_committed(self) -> int | None:
        """The lowest committed version over the members; ``None`` if one has none (or no members)."""
        with self._cond:
            return _min(self._versions.values())

    def wait_min(self, min_version: int, timeout_s: float, *, hopeless: Callable[[], str | None]) -> int:
        """Block until every member committed ``>= min_version``; returns the lowest committed version.

        ``hopeless()`` is polled (under the board's lock, every 0.2 s and on every change): a non-empty
        text means the version cannot arrive any more (no push of it in flight) and is raised.

        Raises:
            TimeoutError: not reached within ``timeout_s`` s. RuntimeError: ``hopeless()``'s text.
        """
        end = time.monotonic() + timeout_s
        with self._cond:
            while True:
                low = _min(self._versions.values())
                if low is not None and low >= min_version:
                    return low
                reason = hopeless()
                if reason:
                    raise RuntimeError(f"version >= {min_version} cannot arrive: {reason} (engines at {self._versions})")
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"engines did not reach version {min_version} within {timeout_s} s "
                                       f"(committed: {self._versions})")
                self._cond.wait(min(left, 0.2))


def _min(values: Iterable[int | None]) -> int | None:
    values = list(values)
    if not values or any(v is None for v in values):
        return None
    return min(values)
