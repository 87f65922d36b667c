"""Read back what a deployment's engines serve: ``served_weights(engines)`` over their Ray handles.

    from sync_service.coordinator.readback import served_weights
    digests = served_weights(engines)            # {engine name: protocols.readback.ServedWeights}
    digests["e0"].digests()                      # {tensor: {"dtype", "shape", "xxh3_64"}}

Each engine computes its digests itself over the bytes it serves (``RolloutEndpoint.served_weights``);
the calls go out together and run while generation goes on.
"""

from __future__ import annotations

from collections.abc import Sequence

from protocols.readback import ServedWeights
from sync_service import defaults
from sync_service.coordinator.calls import call_all

__all__ = ["served_weights"]


def served_weights(engines: Sequence, names: Sequence[str] | None = None, values: bool = False, *,
                   timeout_s: float = defaults.TIMEOUT_S) -> dict[str, ServedWeights]:
    """Per engine (by its name) its ``ServedWeights`` (``names`` only when given; ``values``: the bytes too).

    Raises:
        EndpointError: an engine failed (a name it does not serve, an engine that cannot read back) or
            did not answer within ``timeout_s``.
    """
    labels = [f"engine {i}" for i in range(len(engines))]
    names = None if names is None else list(names)
    reports = call_all([e.served_weights.remote(names, values) for e in engines], labels, "served_weights",
                       timeout_s)
    return {r.engine: r for r in reports}
