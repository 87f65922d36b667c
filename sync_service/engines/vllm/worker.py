"""The receive side inside each vLLM worker process: a ``worker_extension_cls`` plus its state.

vLLM mixes ``WeightSyncExtension`` into its worker class (``LLM(worker_extension_cls=...)``); the
driver-side ``VLLMEngine`` calls the ``ws_*`` methods through ``LLM.collective_rpc`` (in the same
process when vLLM runs without multiprocessing, else over vLLM's msgpack RPC; arguments are names,
boxes, ints and tensors only). All state lives in one ``WorkerSync`` per worker.

Per sync: ``ws_begin`` → ``ws_apply`` × n (staging only; the served weights are untouched, so
generation may go on) → ``ws_finish`` (closure over vLLM modules, reload + post-load processing of
exactly those modules, once) → ``ws_commit`` — or ``ws_abort`` at any point, which reloads the
previous values into any module ``ws_finish`` already rewrote.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from protocols.params import Box
from sync_service.dtypes import torch_dtype, wire_dtype
from sync_service.engines.vllm.layer_map import names_by_module, owner_modules
from sync_service.engines.vllm.reload import reload_modules
from sync_service.engines.vllm.served import served_rows
from sync_service.engines.vllm.store import CheckpointStore

__all__ = ["WORKER_EXTENSION", "WeightSyncExtension", "WorkerSync", "tensor_from_payload", "tensor_payload"]

WORKER_EXTENSION = f"{__name__}.WeightSyncExtension"
"""Qualified name to pass as ``worker_extension_cls``."""


def tensor_payload(data: torch.Tensor) -> tuple[str, list[int], bytes]:
    """``(wire dtype, shape, raw little-endian bytes)`` of a CPU tensor, for RPCs that do not carry tensors."""
    flat = data.detach().contiguous().reshape(-1)
    return wire_dtype(data.dtype), list(data.shape), flat.view(torch.uint8).numpy().tobytes()


def tensor_from_payload(payload: object) -> torch.Tensor:
    """A tensor, or a ``tensor_payload`` triple turned back into a tensor (a copy; nothing unpickled).

    Raises:
        ValueError: the triple's dtype is unknown or its byte count does not match the shape.
    """
    if isinstance(payload, torch.Tensor):
        return payload
    dtype_name, shape, raw = payload
    dtype = torch_dtype(dtype_name)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if flat.numel() != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"payload of {flat.numel()} bytes does not hold {dtype_name}{list(shape)}")
    return flat.view(dtype).reshape(tuple(shape))


class WorkerSync:
    """Update state of one worker: the checkpoint store and the name → module grouping.

    Args:
        model: the worker's vLLM model (``worker.model_runner.model``).
        model_config: vLLM ``ModelConfig`` (``model`` is the checkpoint dir, ``dtype`` the param dtype).
    """

    def __init__(self, model: torch.nn.Module, model_config: object) -> None:
        self._model = model
        self._model_config = model_config
        self.store = CheckpointStore(model_config.model, model_config.dtype)
        owners = owner_modules(model, self.store.metas())
        self._owners = {n: ms for n, ms in owners.items() if ms}
        self._names_of = names_by_module(self._owners)
        self._table = self.store.metas(self._owners)
        self._known = frozenset(self._owners)
        self._pending: int | None = None
        self._rewritten: tuple[str, ...] = ()  # modules holding uncommitted values

    def table(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """``(name, wire dtype, shape)`` per checkpoint tensor the model loads, in layer order."""
        return [(m.name, m.dtype, m.shape) for m in self._table]

    def served(self, names: Sequence[str] | None = None, values: bool = False) -> list[list]:
        """Digests of what the worker serves now (``served.served_rows``: vLLM's parameters as held, checkpoint
        copies for opaque ones, sorted by name).

        Raises:
            RuntimeError: an update was finished and not yet committed or aborted (the modules hold values
                no version was committed for).
            KeyError: a name of ``names`` is not served here.
        """
        if self._rewritten:
            raise RuntimeError(f"served_weights during update {self._pending} (finished, not committed); "
                               f"read back after commit or abort")
        return served_rows(self._model, self._names_of, lambda ns: self.store.values(ns, staged=False),
                           self._model_config.dtype, names, values)

    def begin(self, version: int, names: Sequence[str]) -> None:
        if self._pending is not None:
            raise RuntimeError(f"begin_update({version}) while version {self._pending} is in progress; commit or abort it first")
        self.store.begin(names, self._known)
        self._pending = version

    def apply(self, name: str, box: Box, data: torch.Tensor) -> None:
        if self._pending is None:
            raise RuntimeError(f"apply({name!r}) without begin_update")
        self.store.apply(name, tuple(tuple(d) for d in box), tensor_from_payload(data))

    def finish(self) -> dict:
        """Reload every module a staged name feeds; returns ``{"modules", "tensors", "seconds"}`` (modules
        reloaded, tensors the sync staged, seconds) — the fields of ``protocols.interfaces.FinishReport``.

        Raises:
            RuntimeError: no update in progress, or already finished.
            ValueError: a staged tensor was not covered completely (nothing is reloaded).
        """
        if self._pending is None or self._rewritten:
            raise RuntimeError("finish_update needs exactly one begin_update before it")
        self.store.check_complete()
        t0 = time.perf_counter()
        staged = self.store.staged_names()
        modules = self._closure(staged)
        names = {n for m in modules for n in self._names_of[m]}
        self._rewritten = modules
        self._reload(modules, names, staged=True)
        return {"modules": len(modules), "tensors": len(staged), "seconds": time.perf_counter() - t0}

    def commit(self, version: int) -> None:
        if self._pending != version:
            raise RuntimeError(f"commit({version}) but the update in progress is {self._pending}")
        if self.store.staged_names() and not self._rewritten:
            raise RuntimeError(f"commit({version}) before finish_update")
        self.store.commit()
        self._pending, self._rewritten = None, ()

    def abort(self) -> bool:
        """Drop staging; reload the committed values into rewritten modules. Returns whether any were."""
        rewritten = self._rewritten
        self.store.drop()
        self._pending, self._rewritten = None, ()
        if rewritten:
            names = {n for m in rewritten for n in self._names_of[m]}
            self._reload(rewritten, names, staged=False)
        return bool(rewritten)

    # -- internals -------------------------------------------------------------------------
    def _closure(self, names: Sequence[str]) -> tuple[str, ...]:
        """Modules fed by ``names``, plus modules sharing a name with those (to a fixed point)."""
        modules: set[str] = set()
        todo = list(names)
        seen: set[str] = set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            for module in self._owners[name]:
                if module not in modules:
                    modules.add(module)
                    todo.extend(self._names_of[module])
        return tuple(sorted(modules))

    def _reload(self, modules: tuple[str, ...], names: set[str], *, staged: bool) -> None:
        loaded = reload_modules(self._model, self._model_config, modules, self.store.values(names, staged=staged))
        missing = [m for m in modules if not any(p.startswith(m + ".") for p in loaded)]
        if missing:
            raise RuntimeError(f"vLLM's load_weights loaded nothing into modules {missing[:5]}; the engine is inconsistent")


class WeightSyncExtension:
    """Mixed into vLLM's worker class; exposes ``WorkerSync`` to ``collective_rpc``.

    ``self`` is the vLLM worker: ``self.model_runner.model``, ``self.vllm_config``.
    """

    def ws_init(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """Build the update state (idempotent); returns the parameter table."""
        if getattr(self, "_weightsync", None) is None:
            self._weightsync = WorkerSync(self.model_runner.model, self.vllm_config.model_config)
        return self._weightsync.table()

    def ws_served(self, names: Sequence[str] | None = None, values: bool = False) -> list[list]:
        return self._weightsync.served(names, values)

    def ws_record_applied(self, on: bool) -> None:
        self._weightsync.store.record_applied(on)

    def ws_staged_problems(self) -> list[str]:
        return self._weightsync.store.staged_problems()

    def ws_begin(self, version: int, names: Sequence[str]) -> None:
        self._weightsync.begin(version, names)

    def ws_apply(self, name: str, box: Box, data: torch.Tensor) -> None:
        self._weightsync.apply(name, box, data)

    def ws_finish(self) -> dict:
        return self._weightsync.finish()

    def ws_commit(self, version: int) -> None:
        self._weightsync.commit(version)

    def ws_abort(self) -> bool:
        return self._weightsync.abort()
