"""Bytes on the wire during one run, counted by the kernel at the hosts' interfaces.

``WireMeter`` reads the ``eth0`` counters of namespace hosts (``sync_service.netns.wire_bytes``:
Ethernet frames with their headers, retransmits and control traffic alike) of the trainers' host
(its tx: bytes leaving it through the shaped uplink) and of every engine host (its rx), before and
after a run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sync_service.netns import Host, wire_bytes

__all__ = ["RunWire", "WireMeter"]


@dataclass(frozen=True, slots=True)
class RunWire:
    """Bytes counted during one run: ``uplink_tx`` left the trainers' host; ``engine_rx[i]`` reached
    engine host ``i`` (from the trainers or from other engine hosts)."""

    uplink_tx: int
    engine_rx: tuple[int, ...]

    def row_fields(self) -> dict:
        """``bench.rows.Row`` fields: ``wire_bytes`` (``uplink_tx``), ``wire_rx_bytes`` (``engine_rx``)."""
        return {"wire_bytes": self.uplink_tx, "wire_rx_bytes": list(self.engine_rx)}


class WireMeter:
    """Counters of the trainers' host ``uplink`` and the ``engines`` hosts; ``start()`` then ``stop()``
    around a run. Each read runs ``ip`` (a few ms; bounded by ``timeout_s``)."""

    def __init__(self, uplink: Host, engines: Sequence[Host] = (), *, timeout_s: float = 30.0) -> None:
        self.uplink, self.engines, self.timeout_s = uplink, tuple(engines), timeout_s
        self._start: tuple[int, tuple[int, ...]] | None = None

    def _read(self) -> tuple[int, tuple[int, ...]]:
        return (wire_bytes(self.uplink, timeout_s=self.timeout_s).tx,
                tuple(wire_bytes(e, timeout_s=self.timeout_s).rx for e in self.engines))

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> RunWire:
        """Bytes since ``start()``. Raises RuntimeError without a ``start()``."""
        if self._start is None:
            raise RuntimeError("WireMeter.stop() without start()")
        tx, rx = self._read()
        (tx0, rx0), self._start = self._start, None
        return RunWire(uplink_tx=tx - tx0, engine_rx=tuple(b - a for a, b in zip(rx0, rx)))
