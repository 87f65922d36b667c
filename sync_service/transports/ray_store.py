"""Ray object store transport: one ``ray.put`` per bucket, the ObjectRef fanned out to every receiver.

Payloads travel as numpy uint8 arrays (Ray serializes them zero-copy; torch tensors take Ray's
~20x slower default path). The sender puts a bucket's numpy view once (one copy into the store, after
which the bucket buffer is free again) and hands ``(header, ref)`` to each receiver's mailbox;
every receiver maps the same object read-only (zero copy) and drops it after applying.

Object lifetime: the sender keeps no reference once the frame is in every mailbox; each receiver
drops its own at ``release``, so an object is out of scope as soon as the last receiver released
it (nothing waits for a sync to end). Ray then deletes out-of-scope objects in batches (raylet
``free_objects_batch_size`` = 100 / ``free_objects_period_milliseconds`` = 1000): the store may
show up to that many released objects awaiting deletion. Payloads up to ``INLINE_BYTES`` skip the
object store: they travel inside the mailbox call (a copy per receiver, cheaper than an object for
small buckets), so small buckets create no object at all.

Mailboxes are small async actors named ``<name>-rx<receiver>`` (frames, depth ``spec.slots``: the
flow control) and ``<name>-tx<sender>`` (replies), in namespace ``weightsync``. Each side creates
its own inbox on its own node, so an inbox dies with its process (Ray fate-sharing) and the peer sees an actor
error instead of hanging. Needs ``ray.init`` (or a Ray worker) in both processes.

Relay (``spec.relay``, resolved once per side from the node of every mailbox): in a chain the
senders put each frame into receiver 0's mailbox only; receiver k, as soon as it holds a frame's
payload (before applying it), puts a copy into its own node's object store (so the bytes live, and
are owned, there) and hands ``(header, ref)`` to the relay queue of its own mailbox, where receiver
k + 1 takes it. So the trainers' link carries each byte once and every further hop runs between
engine nodes, pipelined per frame; every receiver still verifies what it got. The relay queue is
unbounded and on the relaying side's own node: a relaying side never waits for the next one (a cut
or dead downstream fails alone, by its own timeout); what a dead downstream leaves queued is freed
when the channel closes. A dead relaying side fails the sides after it at once (its mailbox and its
objects die with it: ``PeerLostError`` naming it); an unreachable one within ``_POLL_S`` + 5 s.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError

from protocols.interfaces import PeerLostError
from sync_service.transports.spec import TransportSpec

NAMESPACE = "weightsync"
_POLL_S = 1.0  # receivers check their senders' liveness this often while waiting
INLINE_BYTES = 64 << 10
"""Payloads up to this size, bytes, travel inside the mailbox call instead of as an object (below
Ray's own inlining threshold, ``max_direct_call_object_size`` = 100 KiB, with room for the header)."""


@ray.remote(num_cpus=0, max_concurrency=64)
class Mailbox:
    """Asyncio queues in an actor: ``put`` / ``get`` with timeouts (seconds). Queue 0 (depth
    ``maxsize``, 0: unbounded) takes the frames for its owner; queue 1 (unbounded) the frames its
    owner relays to the next receiver of a chain."""

    def __init__(self, maxsize: int):
        self.queues = (asyncio.Queue(maxsize), asyncio.Queue())

    async def put(self, item, timeout_s: float, queue: int = 0) -> bool:
        try:
            await asyncio.wait_for(self.queues[queue].put(item), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def get(self, timeout_s: float, queue: int = 0):
        try:
            return await asyncio.wait_for(self.queues[queue].get(), timeout_s)
        except asyncio.TimeoutError:
            return None

    async def ping(self) -> bool:
        return True

    async def node(self) -> str:
        """The Ray node id this mailbox (and so its owner) runs on."""
        return ray.get_runtime_context().get_node_id()


def _own_inbox(name: str, maxsize: int):
    """This side's mailbox, on this process's own node (Ray would place a resource-free actor on any
    node: frames would then cross the network twice, and a cut-off node would stall the channel)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    return Mailbox.options(name=name, namespace=NAMESPACE, get_if_exists=True,
                           scheduling_strategy=here).remote(maxsize)


def _lookup(name: str, timeout_s: float):
    end = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            if time.monotonic() >= end:
                raise TimeoutError(f"Ray mailbox {name!r} did not appear within {timeout_s:.1f}s (peer not started?)") from None
            time.sleep(0.02)


def _get(ref, timeout_s: float, what: str):
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        raise TimeoutError(f"{what}: no answer within {timeout_s:.1f}s") from None
    except (RayActorError, ObjectLostError) as exc:
        raise PeerLostError(f"{what}: peer gone ({type(exc).__name__})") from None


@dataclass(frozen=True, slots=True)
class Route:
    """Every side's mailbox of one channel, and whether frames go down a chain."""

    senders: list
    """The senders' reply mailboxes (``<name>-tx<s>``), in sender order."""
    receivers: list
    """The receivers' mailboxes (``<name>-rx<r>``), in receiver order (the chain's order)."""
    chain: bool
    """Senders → receiver 0 → receiver 1 → …; ``False``: senders → every receiver."""


def resolve_route(spec: TransportSpec, timeout_s: float) -> Route:
    """Look up every mailbox of ``spec``'s channel (each waits up to ``timeout_s`` to appear) and
    resolve ``spec.relay``: ``"auto"`` chains when the receivers' mailboxes sit on >= 2 Ray nodes
    that host no sender's. Every side resolves the same route from the same nodes.

    Raises: TimeoutError: a mailbox did not appear. PeerLostError: one died meanwhile.
    """
    senders = [_lookup(f"{spec.name}-tx{s}", timeout_s) for s in range(spec.num_senders)]
    receivers = [_lookup(f"{spec.name}-rx{r}", timeout_s) for r in range(spec.num_receivers)]
    chain = spec.num_receivers > 1 and spec.relay == "chain"
    if spec.num_receivers > 1 and spec.relay == "auto":
        nodes = _get([mb.node.remote() for mb in senders + receivers], timeout_s, "Ray mailbox node")
        chain = len(set(nodes[len(senders):]) - set(nodes[:len(senders)])) >= 2
    return Route(senders=senders, receivers=receivers, chain=chain)


def _relayed(body):
    """What a relaying receiver hands on for a payload it holds: a fresh object in its own node's
    store (one copy; the next receiver pulls it from here), or the payload itself when it travels
    inline (``INLINE_BYTES``)."""
    return ray.put(body) if body is not None and len(body) > INLINE_BYTES else body


class RaySender:
    """Sender side: fans each bucket's one ObjectRef out to every receiver's mailbox."""

    def __init__(self, spec: TransportSpec, sender: int = 0):
        self.spec, self.sender = spec, sender
        self.inbox = _own_inbox(f"{spec.name}-tx{sender}", 0)
        ray.get(self.inbox.ping.remote(), timeout=spec.connect_timeout_s)
        self._receivers: list | None = None

    @property
    def num_receivers(self) -> int:
        return self.spec.num_receivers

    def _peers(self) -> list:
        """The mailboxes a frame goes to: every receiver's, or in a chain receiver 0's only."""
        if self._receivers is None:
            if self.spec.num_receivers > 1 and self.spec.relay != "direct":
                route = resolve_route(self.spec, self.spec.connect_timeout_s)
                self._receivers = route.receivers[:1] if route.chain else route.receivers
            else:
                self._receivers = [_lookup(f"{self.spec.name}-rx{r}", self.spec.connect_timeout_s)
                                   for r in range(self.spec.num_receivers)]
        return self._receivers

    def send(self, header: bytes, payload, timeout_s: float) -> None:
        """Blocks until every receiver's mailbox (in a chain: receiver 0's) took the frame; ``payload``
        may be reused then."""
        if self.inbox is None:
            raise PeerLostError(f"Ray transport {self.spec.name}: the sender's side was closed (the push was cancelled)")
        if payload is None or len(payload) <= INLINE_BYTES:
            body = payload  # copied into each call's arguments at submission
        else:
            body = ray.put(payload)  # one copy into the store; dropped here once every mailbox holds it
        done = _get([mb.put.remote((header, body), timeout_s) for mb in self._peers()], timeout_s + 5.0,
                    "Ray mailbox put")
        del body
        if not all(done):
            raise TimeoutError(f"Ray transport {self.spec.name}: a receiver did not take a frame within {timeout_s:.1f}s")

    def poll_reply(self, timeout_s: float) -> bytes | None:
        if self.inbox is None:
            raise PeerLostError(f"Ray transport {self.spec.name}: the sender's side was closed (the push was cancelled)")
        item = _get(self.inbox.get.remote(timeout_s), timeout_s + 5.0, "Ray reply mailbox")
        return None if item is None else item[0]

    def close(self) -> None:
        if self.inbox is not None:
            ray.kill(self.inbox)
            self.inbox = None


class RayReceiver:
    """Receiver side: zero-copy reads of the fanned-out objects; in a chain, relays each frame on."""

    def __init__(self, spec: TransportSpec, receiver: int = 0):
        self.spec, self.receiver = spec, receiver
        self.inbox = _own_inbox(f"{spec.name}-rx{receiver}", spec.slots)
        ray.get(self.inbox.ping.remote(), timeout=spec.connect_timeout_s)
        self._senders: list | None = None
        self._source: tuple | None = None  # (mailbox, queue) frames come from; None: this inbox, once resolved
        self._relay = False  # whether this side hands every frame on to the next receiver
        self._held: deque = deque()  # payload arrays of frames not yet released, oldest first

    @property
    def max_held(self) -> int:
        """Frames a caller may hold unreleased (each pins its object); ``recv`` beyond it releases the oldest."""
        return 2

    def _peers(self) -> list:
        if self._senders is None:
            self._senders = [_lookup(f"{self.spec.name}-tx{s}", self.spec.connect_timeout_s)
                             for s in range(self.spec.num_senders)]
        return self._senders

    def _resolve(self, timeout_s: float) -> tuple:
        """Where frames come from: (mailbox, queue, who). Resolves the route on first use (it needs
        every side's mailbox: a relay decision only when several receivers may chain)."""
        if self._source is None:
            self._source = (self.inbox, 0, None)
            if self.spec.num_receivers > 1 and self.spec.relay != "direct":
                route = resolve_route(self.spec, timeout_s)
                self._senders = route.senders
                self._relay = route.chain and self.receiver + 1 < self.spec.num_receivers
                if route.chain and self.receiver > 0:
                    self._source = (route.receivers[self.receiver - 1], 1, f"receiver {self.receiver - 1}")
        return self._source

    def recv(self, timeout_s: float):
        if len(self._held) >= self.max_held:
            self.release()
        end = time.monotonic() + timeout_s
        source, queue, relay = self._resolve(min(timeout_s, self.spec.connect_timeout_s))
        while True:
            left = end - time.monotonic()
            if left <= 0:
                via = "" if relay is None else f" from {relay}, which relays every frame to this one"
                raise TimeoutError(f"Ray transport {self.spec.name}: no frame within {timeout_s:.1f}s{via}")
            item = self._take(source, queue, relay, min(left, _POLL_S))
            if item is not None:
                break
            if self._senders is not None:  # known once a frame came: check they still live
                _get([p.ping.remote() for p in self._senders], 5.0, "Ray sender liveness")
        self._peers()
        header, body = item
        del item
        if isinstance(body, ray.ObjectRef):
            body = self._pull(body, relay, max(end - time.monotonic(), 1.0))  # zero copy: pins the object
        if self._relay:
            _get(self.inbox.put.remote((header, _relayed(body)), 1.0, 1), max(end - time.monotonic(), 5.0),
                 "Ray relay mailbox")
        self._held.append(body)
        return header, body

    def _take(self, source, queue: int, relay: str | None, wait_s: float):
        """The next frame of ``source``'s ``queue`` or ``None`` after ``wait_s``."""
        try:
            return _get(source.get.remote(wait_s, queue), wait_s + 5.0, "Ray inbox")
        except (PeerLostError, TimeoutError) as exc:
            if relay is None:
                raise
            raise PeerLostError(f"Ray transport {self.spec.name}: {relay}, which relays every frame to receiver "
                                f"{self.receiver}, is gone or unreachable ({exc}); SyncConfig.relay='direct' has "
                                "every engine take the frames from the trainers") from None

    def _pull(self, ref, relay: str | None, timeout_s: float):
        try:
            return _get(ref, timeout_s, "Ray object get")
        except PeerLostError as exc:
            if relay is None:
                raise
            raise PeerLostError(f"Ray transport {self.spec.name}: {relay}, which relays every frame to receiver "
                                f"{self.receiver}, died before this one pulled a frame ({exc})") from None

    def release(self) -> None:
        """Drops the oldest held frame's object: out of scope once every receiver released it
        (no-op when none is held)."""
        if self._held:
            self._held.popleft()

    def reply(self, message: bytes, timeout_s: float) -> None:
        done = _get([p.put.remote((message, None), timeout_s) for p in self._peers()], timeout_s + 5.0, "Ray reply")
        if not all(done):
            raise TimeoutError(f"Ray transport {self.spec.name}: a sender did not take a reply within {timeout_s:.1f}s")

    def close(self) -> None:
        self._held.clear()
        if self.inbox is not None:
            ray.kill(self.inbox)
            self.inbox = None
