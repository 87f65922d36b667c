"""``Transfer``: one version, two-phase commit over the coordinator's open channel.

Phase 1 (prepare): every engine ``receive``s (stages, verifies, acks) while every trainer
``send``s. The first failure of any participant — a trainer's error (a NaN factor), an engine's
refusal, an actor's death — cancels the round at once: the trainers' channel sides are closed, so
every blocked send and receive ends within a transport poll, not after ``timeout_s``.
Phase 2: all prepared → every engine ``commit``s; otherwise every live engine ``abort``s (the
previous version stays served everywhere). The endpoint calls are ``protocols.endpoints``'.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field


from protocols.endpoints import EndpointDiedError, EndpointError, EndpointTimeoutError, SendRequest
from sync_service.coordinator.calls import endpoint_error, settle
from sync_service.coordinator.channel import Channel

__all__ = ["Prepared", "Transfer"]

GRACE_S = 30.0
"""Slack over ``timeout_s`` before the coordinator gives up on an endpoint's answer (seconds)."""


@dataclass(slots=True)
class Prepared:
    """Phase 1 of one attempt: per trainer its ``SendReport`` or error, per engine its ``ReceiveReport`` or error."""

    sent: list
    send_errors: list[EndpointError | None]
    received: list
    recv_errors: list[EndpointError | None]
    silent: list[int] = field(default_factory=list)
    """Engines that gave no answer at all before the deadline (a cut link, a hung process)."""

    @property
    def ok(self) -> bool:
        return not any(self.send_errors) and not any(self.recv_errors)

    def dead_engines(self) -> list[int]:
        return [i for i, e in enumerate(self.recv_errors) if isinstance(e, EndpointDiedError)]

    def lost_engines(self) -> list[int]:
        """Engines the push cannot wait for: dead, or silent (not even a timeout of their own came back)."""
        return sorted(set(self.dead_engines()) | set(self.silent))

    def trainer_died(self) -> bool:
        return any(isinstance(e, EndpointDiedError) for e in self.send_errors)

    def detail(self) -> str:
        """Every error, root causes first (the others are usually their consequence)."""
        errors = [e for e in self.send_errors + self.recv_errors if e is not None]
        return "; ".join(str(e) for e in sorted(errors, key=_consequence))


def _consequence(err: EndpointError) -> int:
    """Sort key: an actor's death or own error before a peer-lost / aborted / timed-out consequence."""
    if isinstance(err, EndpointDiedError):
        return 0
    return 2 if err.cause_type in ("PeerLostError", "SyncAbortedError", "RemoteSyncError", "TransportError") or \
        isinstance(err, EndpointTimeoutError) else 1


class Transfer:
    """Args: channel (open); trainers / engines and their names (receiver order); timeout_s."""

    def __init__(self, *, channel: Channel, trainers: Sequence, trainer_names: Sequence[str], engines: Sequence,
                 engine_names: Sequence[str], timeout_s: float) -> None:
        self.channel, self.trainers, self.trainer_names = channel, list(trainers), list(trainer_names)
        self.engines, self.engine_names, self.timeout_s = list(engines), list(engine_names), timeout_s
        self.engine_labels = [f"engine {n}" for n in self.engine_names]  # how errors name them

    def prepare(self, request: SendRequest, reset: Sequence[bool] = ()) -> Prepared:
        """Phase 1; returns when every participant answered (at once after the first failure). ``reset``: per
        engine, whether its update is begun with ``reset_versions`` (the engine then takes a version at or
        below the one it serves)."""
        owner = self.channel.owner
        reset = list(reset) + [False] * (len(self.engines) - len(reset))
        refs = [e.receive.remote(owner, self.timeout_s, True) if r else e.receive.remote(owner, self.timeout_s)
                for e, r in zip(self.engines, reset)]
        refs += [t.send.remote(request) for t in self.trainers]
        names = self.engine_labels + self.trainer_names
        calls = ["receive"] * len(self.engines) + ["send"] * len(self.trainers)
        results, errors, silent = self._watch(refs, names, calls)
        n = len(self.engines)
        return Prepared(sent=results[n:], send_errors=errors[n:], received=results[:n], recv_errors=errors[:n],
                        silent=[i for i in silent if i < n])

    def _watch(self, refs: list, names: list[str], calls: list[str]) -> tuple[list, list, list[int]]:
        """Per ref its result and error, and the indices that never answered (deadline: timeout + grace)."""
        import ray

        results: list = [None] * len(refs)
        errors: list = [None] * len(refs)
        pending = {ref: i for i, ref in enumerate(refs)}
        end = time.monotonic() + self.timeout_s + GRACE_S
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(end - time.monotonic(), 0.0))
            if not ready:
                break
            i = pending.pop(ready[0])
            try:
                results[i] = ray.get(ready[0])
            except Exception as exc:  # noqa: BLE001 - the endpoint's error, as ours
                errors[i] = endpoint_error(names[i], calls[i], exc)
                if self.channel.open_now:
                    self.channel.close_senders(self.trainers)  # cancel: everyone blocked on the channel ends now
        for ref, i in pending.items():
            errors[i] = EndpointTimeoutError(names[i], calls[i], "TimeoutError",
                                             f"no answer within {self.timeout_s + GRACE_S:.0f} s")
        if pending and self.channel.open_now:
            self.channel.close_senders(self.trainers)
        return results, errors, sorted(pending.values())

    def commit(self, version: int, tokens: Sequence[str | None] = ()) -> tuple[list[EndpointError | None], float]:
        """Phase 2 on every engine, each with the update token its receive reported (``tokens``, receiver
        order); per engine its error (``None``: committed) and the round's seconds. A live engine whose commit
        failed is aborted (it keeps serving its previous version, and its next sync begins cleanly instead of
        finding this one still staged)."""
        t0 = time.perf_counter()
        tokens = list(tokens) + [None] * (len(self.engines) - len(tokens))
        owner = self.channel.owner
        _, errors = settle([e.commit.remote(owner, version, t) if t else e.commit.remote(owner, version)
                            for e, t in zip(self.engines, tokens)], self.engine_labels,
                           "commit", self.timeout_s + GRACE_S)
        failed = [i for i, e in enumerate(errors) if e is not None]
        if failed:
            self.abort(skip=[i for i in range(len(self.engines)) if i not in failed or
                             isinstance(errors[i], EndpointDiedError)])
        return errors, time.perf_counter() - t0

    def abort(self, skip: Sequence[int] = ()) -> None:
        """Every engine but ``skip`` (dead ones) drops what it staged. Best effort, bounded."""
        live = [i for i in range(len(self.engines)) if i not in skip]
        settle([self.engines[i].abort.remote(self.channel.owner) for i in live], [self.engine_labels[i] for i in live],
               "abort", self.timeout_s + GRACE_S)
