"""``VersionBoard``: the committed weight version of every member engine, as the coordinator saw it
commit (driver side, thread safe), and waiting for a minimum version.

The coordinator records a version when an engine acked and committed it (a push, or a late joiner's
peer copy), so reading the board costs no round trip to the engines; ``WeightSync.engine_versions()``
asks the engines themselves.

Versions outlive a ``WeightSync``: an engine keeps serving its last committed version after the
coordinator that pushed it closed (a vLLM server across weightsync runs). ``check_push_version``
refuses a version at or below what an engine served when this coordinator admitted it (unless
``SyncConfig.reset_versions``), and ``next_version`` is the first version a new run pushes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping

from protocols.wire import I63_MAX

__all__ = ["MAX_VERSION", "VersionBoard", "check_push_version", "check_version", "next_version"]

MAX_VERSION = I63_MAX
"""Largest weight version, 2**63 - 1: versions travel as int64 (msgpack ints, the engines' int64 counters)."""


def check_version(version: object, where: str) -> int:
    """``version`` as a weight version: an int (not a bool) in ``[0, MAX_VERSION]``.

    Raises:
        TypeError: not an int. ValueError: outside int64's non-negative range (naming ``where``).
    """
    if not isinstance(version, int) or isinstance(version, bool):
        raise TypeError(f"{where}({version!r}): version must be an int, got {type(version).__name__}")
    if not 0 <= version <= MAX_VERSION:
        raise ValueError(f"{where}({version}): version must be in [0, 2**63 - 1] (an int64 on the wire); "
                         f"give a smaller version")
    return version

RESET_HINT = "SyncConfig(reset_versions=True) (weightsync sync|demo|run: --reset-versions)"
"""The setting that lets a new run number its versions from below what the engines serve."""


def _highest(served: Mapping[str, int | None]) -> tuple[int, str] | None:
    """(the highest version an engine serves, that engine's name); ``None`` when none serves one."""
    return max(((v, n) for n, v in served.items() if v is not None), default=None)


def next_version(served: Mapping[str, int | None]) -> int:
    """The first version a run pushes to engines serving ``served`` (engine name → version, ``None``:
    nothing committed): one above the highest, 0 when none serves a version."""
    top = _highest(served)
    return 0 if top is None else top[0] + 1


def check_push_version(version: int, previous: int | None, served: Mapping[str, int | None], *,
                       reset: bool) -> None:
    """Refuse a push of ``version`` that would not move every engine forward.

    ``previous``: this coordinator's last push (``None``: none yet); ``served``: engine name → the
    version it served when this coordinator admitted it (``None``: nothing committed); ``reset``:
    ``SyncConfig.reset_versions`` (accept versions at or below ``served``).

    Raises:
        ValueError: ``version <= previous``; or, without ``reset``, ``version`` at or below a served
            version (naming the engine, its version and the setting that resets it).
    """
    if previous is not None and version <= previous:
        raise ValueError(f"push_async({version}): versions must increase; the last push was {previous}")
    top = None if reset else _highest(served)
    if top is not None and version <= top[0]:
        raise ValueError(f"push_async({version}): engine {top[1]} already serves version {top[0]} (from an earlier "
                         f"WeightSync); push version {top[0] + 1} or later, or pass {RESET_HINT} to number "
                         f"versions from below it again")


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
