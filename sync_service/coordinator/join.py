"""Late joiners: bring a new engine to the fleet's committed version by a peer copy.

A member engine that serves version v (and can export its weights, ``RolloutEngine.can_export``)
streams every parameter to the joiner over a channel of their own — one sender, one receiver, the
same bucketed, checksummed, HMAC-sealed wire as a push — and the joiner commits v. The trainers do
no work (no factor gather, no merge), the other engines receive nothing, and the next push is a
delta for every member, the joiner included. See docs/live-refresh.md for why this and not a full
sync from the trainers, and the measurements.

The caller (the coordinator) runs a join between two pushes, so the peer's served weights do not
change while they are read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from protocols.endpoints import ExportRequest, OpenChannel
from protocols.params import ParamMeta
from protocols.wire import SyncPlan, encode
from sync_service.coordinator.metrics import SyncError
from sync_service.coordinator.planning import validate_plan
from sync_service.streaming.plan import build_plan
from sync_service.transports import TRANSPORTS, TransportSpec
from sync_service.transports.spec import resolve_backend

__all__ = ["JoinMetrics", "peer_plan", "peer_copy"]

@dataclass(frozen=True, slots=True)
class JoinMetrics:
    """How a late joiner was brought to the fleet's version.

    Attributes:
        engine: the joiner's name. source: ``"peer:<name>"`` (peer copy) or ``"next-push"`` (no
        member held a version it could export: the joiner's first push is full for every member).
        version: the version it committed (``None``: none yet). bytes / buckets: payload moved to it.
        seconds: wall time of the copy, including opening the channel.
    """

    engine: str
    source: str
    version: int | None
    bytes: int
    buckets: int
    seconds: float


def peer_plan(table: Sequence[ParamMeta], *, bucket_bytes: int) -> SyncPlan:
    """The plan of a peer copy: every parameter of the peer's table, whole, from sender 0."""
    return build_plan([ParamMeta(name=m.name, dtype=m.dtype, shape=m.shape) for m in table],
                      bucket_bytes=bucket_bytes, sender=0)


def peer_copy(*, joiner, joiner_name: str, joiner_table: Sequence[ParamMeta], peer, peer_name: str,
              peer_table: Sequence[ParamMeta], version: int, config, channel: str, secret: bytes | None,
              get: Callable[[list, str], list], reset_versions: bool = False) -> JoinMetrics:
    """Stream ``peer``'s served ``version`` to ``joiner`` and commit it there. Blocks. ``reset_versions``: the
    joiner's update is begun with it (it serves ``version`` already, or the caller asked to renumber it).

    ``get(refs, what)`` waits for Ray refs with the coordinator's timeout and error mapping.

    Raises:
        PlanMismatchError: the joiner's table differs from the peer's (nothing sent).
        SyncError: the copy failed; the joiner aborted and serves what it served before.
    """
    import ray

    t0 = time.perf_counter()
    plan = peer_plan(peer_table, bucket_bytes=config.bucket_bytes)
    validate_plan(plan, joiner_table, engine=joiner_name)
    spec = TransportSpec(kind=TRANSPORTS[config.transport].join, name=channel, num_senders=1, num_receivers=1,
                         bucket_bytes=plan.bucket_bytes, connect_timeout_s=config.timeout_s,
                         op_timeout_s=config.timeout_s, device=config.device,
                         backend=resolve_backend(config.backend, config.device))
    raw, plan_bytes, timeout = spec.to_bytes(), encode(plan), config.timeout_s
    opened = joiner.open_transport.remote(OpenChannel(owner=channel, spec=raw, plan=plan_bytes, index=0, secret=secret))
    send = peer.send_weights.remote(ExportRequest(spec=raw, plan=plan_bytes, session=f"{channel}-v{version}",
                                                  version=version, timeout_s=timeout, secret=secret))
    try:
        get([opened], "open_transport (late joiner)")
        receiving = joiner.receive.remote(channel, timeout, True) if reset_versions else \
            joiner.receive.remote(channel, timeout)
        sent, received = get([send, receiving], "peer copy")
        get([joiner.commit.remote(channel, version, received.update_id) if received.update_id else
             joiner.commit.remote(channel, version)], "commit (late joiner)")
    except Exception as exc:
        try:
            ray.get([joiner.abort.remote(channel)], timeout=30)
            ray.get([send], timeout=30)
        except Exception:
            pass  # the copy's own error is what the caller needs
        raise SyncError(f"late joiner {joiner_name!r}: peer copy of version {version} from {peer_name!r} failed: {exc}",
                        None) from exc
    finally:
        try:
            ray.get([joiner.close_transport.remote(channel)], timeout=30)
        except Exception:
            pass
    return JoinMetrics(engine=joiner_name, source=f"peer:{peer_name}", version=version,
                       bytes=received.payload_bytes, buckets=sent.buckets, seconds=time.perf_counter() - t0)
