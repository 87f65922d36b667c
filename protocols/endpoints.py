"""The endpoint contract: what a trainer endpoint and a rollout endpoint answer, and what they return.

The coordinator (``sync_service/coordinator``) talks to trainers and engines only through these
calls. An endpoint is any Ray actor whose class satisfies ``TrainerEndpoint`` (plus
``FactorTrainerEndpoint`` for ``SyncConfig.mode`` "factors" / "auto") or ``RolloutEndpoint``; the
coordinator calls ``handle.<method>.remote(...)`` and waits with its own timeout. The actors in
``actors/`` are thin wrappers: decode the request, call the library (``sync_service``), return a
report. To plug in your own trainer or engine, implement these methods on an actor class and pass
its handles to ``WeightSync``; ``tests/conformance/test_endpoints.py`` checks an implementation.

One sync of version v (two-phase commit; the coordinator's ``Transfer``)::

    trainer.snapshot(v) -> SnapshotReport                      freeze v (the trainer may train on)
    engine.receive(owner, timeout_s) -> ReceiveReport   ║ phase 1 (prepare): engines stage, verify
    trainer.send(SendRequest) -> SendReport             ║ and ack; trainers merge and stream buckets
    engine.commit(owner, v)        every engine acked and every trainer returned: phase 2, commit
    engine.abort(owner)            otherwise, at the first failure: nothing of v is served anywhere

Channels: ``open_transport(OpenChannel)`` opens this endpoint's side of one channel, named by its
``owner`` (one per coordinator). An endpoint keeps one channel per owner, so two coordinators on
the same actors never close or reuse each other's channel; ``close_transport(owner)`` closes one,
``close_transport(None)`` all. Membership changes open the owner's channel again (a new spec).

Late joiners: ``engine.can_export()``, ``engine.send_weights(ExportRequest) -> ExportReport`` (a
member engine streams its served version to the joiner over a channel of their own).

Values: requests and reports are frozen dataclasses of plain values (str, int, float, bytes,
tuples, ``ParamMeta``); ``spec`` and ``plan`` travel msgpack-encoded (``TransportSpec.to_bytes``,
``protocols.wire.encode``) and are decoded and validated by the endpoint. Errors an endpoint
raises reach the caller as ``EndpointError`` naming the endpoint, the call and the cause.
Nothing here imports Ray or torch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from protocols.params import ParamMeta
from protocols.readback import ServedWeights
from protocols.recipe import Recipe

__all__ = ["EndpointDiedError", "EndpointError", "EndpointTimeoutError", "ExportReport", "ExportRequest", "FactorCost",
           "FactorStateReport", "FactorTrainerEndpoint", "Launcher", "OpenChannel", "ReceiveReport", "RolloutEndpoint",
           "SendReport", "SendRequest", "SnapshotReport", "TrainerEndpoint", "clean_error_text"]


# -- requests --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class OpenChannel:
    """Open this endpoint's side of the channel of ``owner``; blocks until every peer connected.

    Attributes:
        owner: the channel's key on the endpoint (the coordinator's id; a late join's channel name).
            Opening an owner's channel again closes its previous one first.
        spec: ``TransportSpec.to_bytes()`` (kind, name, senders, receivers, sizes, timeouts).
        plan: ``protocols.wire.encode(SyncPlan)``: the plan every sync of this channel follows.
        index: this endpoint's sender index in the plan (a trainer: its rank) or receiver index (an engine).
        secret: the session's HMAC-SHA256 key; buckets are sealed (trainer) or verified (engine) with it.
        bucket_buffers: a sender's bucket buffers (2: double buffering); ignored by receivers.
    """

    owner: str
    spec: bytes
    plan: bytes
    index: int
    secret: bytes | None = field(default=None, repr=False)
    bucket_buffers: int = 2
    check_served: str = "off"  # an engine's served check before it votes (SyncConfig.check_served); senders ignore it


@dataclass(frozen=True, slots=True)
class SendRequest:
    """Stream this trainer's part of snapshot ``version`` over ``owner``'s channel.

    Attributes:
        owner: the channel (``OpenChannel.owner``). session: the sync's id on the wire (unique per attempt).
        version: the snapshotted weight version. names: the delta's tensor names; ``None``: everything.
        timeout_s: bound of the whole send, seconds. check_finite: refuse merged NaN/Inf (``MergeError``).
        accumulate_dtype: the merge's accumulation dtype (``MergeConfig.accumulate_dtype``).
    """

    owner: str
    session: str
    version: int
    names: tuple[str, ...] | None
    timeout_s: float
    check_finite: bool = False
    accumulate_dtype: str = "float32"


@dataclass(frozen=True, slots=True)
class ExportRequest:
    """A member engine streams its served ``version`` to a late joiner (it is sender 0 of ``plan``).

    Attributes:
        spec, plan, secret: as ``OpenChannel``. session: the copy's id on the wire.
        version: the version the engine must serve. timeout_s: bound of the copy, seconds.
    """

    spec: bytes
    plan: bytes
    session: str
    version: int
    timeout_s: float
    secret: bytes | None = field(default=None, repr=False)


# -- reports ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SnapshotReport:
    """``version`` is frozen on a trainer. ``changed``: the names a delta needs; ``None``: all (base changed, first)."""

    version: int
    changed: frozenset[str] | None


@dataclass(frozen=True, slots=True)
class SendReport:
    """One trainer's send of one version: seconds per stage and sizes.

    Attributes:
        rank: the trainer's sender index. gather_s: adapter refresh / factor all-gather before the first bucket.
        merge_s: merging into bucket views. pack_s: checksums + headers (merge excluded). transfer_s: inside the
        transport's send. ack_wait_s: after the last frame, until every engine acked. total_s: the whole send.
        payload_bytes / buckets / entries: what it sent.
    """

    rank: int
    gather_s: float
    merge_s: float
    pack_s: float
    transfer_s: float
    ack_wait_s: float
    total_s: float
    payload_bytes: int
    buckets: int
    entries: int


@dataclass(frozen=True, slots=True)
class ReceiveReport:
    """One engine received one whole version: staged, verified and acked, not committed.

    Attributes:
        engine: its name. version: the received version. buckets / entries / payload_bytes: what arrived. wait_s:
        blocked on the transport. verify_s: checksums and header checks. apply_s: copies into staging. finish_s:
        post-load processing (in factor modes also the wait for the receiver's last merges). total_s: the whole
        receive. rx_merge_s: wall seconds during which the receiver merged factor-mode targets (overlapping the stream;
        0 in merged mode). All seconds. update_id: the engine's update token (``commit`` / ``abort`` act with it;
        ``""``: an engine that hands out none). served_findings: problems its served check
        (``SyncConfig.check_served``) found in this version (0: clean; ``None``: off, or not reported); under ``"log"``
        staged anyway.
    """

    engine: str
    version: int
    buckets: int
    entries: int
    payload_bytes: int
    wait_s: float
    verify_s: float
    apply_s: float
    finish_s: float
    total_s: float
    rx_merge_s: float = 0.0
    update_id: str = ""
    served_findings: int | None = None


@dataclass(frozen=True, slots=True)
class ExportReport:
    """A peer copy from this engine: ``payload_bytes`` and ``buckets`` sent, in ``seconds``."""

    payload_bytes: int
    buckets: int
    seconds: float


@dataclass(frozen=True, slots=True)
class FactorCost:
    """What moving one changed tensor costs, merged vs as LoRA factors (factor streaming).

    Attributes:
        name: the engine tensor. merged_bytes: its merged size. factor_bytes: its factors' size.
        pristine_bytes: the pristine base copy an engine must keep to merge factors.
        why_not: why it cannot move as factors (``""``: it can).
    """

    name: str
    merged_bytes: int
    factor_bytes: int
    pristine_bytes: int
    why_not: str = ""


@dataclass(frozen=True, slots=True)
class FactorStateReport:
    """An engine's factor streaming state: ``ready`` (a factor delta can apply), ``resident_bytes``
    (pristine copies + factors held), ``merge_s`` (seconds merging factors, cumulative)."""

    ready: bool
    resident_bytes: int
    merge_s: float


# -- endpoints -------------------------------------------------------------------------------
@runtime_checkable
class TrainerEndpoint(Protocol):
    """A trainer rank, as the coordinator calls it. Every call may run while training goes on."""

    def owned_metas(self) -> Sequence[ParamMeta]:
        """The global boxes this rank produces, in production order (called once, to plan)."""
        ...

    def open_transport(self, request: OpenChannel) -> None:
        """Open the sender side of ``request.owner``'s channel. Blocks until the receivers connected."""
        ...

    def close_transport(self, owner: str | None = None) -> None:
        """Close ``owner``'s channel (``None``: every channel). Idempotent; a blocked ``send`` fails."""
        ...

    def snapshot(self, version: int) -> SnapshotReport:
        """Freeze ``version``'s trained state; later training never leaks into its send."""
        ...

    def drop_snapshot(self, version: int) -> None:
        """Forget ``version``'s snapshot (its push will not be sent)."""
        ...

    def send(self, request: SendRequest) -> SendReport:
        """Merge and stream this rank's part of the snapshot; blocks until every engine acked.

        Raises:
            MergeError (non-finite merge, named), TimeoutError, PeerLostError, or a receiver's error.
        """
        ...


@runtime_checkable
class FactorTrainerEndpoint(TrainerEndpoint, Protocol):
    """A trainer rank that can stream LoRA factors (``SyncConfig.mode`` "factors" / "auto")."""

    def factor_costs(self) -> Sequence[FactorCost]:
        """Per changed tensor, its merged vs factor cost (called on rank 0, to plan)."""
        ...

    def factor_recipes(self, names: Sequence[str], experts_per_recipe: int, bucket_bytes: int) -> Sequence[Recipe]:
        """The recipe blocks of ``names`` (called on rank 0, to plan)."""
        ...

    def factor_delta(self, version: int) -> Sequence[str]:
        """Gather ``version``'s factors (a collective over the trainer group); this rank's changed blocks."""
        ...

    def factor_committed(self, version: int) -> None:
        """``version`` was committed everywhere: the delta baseline moves to it."""
        ...

    def factor_forget(self) -> None:
        """A push failed: forget the delta baseline (the next push is full)."""
        ...


@runtime_checkable
class RolloutEndpoint(Protocol):
    """A rollout engine, as the coordinator calls it. Generation goes on during every call."""

    def engine_name(self) -> str:
        """The engine's name (reports and errors use it)."""
        ...

    def param_metas(self) -> Sequence[ParamMeta]:
        """The engine's own parameter table (whole tensors), in the trainers' naming."""
        ...

    def weight_version(self) -> int | None:
        """The committed version it serves; ``None`` before the first sync."""
        ...

    def open_transport(self, request: OpenChannel) -> None:
        """Open the receiver side of ``request.owner``'s channel. Blocks until the senders connected."""
        ...

    def close_transport(self, owner: str | None = None) -> None:
        """Close ``owner``'s channel (``None``: every channel). Idempotent."""
        ...

    def receive(self, owner: str, timeout_s: float, reset_versions: bool = False) -> ReceiveReport:
        """Phase 1: receive one whole version over ``owner``'s channel, stage and verify it (the engine's
        pre-commit checks vote here), ack it. ``reset_versions``: the version may be at or below the served one.

        Raises:
            ProtocolError (bad or forged data), TimeoutError, PeerLostError, SyncAbortedError;
            ``UpdateInProgressError`` (another sync's update is staged: it is kept), ``VersionFenceError``
            (at or below the served version), ``CommitRefused`` (a pre-commit check); nothing of this
            sync is staged afterwards.
        """
        ...

    def commit(self, owner: str, version: int, update_id: str | None = None) -> None:
        """Phase 2: serve the staged ``version``, atomically (between two generations). ``update_id``: the
        token of ``receive``'s report (``None``: the update ``owner``'s last receive staged).

        Raises:
            RuntimeError (``CommitRefused``): the token is not the staged update's (that update is kept), or
                ``version`` is not that finished update's, or not above the served version (a replayed or
                stale commit): this update is dropped then, the previous version stays served.
        """
        ...

    def abort(self, owner: str, update_id: str | None = None) -> None:
        """Drop the update ``owner`` staged (``update_id``: that token only); another owner's update is never
        touched; the previous version stays served. Idempotent."""
        ...

    def served_weights(self, names: Sequence[str] | None = None, values: bool = False) -> ServedWeights:
        """Per-tensor xxh3_64 digests of what it serves now (``names``: those only, ``None``: all), computed
        on the engine over the served bytes; with ``values`` the bytes too (small models). See
        ``protocols.readback``.

        Raises:
            KeyError: a name it does not serve. RuntimeError: this engine cannot read its weights back.
        """
        ...

    def can_export(self) -> bool:
        """Whether ``send_weights`` works on this engine."""
        ...

    def send_weights(self, request: ExportRequest) -> ExportReport:
        """Stream the served ``request.version`` to a late joiner; blocks until it acked.

        Raises:
            RuntimeError: this engine does not serve ``request.version`` or cannot export.
        """
        ...


@runtime_checkable
class Launcher(Protocol):
    """Starts endpoint actors for code that runs whole deployments (CLI runs, benchmark, RL loop);
    ``actors.launch.RayLauncher`` is the implementation. Each returns the started actors' handles,
    blocking until they answer (``timeout_s`` keyword)."""

    def start_trainers(self, base_dir, adapter_dir, **options) -> list:
        """``ep·tp`` trainer endpoints (options: ``ep``, ``tp``, ``timeout_s``, ``actor_options``, ``reuse``)."""
        ...

    def start_engines(self, model_dir, count: int, **options) -> list:
        """``count`` rollout endpoints (options: ``engine``, ``timeout_s``, ``actor_options``, ``prefix``)."""
        ...

    def start_server_engines(self, urls, **options) -> list:
        """One rollout endpoint per running vLLM server URL (options: ``api_key``, ``prefix``, ``timeout_s``)."""
        ...

    def start_policy_trainers(self, base_dir, adapter_dir, **options) -> list:
        """Trainer endpoints that also learn (the toy GRPO step); options as ``start_trainers``."""
        ...


# -- errors ----------------------------------------------------------------------------------
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def clean_error_text(text: str, limit: int = 1000) -> str:
    """The last meaningful line of an error text (no colour codes, traceback, Ray wrappers); ``limit`` chars at most."""
    lines = [ln.strip() for ln in _ANSI.sub("", text).splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("Traceback", "File ", "^", "~", "ray::"))]
    return lines[-1][:limit] if lines else ""


class EndpointError(RuntimeError):
    """A call on a trainer or engine endpoint failed.

    Attributes:
        endpoint: which one (``"trainer rank 1"``, ``"engine e0"``). call: the method.
        cause_type: the type name of the endpoint's own error. cause: its message (one line, no colour).
    """

    def __init__(self, endpoint: str, call: str, cause_type: str, cause: str):
        super().__init__(f"{endpoint}: {call} failed: {cause_type}: {cause}")
        self.endpoint, self.call, self.cause_type, self.cause = endpoint, call, cause_type, cause

    def __reduce__(self):
        return (type(self), (self.endpoint, self.call, self.cause_type, self.cause))


class EndpointDiedError(EndpointError):
    """The endpoint's process is gone (killed, crashed, out of memory)."""


class EndpointTimeoutError(EndpointError, TimeoutError):
    """The endpoint did not answer within the coordinator's bound, or timed out itself (e.g. its
    peers did not connect within ``connect_timeout_s``)."""
