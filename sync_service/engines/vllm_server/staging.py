"""``WorkerEngine``: the ``EngineAdapter`` a vLLM server's worker applies received buckets to.

It is the in-process vLLM engine's receive logic, called directly instead of through
``collective_rpc``: ``WorkerSync`` (``engines/vllm/worker.py``: checkpoint-format staging in the
``CheckpointStore``, the closure of touched vLLM modules, layerwise reload with post-load processing
once per sync) in the checkpoint (``hf``) naming, wrapped by ``FusedVLLMEngine``'s table and box
cutting (``engines/vllm/fused.py``) for the trainers' hf-fused naming. Nothing here knows a layout.

The prefix cache lives in vLLM's scheduler, not in the worker: the coordinator-side handle resets
it over HTTP after every commit and abort (``engine.VLLMServerEngine``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protocols.interfaces import FinishReport
from protocols.params import Box, ParamMeta
from sync_service.dtypes import wire_dtype
from sync_service.engines.vllm.fused import FusedVLLMEngine
from sync_service.engines.vllm.worker import WorkerSync

__all__ = ["WorkerEngine", "fused_worker_engine"]


class WorkerEngine:
    """``EngineAdapter`` in checkpoint naming over one worker's ``WorkerSync``.

    Args:
        sync: the worker's update state (built on the loaded vLLM model).

    Raises (``apply``): ``ValueError`` for data whose dtype is not the engine's (a cast would hide a
    plan mismatch); the rest as ``WorkerSync`` / ``CheckpointStore``.
    """

    def __init__(self, sync: WorkerSync) -> None:
        self._sync = sync
        self._metas = tuple(ParamMeta(n, d, tuple(s)) for n, d, s in sync.table())
        self._dtypes = {m.name: m.dtype for m in self._metas}
        self._version: int | None = None

    def param_metas(self) -> Sequence[ParamMeta]:
        return self._metas

    def weight_version(self) -> int | None:
        return self._version

    def begin_update(self, version: int, names: Sequence[str]) -> None:
        self._sync.begin(version, names)

    def apply(self, name: str, box: Box, data: torch.Tensor) -> None:
        want = self._dtypes.get(name)
        if want is not None and wire_dtype(data.dtype) != want:
            raise ValueError(f"data for {name!r} is {data.dtype}, the server holds {want}; cast on the trainer side")
        self._sync.apply(name, box, data)

    def finish_update(self) -> FinishReport:
        return FinishReport(**self._sync.finish())

    def commit(self, version: int) -> None:
        self._sync.commit(version)
        self._version = version

    def abort(self) -> None:
        self._sync.abort()

    def reset_caches(self) -> None:
        """Nothing in the worker: the prefix cache is the scheduler's (reset over HTTP by the handle)."""


def fused_worker_engine(model: torch.nn.Module, model_config: object) -> FusedVLLMEngine:
    """The hf-fused adapter over a worker's model (``model_config.model``: the checkpoint dir it loaded)."""
    return FusedVLLMEngine(WorkerEngine(WorkerSync(model, model_config)), str(model_config.model))
