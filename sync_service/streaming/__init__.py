"""Bucketed, double-buffered streaming of weight versions (see docs/streaming.md).

Trainer shard (sender ``rank``)::

    plan = build_plan(source.param_metas(), bucket_bytes=256 << 20, sender=rank)  # once
    full = combine_plans([plan_of_rank_0, plan_of_rank_1, ...])   # coordinator, once
    sender = Sender(open_sender(spec, rank), BucketPool(bucket_bytes=full.bucket_bytes), sender=rank)
    stats = sender.send_sync(session, version, source, full, names=None | delta, timeout_s=60)

Rollout engine (receiver ``i``)::

    receiver = BucketReceiver(adapter, full, receiver=i)
    stats = receiver.receive_sync(open_receiver(spec, i), timeout_s=60)   # begin → apply → finish → ack
    adapter.commit(stats.version)      # by the coordinator once every engine acked

``send_sync`` returns once every receiver acked; a receiver's error raises ``RemoteSyncError``
with its text on every sender, and both sides are ready for the next sync.
"""

from protocols.wire import ProtocolError, SyncPlan
from sync_service.streaming.plan import (
    DEFAULT_BUCKET_BYTES, build_plan, buckets_of, combine_plans, senders, split_box, subset_plan,
)
from sync_service.streaming.pool import BucketPool, BucketPoolConfig
from sync_service.streaming.receiver import ApplyStats, BucketReceiver, SyncAbortedError
from sync_service.streaming.sender import RemoteSyncError, Sender, SendStats
from sync_service.streaming.tensor_source import TensorSource

__all__ = [
    "DEFAULT_BUCKET_BYTES", "ApplyStats", "BucketPool", "BucketPoolConfig", "BucketReceiver", "ProtocolError",
    "RemoteSyncError", "SendStats", "Sender", "SyncAbortedError", "SyncPlan", "TensorSource", "build_plan",
    "buckets_of", "combine_plans", "senders", "split_box", "subset_plan",
]
