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
from protocols.params import Box, ParamMeta, box_numel
from sync_service.dtypes import wire_dtype
from sync_service.engines.commit_gate import CommitGate
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
        self._finished = False
        self._applied: dict[str, int] = {}
        self.commit_gate = CommitGate("vLLM server worker")
        """The server's version fence, update tokens and pre-commit checks (``engines.commit_gate``): the
        server's own authority, whichever handle or ``WeightSync`` talks to it. ``extra["sync"]``: the
        worker's ``WorkerSync`` (its checkpoint store holds what the server will serve)."""

    def param_metas(self) -> Sequence[ParamMeta]:
        return self._metas

    def weight_version(self) -> int | None:
        return self._version

    def record_applied(self, on: bool) -> None:
        """The served check (``engines.served_check``): the worker's store records what each apply hands it."""
        self._sync.store.record_applied(on)

    def served_digests(self, names: Sequence[str] | None = None, values: bool = False) -> tuple[int | None, list[list]]:
        """``(version, rows)`` of what the worker serves (``WorkerSync.served``)."""
        return self._version, self._sync.served(names, values)

    def begin_update(self, version: int, names: Sequence[str], *, reset_versions: bool = False) -> str:
        """Returns the update token (``CommitGate.begin``; raises its refusals, nothing staged)."""
        update_id = self.commit_gate.begin_staged(version, lambda: self._sync.begin(version, names), reset_versions=reset_versions)
        self._finished, self._applied = False, dict.fromkeys(names, 0)
        return update_id

    def apply(self, name: str, box: Box, data: torch.Tensor) -> None:
        want = self._dtypes.get(name)
        if want is not None and wire_dtype(data.dtype) != want:
            raise ValueError(f"data for {name!r} is {data.dtype}, the server holds {want}; cast on the trainer side")
        self._sync.apply(name, box, data)
        if name in self._applied:
            self._applied[name] += box_numel(box)

    def finish_update(self) -> FinishReport:
        report = FinishReport(**self._sync.finish())
        self.commit_gate.vote(self.abort, list(self._applied), self._applied, extra={"sync": self._sync})
        self._finished = True
        return report

    def commit(self, version: int, update_id: str | None = None) -> None:
        """Raises CommitRefused as ``CommitGate.admit_commit`` (a refusal of its own update drops it)."""
        self.commit_gate.admit_commit(version, update_id, finished=self._finished, abort=self.abort)
        self._sync.commit(version)
        self._version, self._finished = version, False
        self.commit_gate.committed(version)

    def abort(self, update_id: str | None = None) -> bool:
        """Drop the update whose token is ``update_id`` (``None``: whatever is staged), reloading the served
        values; another update's token does nothing. Returns whether one was dropped."""
        if not self.commit_gate.owns(update_id):
            return False
        try:
            self._sync.abort()
        finally:
            self._finished = False
            self.commit_gate.dropped(update_id)
        return True

    def reset_caches(self) -> None:
        """Nothing in the worker: the prefix cache is the scheduler's (reset over HTTP by the handle)."""


def fused_worker_engine(model: torch.nn.Module, model_config: object) -> FusedVLLMEngine:
    """The hf-fused adapter over a worker's model (``model_config.model``: the checkpoint dir it loaded)."""
    return FusedVLLMEngine(WorkerEngine(WorkerSync(model, model_config)), str(model_config.model))
