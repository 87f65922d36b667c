"""``Membership``: the engines a coordinator syncs to, their names, parameter tables and versions.

Engines join (``admit``), leave on request (``remove``, which works on a dead actor too) or are
dropped when their actor died (``drop``); a departed engine is remembered, so removing it later is
not an error. Every change means the channel must open again for the new member set (``changed``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocols.params import ParamMeta
from sync_service.coordinator.versions import VersionBoard

__all__ = ["Departure", "Membership"]


@dataclass(frozen=True, slots=True)
class Departure:
    """An engine that left: its ``name`` and ``reason`` (``"removed"`` or why its actor died)."""

    name: str
    reason: str


@dataclass(slots=True)
class Membership:
    """Member engines in receiver order (``handles[i]`` is receiver ``i`` of the channel)."""

    handles: list = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    tables: dict[str, list[ParamMeta]] = field(default_factory=dict)
    full_done: set[str] = field(default_factory=set)
    """Names that received a full sync (or a peer copy): a delta suffices for them."""
    versions: VersionBoard = field(default_factory=VersionBoard)
    departed: list[Departure] = field(default_factory=list)
    changed: bool = True
    """The member set changed since the channel was last opened."""
    _gone: list = field(default_factory=list)  # handles of departed engines

    def unique_name(self, name: str) -> str:
        return name if name not in self.names else f"{name}#{len(self.names)}"

    def admit(self, handle, name: str, table: list[ParamMeta], version: int | None, *, full: bool = False) -> None:
        self.handles.append(handle)
        self.names.append(name)
        self.tables[name] = table
        if full:
            self.full_done.add(name)
        self.versions.admit(name, version)
        self.changed = True

    def index(self, handle) -> int | None:
        """``handle``'s receiver index; ``None`` if not a member."""
        for i, h in enumerate(self.handles):
            if h == handle:
                return i
        return None

    def departed_handle(self, handle) -> bool:
        return any(h == handle for h in self._gone)

    def drop(self, indices: list[int], reason: str | list[str]) -> list[str]:
        """Forget members ``indices`` (their actors died, or were removed); returns their names."""
        reasons = reason if isinstance(reason, list) else [reason] * len(indices)
        gone = []
        for i, why in sorted(zip(indices, reasons), reverse=True):
            self._gone.append(self.handles.pop(i))
            name = self.names.pop(i)
            self.full_done.discard(name)
            self.tables.pop(name, None)
            self.versions.remove(name)
            self.departed.append(Departure(name=name, reason=why))
            gone.append(name)
        if indices:
            self.changed = True
        return gone

    def needs_full(self) -> bool:
        """Some member has not received a full sync yet."""
        return any(n not in self.full_done for n in self.names)

    def committed(self, version: int, names: list[str]) -> None:
        """``names`` committed ``version`` (each received a full sync or a delta over one)."""
        self.full_done.update(names)
        self.versions.record(names, version)
