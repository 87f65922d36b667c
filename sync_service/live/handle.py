"""Reaching a training rank's endpoint from the coordinator: through the Ray actor the user owns.

A training rank runs inside a Ray actor the user (or the RL framework) made — a Ray Train worker,
an actor group as verl / NeMo-RL / slime build one. ``attach_trainer`` registers the rank's
``TrainerEndpoint`` in this process under an id and returns an ``EndpointHandle``: a small picklable
value (the actor's handle, the id, the rank) the coordinator calls like an actor —
``handle.snapshot.remote(v)`` runs ``endpoint.snapshot(v)`` in the training process through Ray's
built-in ``__ray_call__``, so the user's actor class needs no weightsync methods. The actor must
accept concurrent calls (``max_concurrency >= 2``, or a threaded/async actor) so a send can run
while the training loop runs on another thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["EndpointHandle", "lookup", "register", "unregister"]

_REGISTRY: dict[str, Any] = {}
"""Endpoint id → ``TrainerEndpoint`` of this process (what ``__ray_call__`` dispatches to)."""
_LOCK = threading.Lock()


def register(endpoint_id: str, endpoint) -> None:
    """Make ``endpoint`` reachable under ``endpoint_id`` in this process (replaces an earlier one)."""
    with _LOCK:
        _REGISTRY[endpoint_id] = endpoint


def unregister(endpoint_id: str) -> None:
    with _LOCK:
        _REGISTRY.pop(endpoint_id, None)


def lookup(endpoint_id: str):
    """The ``TrainerEndpoint`` registered in this process under ``endpoint_id``.

    Raises:
        LookupError: no endpoint ``endpoint_id`` here (detached, or the process restarted: attach again).
    """
    with _LOCK:
        endpoint = _REGISTRY.get(endpoint_id)
    if endpoint is None:
        raise LookupError(f"no weightsync endpoint {endpoint_id!r} in this training process; it was detached or the "
                          f"process restarted — call attach_trainer again and give the coordinator the new handles")
    return endpoint


def _dispatch(_actor, endpoint_id: str, method: str, *args, **kwargs):
    """Runs in the training process: ``endpoint.<method>(*args, **kwargs)`` (``lookup``'s errors)."""
    return getattr(lookup(endpoint_id), method)(*args, **kwargs)


@dataclass(frozen=True, slots=True)
class _Method:
    handle: "EndpointHandle"
    name: str

    def remote(self, *args, **kwargs):
        """An ``ObjectRef`` of the call's result (as an actor method's ``.remote``); ``__ray_ready__``
        asks the actor itself (it answers while a send or a training step runs on another thread)."""
        if self.name == "__ray_ready__":
            return self.handle.actor.__ray_ready__.remote()
        return self.handle.actor.__ray_call__.remote(_dispatch, self.handle.endpoint_id, self.name, *args, **kwargs)


@dataclass(frozen=True, slots=True)
class EndpointHandle:
    """What the coordinator needs to reach one rank's endpoint; pass it to ``WeightSync(trainers=...)``.

    Attributes:
        actor: the Ray actor the training rank runs in.
        endpoint_id: the endpoint's id in that process.
        rank: the rank's index in weightsync's group (its sender index: give the handles in rank order).
        world: the group size.
    """

    actor: Any
    endpoint_id: str
    rank: int
    world: int

    _METHODS = frozenset({"owned_metas", "open_transport", "close_transport", "snapshot", "send", "drop_snapshot",
                          "factor_costs", "factor_recipes", "factor_delta", "factor_committed", "factor_forget",
                          "__ray_ready__"})

    def __getattr__(self, name: str) -> _Method:
        if name not in EndpointHandle._METHODS:
            raise AttributeError(f"a trainer endpoint has no method {name!r}")
        return _Method(self, name)
