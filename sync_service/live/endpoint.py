"""``TrainerEndpoint``: the part of a training process the coordinator drives, over a live model.

Implements ``protocols.endpoints.TrainerEndpoint``: the coordinator calls, on every rank,
``owned_metas`` (once, to plan), ``open_transport(OpenChannel)`` (per membership), then per push
``snapshot(v)`` and ``send(SendRequest)`` — or ``drop_snapshot(v)``. Calls arrive on a thread of the
process other than the training loop's (a Ray actor method thread), so ``send`` streams a snapshot
while the next training step runs; one send runs at a time. One channel per owner (coordinator).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from protocols.endpoints import OpenChannel, SendReport, SendRequest, SnapshotReport
from protocols.params import ParamMeta
from protocols.wire import SyncPlan
from protocols.wire_check import decode
from sync_service.live.state import LiveState

__all__ = ["TrainerEndpoint"]


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
    """One training rank's endpoint (made by ``attach_trainer``; ``protocols.endpoints.TrainerEndpoint``).

    Args:
        state: the rank's ``LiveState``.
        rank: this rank's sender index in the plan (its rank in weightsync's group).
        before_send: called with the version at the start of every ``send``, before the factor
            gather and the first byte (an injection point: tests hold a send here).
    """

    def __init__(self, state: LiveState, *, rank: int, before_send: Callable[[int], None] | None = None) -> None:
        self.state, self.rank, self.before_send = state, rank, before_send
        self._channels: dict[str, tuple] = {}  # owner -> (Sender, SyncPlan)
        self._send_lock = threading.Lock()

    def owned_metas(self) -> tuple[ParamMeta, ...]:
        """The global boxes this rank produces, in production order."""
        return tuple(self.state.owned())

    def open_transport(self, request: OpenChannel) -> None:
        """Open the sender side of ``request.owner``'s channel and keep its plan. Blocks until the peers connect.

        Raises:
            ValueError: ``request.plan`` is not a ``SyncPlan``.
        """
        from sync_service.streaming.pool import BucketPool
        from sync_service.streaming.sender import Sender
        from sync_service.transports import TransportSpec, open_sender

        self.close_transport(request.owner)
        plan = decode(request.plan)
        if not isinstance(plan, SyncPlan):
            raise ValueError(f"open_transport: plan decodes to {type(plan).__name__}, not a SyncPlan")
        spec = TransportSpec.from_bytes(request.spec)
        sender = Sender(open_sender(spec, sender=self.rank),
                        BucketPool(bucket_bytes=plan.bucket_bytes, num_buffers=request.bucket_buffers),
                        sender=self.rank, secret=request.secret)
        self._channels[request.owner] = (sender, plan)

    def close_transport(self, owner: str | None = None) -> None:
        """Close ``owner``'s channel (``None``: every channel)."""
        for key in list(self._channels) if owner is None else [owner]:
            entry = self._channels.pop(key, None)
            if entry is not None:
                entry[0].transport.close()

    def snapshot(self, version: int) -> SnapshotReport:
        """Copy this rank's factors as ``version``; ``changed``: the names a delta needs (``None``: all)."""
        changed = self.state.snapshot(version)
        return SnapshotReport(version=version, changed=None if changed is None else frozenset(changed))

    def drop_snapshot(self, version: int) -> None:
        self.state.drop_snapshot(version)

    def send(self, request: SendRequest) -> SendReport:
        """Gather the factors this rank lacks, merge its owned boxes of the snapshot and stream them
        over ``request.owner``'s channel; blocks until every engine acked (at most ``timeout_s`` per step).

        Raises:
            TimeoutError: the previous send did not end within ``timeout_s``. RuntimeError: no
                channel of that owner. MergeError: NaN/Inf factors or merged values (named).
        """
        if not self._send_lock.acquire(timeout=request.timeout_s):
            self.state.drop_snapshot(request.version)
            raise TimeoutError(f"training rank {self.rank}: send({request.version}) waited {request.timeout_s:.0f} s "
                               f"for the previous send to end; raise SyncConfig.timeout_s or check that rank")
        try:
            return self._send(request)
        finally:
            self._send_lock.release()

    def _send(self, request: SendRequest) -> SendReport:
        version = request.version
        if request.owner not in self._channels:
            self.state.drop_snapshot(version)
            raise RuntimeError(f"training rank {self.rank}: send before open_transport (channel {request.owner!r})")
        sender, plan = self._channels[request.owner]
        if self.before_send is not None:
            self.before_send(version)
        t0 = time.perf_counter()
        try:
            self.state.merge.check_finite = request.check_finite
            self.state.merge.accumulate_dtype = request.accumulate_dtype
            source = _TimedSource(self.state.source(version))
        except BaseException:
            self.state.drop_snapshot(version)
            raise
        gather_s = time.perf_counter() - t0
        stats = sender.send_sync(request.session, version, source, plan,
                                 names=None if request.names is None else frozenset(request.names),
                                 timeout_s=request.timeout_s)
        return SendReport(rank=self.rank, gather_s=gather_s, merge_s=source.fill_s,
                          pack_s=max(stats.pack_s - source.fill_s, 0.0), transfer_s=stats.transfer_s,
                          ack_wait_s=stats.ack_wait_s, total_s=time.perf_counter() - t0,
                          payload_bytes=stats.payload_bytes, buckets=stats.buckets, entries=stats.entries)
