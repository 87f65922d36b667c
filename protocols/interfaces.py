"""The interfaces every weightsync component plugs into.

Trainer side: a ``WeightSource`` yields merged engine tensors (or boxes of them) on demand; the
bucketer asks it to write each box straight into a bucket view. Receiver side: an
``EngineAdapter`` exposes an engine's parameter table and applies received boxes, committing a
weight version atomically. ``Transport`` moves sealed buckets between them.

These are ``typing.Protocol`` classes: implementations need not inherit. Tensors are
``torch.Tensor`` (CPU or CUDA); nothing here imports Ray or torch.distributed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from protocols.params import Box, ParamMeta

if TYPE_CHECKING:
    import torch


@runtime_checkable
class WeightSource(Protocol):
    """Trainer side: the planned stream of engine tensors for one weight version."""

    def param_metas(self) -> Sequence[ParamMeta]:
        """Every box this source produces, in production order (layer order).

        A name may appear several times with disjoint boxes (e.g. a TP rank's gate and up rows).
        """
        ...

    def changed_names(self) -> frozenset[str]:
        """Names whose values depend on trained state (LoRA targets, modules_to_save).

        A delta sync sends only these; everything else equals the base checkpoint.
        """
        ...

    def fill(self, name: str, box: Box, out: "torch.Tensor") -> None:
        """Write the values of ``box`` of tensor ``name`` into ``out``.

        ``out`` has shape ``box_shape(box)`` and the param's dtype, usually a view into a bucket;
        it may be reused by the caller as soon as this returns. Blocks until written.

        Raises:
            KeyError: ``name`` is not produced by this source.
            ValueError: ``box`` is not inside a box this source owns, or ``out`` has the wrong
                shape or dtype.
        """
        ...


class PauseMode(str, Enum):
    """What happens to in-flight generation while a version is applied (as vLLM's pause modes)."""

    WAIT = "wait"      # let in-flight requests finish on the old version, hold new ones
    ABORT = "abort"    # abort in-flight requests
    KEEP = "keep"      # keep serving from the old weights (requires a staged apply)


@dataclass(frozen=True, slots=True)
class FinishReport:
    """What ``EngineAdapter.finish_update`` did for one sync."""

    tensors: int
    """Tensors staged by the sync (names announced in ``begin_update``)."""
    modules: int
    """Engine modules whose post-load processing ran (0 for an engine that needs none, e.g. transformers)."""
    seconds: float
    """Wall time of the finish (completeness check + post-load processing), seconds."""


@runtime_checkable
class EngineAdapter(Protocol):
    """Receiver side: one rollout engine's parameters and its update lifecycle.

    Lifecycle per sync: ``begin_update`` → ``apply`` × n → ``finish_update`` (post-load
    processing, once) → ``commit`` — or ``abort`` at any point, after which the engine serves its
    previous version unchanged.
    """

    def param_metas(self) -> Sequence[ParamMeta]:
        """The engine's own parameter table (whole tensors), in the naming it accepts."""
        ...

    def weight_version(self) -> int | None:
        """The committed version the engine serves; ``None`` before the first sync."""
        ...

    def begin_update(self, version: int, names: Sequence[str]) -> None:
        """Prepare to receive ``names`` for ``version`` (stage buffers, pause generation, ...)."""
        ...

    def apply(self, name: str, box: Box, data: "torch.Tensor") -> None:
        """Copy ``data`` (shape ``box_shape(box)``) into ``box`` of parameter ``name``.

        ``data`` is a view into a transport buffer, valid only during the call: copy, never keep it.
        """
        ...

    def finish_update(self) -> FinishReport:
        """Check that every announced tensor was covered completely, then run the post-load processing
        for everything applied since ``begin_update``; once per sync.

        Raises:
            ValueError: a tensor was covered incompletely (nothing is served from this sync).
            RuntimeError: no sync begun, or the sync was finished already.
        """
        ...

    def commit(self, version: int) -> None:
        """Make ``version`` the served weights, atomically."""
        ...

    def abort(self) -> None:
        """Drop everything staged since ``begin_update``; the previous version stays served."""
        ...

    def reset_caches(self) -> None:
        """Drop prefix / KV caches computed under an older version."""
        ...


@runtime_checkable
class ChunkedApply(Protocol):
    """An ``EngineAdapter`` whose ``apply`` is a local copy into staging, cheap per call (no RPC).

    For such an engine the receiver checks a bucket's xxh3_64 while it applies it: each entry is handed
    to ``apply`` in row-major pieces of at most ``apply_chunk_bytes``, and each piece's bytes are hashed
    right after their copy, while they are in cache (one pass over the bucket instead of two). ``apply``
    therefore sees bytes whose checksum is not yet confirmed; a mismatch raises before
    ``finish_update`` and the sync is aborted (``abort`` drops everything staged), so nothing
    unverified is ever served. Engines without this member get every bucket verified before any apply.
    """

    @property
    def apply_chunk_bytes(self) -> int:
        """Largest piece per ``apply`` call while verifying, bytes (cache-sized; > 0)."""
        ...


class TransportError(RuntimeError):
    """A transport cannot deliver: the peer is gone, the channel is closed or broken."""


class PeerLostError(TransportError):
    """The peer process died or closed its side mid-sync."""


@runtime_checkable
class TransportSender(Protocol):
    """Sender side of a transport: moves frames from one sender to every receiver of the spec.

    A frame is a msgpack header (``protocols.wire``) plus an optional payload: a 1-D uint8 buffer
    (numpy array or memoryview) of a sealed bucket. Frames arrive in send order at every receiver.
    """

    @property
    def num_receivers(self) -> int:
        """How many receivers every frame goes to (and how many replies a sync expects)."""
        ...

    def send(self, header: bytes, payload: "memoryview | None", timeout_s: float) -> None:
        """Deliver one frame to every receiver.

        Blocks until ``payload`` may be reused by the caller (copied or published; not
        necessarily consumed). Raises TimeoutError after ``timeout_s`` s, PeerLostError if a
        receiver is gone.
        """
        ...

    def poll_reply(self, timeout_s: float) -> bytes | None:
        """The next reply (an encoded ``Ack``/``Error``) from any receiver, or ``None`` if none
        arrived within ``timeout_s`` s (0: do not wait)."""
        ...

    def close(self) -> None:
        """Release every resource (segments, actors, process groups); idempotent."""
        ...


@runtime_checkable
class TransportReceiver(Protocol):
    """Receiver side of a transport: frames from every sender of the spec, in each sender's order."""

    def recv(self, timeout_s: float) -> "tuple[bytes, memoryview | None]":
        """The next frame: ``(header, payload)``; ``payload`` is ``None`` for a control message.

        The payload is valid only until ``release()``: the transport may reuse its memory, so the
        caller copies what it needs and keeps no view. Raises TimeoutError after ``timeout_s`` s,
        PeerLostError if the sender is gone.
        """
        ...

    def release(self) -> None:
        """The payload of the last ``recv`` is no longer used; its memory may be reused."""
        ...

    def reply(self, message: bytes, timeout_s: float) -> None:
        """Send an encoded ``Ack``/``Error`` to every sender."""
        ...

    def close(self) -> None:
        """Release every resource; idempotent."""
        ...
