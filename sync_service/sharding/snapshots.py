"""The snapshots of a trainer rank's state by version (``LiveState`` keeps its own here).

``put(version, snap)`` at ``snapshot(version)``; ``take(version)`` when the send builds its source
(the snapshot is consumed, but the last one taken stays available: a send retried to the surviving
engines after a peer failure streams the same values); ``drop(version)`` when a push is abandoned.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

__all__ = ["Snapshots"]


class _Versioned(Protocol):
    version: int


S = TypeVar("S", bound=_Versioned)


class Snapshots(Generic[S]):
    """Snapshots by version, of one rank (``owner`` names it in errors, e.g. ``"trainer rank 1"``)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._by_version: dict[int, S] = {}
        self._taken: S | None = None

    def put(self, version: int, snap: S) -> None:
        self._by_version[version] = snap

    def take(self, version: int) -> S:
        """The snapshot of ``version`` (or the last one taken, when it was ``version``'s).

        Raises:
            KeyError: no snapshot of ``version``.
        """
        snap = self._by_version.pop(version, None)
        if snap is None and self._taken is not None and self._taken.version == version:
            snap = self._taken
        if snap is None:
            raise KeyError(f"no snapshot of version {version} on {self.owner}; call snapshot({version}) first")
        self._taken = snap
        return snap

    def drop(self, version: int) -> None:
        self._by_version.pop(version, None)
