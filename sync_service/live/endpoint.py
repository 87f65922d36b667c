"""``TrainerEndpoint``: the part of a trainer process the coordinator drives — one implementation.

Implements ``protocols.endpoints.TrainerEndpoint``: the coordinator calls, on every rank,
``owned_metas`` (once, to plan), ``open_transport(OpenChannel)`` (per membership), then per push
``snapshot(v)`` and ``send(SendRequest)`` — or ``drop_snapshot(v)``; with factor streaming
(``SyncConfig.mode`` "factors" / "auto") also the ``factor_*`` calls (``factor_stream/trainer.py``), and a
send whose plan carries recipe entries streams factor recipes. Both kinds of trainer use it:
a live training rank (``attach_trainer``: a ``LiveState`` over the user's PEFT model) and the
``TrainerShard`` actor (``actors/trainer.py``: a ``LiveState`` over its checkpoint shard). Calls
arrive on a thread other than the training loop's (a Ray actor method thread), so ``send`` streams
a snapshot while the next training step runs; one send runs at a time. One channel per owner
(coordinator): a second coordinator on the same process never closes the first one's channel.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from protocols.endpoints import OpenChannel, SendReport, SendRequest, SnapshotReport
from protocols.params import ParamMeta
from protocols.wire import SyncPlan
from protocols.wire_check import decode
from sync_service.fp8 import table_blocks

__all__ = ["SyncState", "TrainerEndpoint", "plan_dtypes"]


class SyncState(Protocol):
    """What an endpoint needs of a rank's state (``sync_service.live.state.LiveState``)."""

    merge: object
    """The ``MergeConfig`` its sources use (``check_finite``, ``accumulate_dtype``, ``out_dtypes`` are set per send)."""
    device: object
    """The ``torch.device`` its base tensors live on: where the merge runs (``transports.devices``)."""

    def owned(self) -> list[ParamMeta]: ...

    def snapshot(self, version: int) -> frozenset[str] | None: ...

    def drop_snapshot(self, version: int) -> None: ...

    def source(self, version: int): ...


def plan_dtypes(plan: SyncPlan) -> dict[str, str]:
    """Tensor name → the wire dtype ``plan`` sends it in (the engines' dtype, ``coordinator.planning.engine_dtypes``);
    recipe entries (factor streaming) are left out."""
    return {e.name: e.dtype for e in plan.entries if e.recipe is None}


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
    """One trainer rank's endpoint (``protocols.endpoints.TrainerEndpoint``).

    Args:
        state: the rank's ``SyncState`` (its owned boxes, snapshots and merged sources).
        rank: this rank's index in its trainer group (named in errors; its sender index is
            ``OpenChannel.index``).
        before_send: called with the version at the start of every ``send``, before the factor
            gather and the first byte (an injection point: tests hold a send here).
    """

    def __init__(self, state: SyncState, *, rank: int, before_send: Callable[[int], None] | None = None) -> None:
        self.state, self.rank, self.before_send = state, rank, before_send
        self._factors = None  # factor_stream.trainer.FactorTrainer, made by the first factor_* call
        self.channels: dict[str, tuple] = {}
        """owner → (``Sender``, ``SyncPlan``) of each open channel."""
        self.plan: SyncPlan | None = None
        """The plan of the channel opened last (``None`` before the first)."""
        self._send_lock = threading.Lock()

    def owned_metas(self) -> tuple[ParamMeta, ...]:
        """The global boxes this rank produces, in production order."""
        return tuple(self.state.owned())

    def open_transport(self, request: OpenChannel) -> None:
        """Open the sender side of ``request.owner``'s channel and keep its plan. Blocks until the
        peers connect. Buckets are sealed with ``request.secret`` (engines verify). The bucket buffers live where the
        transport wants its bytes (``transports.devices.bucket_device``); when that is not the state's device, the
        merge fills a staging bucket there and each bucket crosses in one copy (``stage_device``).

        Raises:
            ValueError: ``request.plan`` is not a ``SyncPlan``.
        """
        from sync_service.streaming.pool import BucketPool
        from sync_service.streaming.sender import Sender
        from sync_service.transports import TransportSpec, open_sender
        from sync_service.transports.devices import bucket_device, stage_device

        self.close_transport(request.owner)
        plan = decode(request.plan)
        if not isinstance(plan, SyncPlan):
            raise ValueError(f"open_transport: plan decodes to {type(plan).__name__}, not a SyncPlan")
        spec = TransportSpec.from_bytes(request.spec)
        bucket = bucket_device(spec)
        sender = Sender(open_sender(spec, sender=request.index),
                        BucketPool(bucket_bytes=plan.bucket_bytes, num_buffers=request.bucket_buffers, device=str(bucket)),
                        sender=request.index, secret=request.secret, stage_device=stage_device(self.state.device, bucket))
        self.channels[request.owner] = (sender, plan)
        self.plan = plan

    def close_transport(self, owner: str | None = None) -> None:
        """Close ``owner``'s channel (``None``: every channel); a send blocked on it fails."""
        for key in list(self.channels) if owner is None else [owner]:
            entry = self.channels.pop(key, None)
            if entry is not None:
                entry[0].transport.close()

    def snapshot(self, version: int) -> SnapshotReport:
        """Copy this rank's factors as ``version``; ``changed``: the names a delta needs (``None``: all)."""
        changed = self.state.snapshot(version)
        return SnapshotReport(version=version, changed=None if changed is None else frozenset(changed))

    def drop_snapshot(self, version: int) -> None:
        self.state.drop_snapshot(version)

    # -- factor streaming (SyncConfig.mode "factors" | "auto"; factor_stream/coordination.py calls these) --------
    def factor_costs(self) -> tuple:
        """Per changed tensor, its merged vs factor cost (``protocols.endpoints.FactorCost``)."""
        return self._factor_trainer().costs(self.state)

    def factor_recipes(self, names: list[str], experts_per_recipe: int, bucket_bytes: int) -> tuple:
        """The recipe blocks (``protocols.recipe.Recipe``) of ``names``."""
        return self._factor_trainer().recipes(self.state, names, experts_per_recipe=experts_per_recipe,
                                              bucket_bytes=bucket_bytes)

    def factor_delta(self, version: int) -> tuple[str, ...]:
        """Gather ``version``'s factors (a collective over the trainer group) and return this rank's changed
        recipe blocks."""
        if self.plan is None:
            raise RuntimeError(f"trainer rank {self.rank}: factor_delta before open_transport")
        return tuple(self._factor_trainer().delta(self.state, version, self.plan, self.rank))

    def factor_committed(self, version: int) -> None:
        self._factor_trainer().ledger.commit(version)

    def factor_forget(self) -> None:
        self._factor_trainer().ledger.forget()

    def _factor_trainer(self):
        if self._factors is None:
            from sync_service.factor_stream.trainer import FactorTrainer

            self._factors = FactorTrainer()
        return self._factors

    def _source_for(self, version: int, plan: SyncPlan):
        """The send's source: merged boxes, or factor recipes when ``plan`` carries recipe entries."""
        if not any(e.recipe is not None for e in plan.entries):
            return self.state.source(version)
        return self._factor_trainer().source(self.state, version, plan)

    def send(self, request: SendRequest) -> SendReport:
        """Gather the factors this rank lacks, merge its owned boxes of the snapshot and stream them
        over ``request.owner``'s channel; blocks until every engine acked (at most ``timeout_s`` per step).
        ``request.check_finite``: a merged NaN/Inf fails the sync with ``MergeError`` naming the tensor;
        ``request.accumulate_dtype``: the merge's accumulation dtype.

        Raises:
            TimeoutError: the previous send did not end within ``timeout_s``. RuntimeError: no
                channel of that owner. MergeError, PeerLostError, RemoteSyncError: from the merge or the stream.
        """
        # the snapshot stays on a refusal before the send starts (no lock, no channel): the coordinator
        # retries the same snapshot on a reopened channel, or drops it when it gives up (a cancel of the
        # previous channel may reach this rank before this send does)
        if not self._send_lock.acquire(timeout=request.timeout_s):
            raise TimeoutError(f"trainer rank {self.rank}: send({request.version}) waited {request.timeout_s:.0f} s "
                               f"for the previous send to end; raise SyncConfig.timeout_s or check that rank")
        try:
            return self._send(request)
        finally:
            self._send_lock.release()

    def _send(self, request: SendRequest) -> SendReport:
        version = request.version
        if request.owner not in self.channels:
            raise RuntimeError(f"trainer rank {self.rank}: send before open_transport (channel {request.owner!r})")
        sender, plan = self.channels[request.owner]
        if self.before_send is not None:
            self.before_send(version)
        t0 = time.perf_counter()
        try:
            self.state.merge.check_finite = request.check_finite
            self.state.merge.accumulate_dtype = request.accumulate_dtype
            self.state.merge.out_dtypes = plan_dtypes(plan)  # the engines' dtype of every tensor (cast once)
            self.state.merge.fp8_blocks = table_blocks(e for e in plan.entries if e.recipe is None)  # block FP8
            source = _TimedSource(self._source_for(version, plan))
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
