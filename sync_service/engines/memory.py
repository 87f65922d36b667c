"""An in-memory engine: a dict of CPU tensors with staged apply and atomic commit.

A real ``EngineAdapter`` (used by tests and benchmarks) that behaves as the transformers engine does:
``apply`` copies into a staging buffer per tensor (``engines.staging.Staging``: allocated once, reused
every sync; never pre-filled from the served values, so a sync must cover every element of every
tensor it announces, or ``finish_update`` refuses it); ``commit`` swaps staged and served buffers under
a lock, so readers see either the old or the new version, never a mix. ``abort`` drops the staged state.
Block FP8 (``from_fp8_checkpoint``): FP8 values and their scales (float32 or ue8m0) are tensors like any other,
under the table rule of ``sync_service.fp8``; the engine computes nothing, so it keeps no dequantized copy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from protocols.interfaces import FinishReport
from protocols.params import Box, ParamMeta
from sync_service.dtypes import wire_dtype
from sync_service.engines.commit_gate import CommitGate
from sync_service.engines.staging import APPLY_CHUNK_BYTES, Staging


class MemoryEngine:
    """``EngineAdapter`` over ``tensors`` (name → CPU tensor; the engine owns private copies).

    Raises:
        ValueError: a tensor's dtype has no wire name.
    """

    apply_chunk_bytes = APPLY_CHUNK_BYTES
    """``protocols.interfaces.ChunkedApply``: checksums are checked while copying into staging."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._metas = [ParamMeta(n, wire_dtype(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
        self._served = {n: t.detach().clone(memory_format=torch.contiguous_format) for n, t in tensors.items()}
        self._staging = Staging(lambda n: torch.empty_like(self._served[n]), "MemoryEngine")
        self._finished = False
        self._version: int | None = None
        self._lock = threading.Lock()
        self.commit_gate = CommitGate("MemoryEngine")
        """The engine's version fence, update tokens and pre-commit checks (``engines.commit_gate``)."""

    @classmethod
    def from_fp8_checkpoint(cls, path: str | Path) -> "MemoryEngine":
        """Every tensor of a block-FP8 checkpoint in hf-fused naming: FP8 values, their scales, the rest as stored
        (``merge.fp8_checkpoint.read_fp8_checkpoint``; raises its ``MergeError``)."""
        from sync_service.merge.fp8_checkpoint import read_fp8_checkpoint

        return cls(read_fp8_checkpoint(path)[0])

    def param_metas(self) -> Sequence[ParamMeta]:
        return list(self._metas)

    def weight_version(self) -> int | None:
        return self._version

    def begin_update(self, version: int, names: Sequence[str], *, reset_versions: bool = False) -> str:
        """Returns the update token (``CommitGate.begin``). Raises KeyError (unknown name),
        UpdateInProgressError (an update is in progress), VersionFenceError (not above the served version)."""
        unknown = set(names) - set(self._served)
        if unknown:
            raise KeyError(f"begin_update: unknown parameters {sorted(unknown)[:5]}; the engine has {len(self._served)}")
        update_id = self.commit_gate.begin_staged(version, lambda: self._staging.begin(version, names), reset_versions=reset_versions)
        self._finished = False
        return update_id

    def reserve_staging(self, names: Sequence[str]) -> int:
        """Allocate and touch the staging buffers of ``names`` (``Staging.reserve``; unknown names are
        skipped). Returns bytes allocated."""
        return self._staging.reserve([n for n in names if n in self._served])

    def release_staging(self) -> int:
        """Free the staging buffers kept for the next sync (``Staging.release``). Returns the bytes freed."""
        return self._staging.release()

    def apply(self, name: str, box: Box, data: torch.Tensor) -> None:
        """Raises as ``Staging.apply``."""
        self._staging.apply(name, box, data)

    def staged_buffer(self, name: str) -> torch.Tensor:
        """The staging buffer ``apply`` copies ``name``'s boxes into in this sync (the served check reads the boxes
        there as they land, ``engines.served_check``). Raises KeyError: ``name`` is not staged."""
        return self._staging.buffer(name)

    def finish_update(self) -> FinishReport:
        """Raises ValueError (a tensor covered incompletely), RuntimeError (no update, or finished already)."""
        t0 = time.perf_counter()
        if self._staging.version is None or self._finished:
            raise RuntimeError("finish_update needs exactly one begin_update before it")
        self._staging.check_complete()
        self.commit_gate.vote(self.abort, self._staging.names(), self._staging.applied(),
                              values=lambda: {n: self._staging.buffer(n) for n in self._staging.names()})
        self._finished = True
        return FinishReport(tensors=len(self._staging.names()), modules=0, seconds=time.perf_counter() - t0)

    def commit(self, version: int, update_id: str | None = None) -> None:
        """Raises CommitRefused (a RuntimeError) as ``CommitGate.admit_commit``: another update's token
        (nothing changes), or this update not begun as ``version``, not finished, or not above the served
        version (it is dropped then; the served version stays)."""
        self.commit_gate.admit_commit(version, update_id, finished=self._finished, abort=self.abort)
        with self._lock:
            for name, staged in self._staging.take().items():
                self._staging.keep_spare(name, self._served[name])
                self._served[name] = staged
            self._version = version
            self.commit_gate.committed(version)
        self._finished = False

    def abort(self, update_id: str | None = None) -> bool:
        """Drop the staged update if ``update_id`` is its token (``None``: whatever is staged); returns
        whether one was dropped. Idempotent."""
        if not self.commit_gate.owns(update_id):
            return False
        self._staging.drop()
        self._finished = False
        return self.commit_gate.dropped(update_id)

    def reset_caches(self) -> None:
        pass  # no caches

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the served tensors: a consistent snapshot of one version (allocates)."""
        return self.served()[1]

    def served(self, names: Sequence[str] | None = None) -> tuple[int | None, dict[str, torch.Tensor]]:
        """``(version, copies of the tensors)`` of one committed version (``names`` only, when given;
        unknown ones are skipped), read together under the commit lock (the served buffers are reused as
        staging two syncs later, so they are copied)."""
        with self._lock:
            keep = self._served if names is None else {n: self._served[n] for n in names if n in self._served}
            return self._version, {n: t.clone() for n, t in keep.items()}
