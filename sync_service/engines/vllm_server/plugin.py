"""vLLM plugin entry point (``[project.entry-points."vllm.general_plugins"]`` in ``pyproject.toml``).

vLLM calls ``register`` in each of its processes before it builds an engine; it makes the backend
name ``weightsync`` known to ``WeightTransferEngineFactory`` (lazily: the backend module is
imported only by a server started with that backend).
"""

from __future__ import annotations

from sync_service.engines.vllm_server.wire import BACKEND

__all__ = ["register"]


def register() -> None:
    """Register the ``weightsync`` weight-transfer backend (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "sync_service.engines.vllm_server.backend",
                                                    "WeightsyncTransferEngine")
    except ValueError:
        pass  # already registered in this process
