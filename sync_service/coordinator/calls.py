"""Calls on endpoint actors (``protocols.endpoints``), bounded, with errors as ``EndpointError``.

Ray wraps an actor's exception in ``RayTaskError`` (a traceback with colour codes) and a dead
actor in ``RayActorError``; the coordinator's callers see neither: ``endpoint_error`` turns each
into an ``EndpointError`` naming the endpoint, the call and the cause in one line
(``EndpointDiedError`` when the actor is gone, saying why as far as known: ``deaths.death_cause``;
``EndpointTimeoutError`` — also a ``TimeoutError`` —
when it did not answer in time or raised a ``TimeoutError`` itself).
"""

from __future__ import annotations

import time
from collections.abc import Sequence


from protocols.endpoints import EndpointError, EndpointTimeoutError, clean_error_text
from sync_service.coordinator.deaths import died_error

__all__ = ["alive", "call_all", "endpoint_error", "settle"]


def endpoint_error(endpoint: str, call: str, exc: BaseException) -> EndpointError:
    """``exc`` (raised by ``ray.get`` on ``endpoint``'s ``call``) as the project's error."""
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError  # Ray only where a Ray call ran
    if isinstance(exc, EndpointError):
        return exc
    if isinstance(exc, RayTaskError):
        cause = exc.cause if isinstance(exc.cause, BaseException) else None
        if isinstance(cause, EndpointError):
            return cause
        text = str(cause) if cause is not None else str(exc)
        kind = EndpointTimeoutError if isinstance(cause, TimeoutError) else EndpointError
        return kind(endpoint, call, type(cause).__name__ if cause is not None else exc.function_name,
                    clean_error_text(text) or type(cause).__name__)
    if isinstance(exc, RayActorError):
        return died_error(exc, endpoint, call)
    if isinstance(exc, (GetTimeoutError, TimeoutError)):
        return EndpointTimeoutError(endpoint, call, "TimeoutError", clean_error_text(str(exc)) or "no answer")
    return EndpointError(endpoint, call, type(exc).__name__, clean_error_text(str(exc)) or type(exc).__name__)


def settle(refs: Sequence, names: Sequence[str], call: str, timeout_s: float) -> tuple[list, list]:
    """Wait for every ref (at most ``timeout_s`` in all); per ref its result or ``None``, and its
    ``EndpointError`` or ``None``. Never raises."""
    import ray
    results: list = [None] * len(refs)
    errors: list[EndpointError | None] = [None] * len(refs)
    end = time.monotonic() + timeout_s
    for i, ref in enumerate(refs):
        try:
            results[i] = ray.get(ref, timeout=max(end - time.monotonic(), 0.01))
        except Exception as exc:  # noqa: BLE001 - every failure becomes the endpoint's error
            errors[i] = endpoint_error(names[i], call, exc)
    return results, errors


def call_all(refs: Sequence, names: Sequence[str], call: str, timeout_s: float) -> list:
    """Results of ``refs`` (one per endpoint in ``names``), waited for at most ``timeout_s``.

    Raises:
        EndpointError: the first endpoint that failed (``EndpointDiedError``, ``EndpointTimeoutError``).
    """
    results, errors = settle(refs, names, call, timeout_s)
    for err in errors:
        if err is not None:
            raise err
    return results


def alive(handles: Sequence, timeout_s: float = 5.0) -> list[bool]:
    """Whether each actor still answers a trivial call (a busy threaded actor still does)."""
    import ray
    from ray.exceptions import RayActorError
    refs = [h.__ray_ready__.remote() for h in handles]
    out = []
    for ref in refs:
        try:
            ray.get(ref, timeout=timeout_s)
            out.append(True)
        except RayActorError:
            out.append(False)
        except Exception:  # noqa: BLE001 - slow but not dead
            out.append(True)
    return out
