"""``TrainerEndpoint``: the part of a training process the coordinator drives, over a live model.

The coordinator calls, on every rank: ``owned_metas`` (once, to plan), ``open_transport`` (per
membership), then per push ``snapshot(v)`` and ``send(...)`` — or ``drop_snapshot(v)``. Calls arrive
on a thread of the process other than the training loop's (a Ray actor method thread), so
``send`` streams a snapshot while the next training step runs; one send runs at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from protocols.params import ParamMeta
from protocols.wire import SyncPlan
from protocols.wire_check import decode
from sync_service.live.state import LiveState

__all__ = ["TrainerEndpoint", "meta_to_list"]


def meta_to_list(m: ParamMeta) -> list:
    """``[name, dtype, shape, box]`` with lists (what crosses a Ray call)."""
    return [m.name, m.dtype, list(m.shape), None if m.box is None else [list(b) for b in m.box]]


class _TimedSource:
    """WeightSource wrapper summing the seconds spent in ``fill`` (merge + copy into the bucket)."""

    def __init__(self, source) -> None:
        self._source, self.fill_s = source, 0.0

    def param_metas(self):
        return self._source.param_metas()

    def changed_names(self):
        return self._source.changed_names()

    def fill(self, name, box, out) -> None:
        t0 = time.perf_counter()
        self._source.fill(name, box, out)
        self.fill_s += time.perf_counter() - t0


class TrainerEndpoint:
    """One training rank's endpoint (made by ``attach_trainer``).

    Args:
        state: the rank's ``LiveState``.
        rank: this rank's sender index in the plan (its rank in weightsync's group).
        before_send: called with the version at the start of every ``send``, before the factor
            gather and the first byte (an injection point: tests hold a send here).
    """

    def __init__(self, state: LiveState, *, rank: int, before_send: Callable[[int], None] | None = None) -> None:
        self.state, self.rank, self.before_send = state, rank, before_send
        self._sender = None
        self._plan: SyncPlan | None = None
        self._send_lock = threading.Lock()

    def owned_metas(self) -> list[list]:
        """The global boxes this rank produces, as ``[name, dtype, shape, box]`` lists."""
        return [meta_to_list(m) for m in self.state.owned()]

    def open_transport(self, spec_bytes: bytes, plan_bytes: bytes, bucket_buffers: int = 2, *,
                       secret: bytes | None = None) -> None:
        """Open the sender side of a channel and keep the plan. Blocks until the peers connect.

        Raises:
            ValueError: ``plan_bytes`` is not a ``SyncPlan``.
        """
        from sync_service.streaming.pool import BucketPool
        from sync_service.streaming.sender import Sender
        from sync_service.transports import TransportSpec, open_sender

        self.close_transport()
        plan = decode(plan_bytes)
        if not isinstance(plan, SyncPlan):
            raise ValueError(f"open_transport: plan_bytes decode to {type(plan).__name__}, not a SyncPlan")
        spec = TransportSpec.from_bytes(spec_bytes)
        self._plan = plan
        self._sender = Sender(open_sender(spec, sender=self.rank),
                              BucketPool(bucket_bytes=plan.bucket_bytes, num_buffers=bucket_buffers),
                              sender=self.rank, secret=secret)

    def close_transport(self) -> None:
        if self._sender is not None:
            self._sender.transport.close()
            self._sender = None

    def snapshot(self, version: int) -> list[str] | None:
        """Copy this rank's factors as ``version``; the names a delta needs (``None``: all)."""
        changed = self.state.snapshot(version)
        return None if changed is None else sorted(changed)

    def drop_snapshot(self, version: int) -> None:
        self.state.drop_snapshot(version)

    def send(self, session: str, version: int, names: list[str] | None, timeout_s: float, *,
             check_finite: bool = False) -> dict:
        """Gather the factors this rank lacks, merge its owned boxes of ``version``'s snapshot and stream
        them; blocks until every engine acked (at most ``timeout_s`` per step).

        Returns seconds per stage (``gather_s``, ``merge_s``, ``pack_s``, ``transfer_s``,
        ``ack_wait_s``, ``total_s``) and sizes (``payload_bytes``, ``buckets``, ``entries``).

        Raises:
            TimeoutError: the previous send did not end within ``timeout_s``. RuntimeError: no
                transport. MergeError: NaN/Inf factors or merged values (named).
        """
        if not self._send_lock.acquire(timeout=timeout_s):
            self.state.drop_snapshot(version)
            raise TimeoutError(f"training rank {self.rank}: send({version}) waited {timeout_s:.0f} s for the previous "
                               f"send to end; raise SyncConfig.timeout_s or check that rank")
        try:
            return self._send(session, version, names, timeout_s, check_finite)
        finally:
            self._send_lock.release()

    def _send(self, session: str, version: int, names, timeout_s: float, check_finite: bool) -> dict:
        if self._sender is None or self._plan is None:
            self.state.drop_snapshot(version)
            raise RuntimeError("send before open_transport")
        if self.before_send is not None:
            self.before_send(version)
        t0 = time.perf_counter()
        try:
            self.state.merge.check_finite = check_finite
            source = _TimedSource(self.state.source(version))
        except BaseException:
            self.state.drop_snapshot(version)
            raise
        gather_s = time.perf_counter() - t0
        stats = self._sender.send_sync(session, version, source, self._plan,
                                       names=None if names is None else frozenset(names), timeout_s=timeout_s)
        return {"rank": self.rank, "gather_s": gather_s, "merge_s": source.fill_s,
                "pack_s": max(stats.pack_s - source.fill_s, 0.0), "transfer_s": stats.transfer_s,
                "ack_wait_s": stats.ack_wait_s, "total_s": time.perf_counter() - t0,
                "payload_bytes": stats.payload_bytes, "buckets": stats.buckets, "entries": stats.entries}
