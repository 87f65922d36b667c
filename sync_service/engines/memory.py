"""An in-memory engine: a dict of CPU tensors with staged apply and atomic commit.

A real ``EngineAdapter`` (used by tests and benchmarks): ``apply`` copies into a staged buffer per
tensor (allocated once, reused every sync); ``commit`` swaps staged and served buffers under a lock,
so readers see either the old or the new version, never a mix. ``abort`` drops the staged state.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import torch

from protocols.params import Box, ParamMeta, box_shape, full_box
from sync_service.dtypes import TORCH_DTYPES, WIRE_DTYPES


class MemoryEngine:
    """``EngineAdapter`` over ``tensors`` (name → CPU tensor; the engine owns private copies)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        for name, t in tensors.items():
            if t.dtype not in WIRE_DTYPES:
                raise ValueError(f"{name}: dtype {t.dtype} has no wire name; use one of {sorted(TORCH_DTYPES)}")
        self._served = {n: t.detach().clone(memory_format=torch.contiguous_format) for n, t in tensors.items()}
        self._spare: dict[str, torch.Tensor] = {}
        self._staged: dict[str, torch.Tensor] = {}
        self._names: frozenset[str] | None = None
        self._pending: int | None = None
        self._finished = False
        self._version: int | None = None
        self._lock = threading.Lock()
        self.finish_calls = 0

    def param_metas(self) -> Sequence[ParamMeta]:
        return [ParamMeta(n, WIRE_DTYPES[t.dtype], tuple(t.shape)) for n, t in self._served.items()]

    def weight_version(self) -> int | None:
        return self._version

    def begin_update(self, version: int, names: Sequence[str]) -> None:
        unknown = set(names) - set(self._served)
        if unknown:
            raise KeyError(f"begin_update: unknown parameters {sorted(unknown)[:5]}; the engine has {len(self._served)}")
        self.abort()
        self._names, self._pending, self._finished = frozenset(names), version, False

    def apply(self, name: str, box: Box, data: torch.Tensor) -> None:
        if self._names is None or name not in self._names:
            raise KeyError(f"apply({name!r}): not announced in begin_update")
        served = self._served[name]
        if data.dtype != served.dtype or tuple(data.shape) != box_shape(box) or len(box) != served.dim() or any(
                not 0 <= a <= b <= n for (a, b), n in zip(box, served.shape)):
            raise ValueError(f"apply({name!r}): data {data.dtype}{tuple(data.shape)} box {box} does not fit "
                             f"{served.dtype}{tuple(served.shape)}")
        staged = self._staged.get(name)
        if staged is None:
            staged = self._spare.pop(name, None)
            if staged is None:
                staged = torch.empty_like(served)
            if box != full_box(tuple(served.shape)):
                staged.copy_(served)  # keep the parts other boxes do not overwrite
            self._staged[name] = staged
        staged[tuple(slice(a, b) for a, b in box)].copy_(data)

    def finish_update(self) -> None:
        self.finish_calls += 1
        self._finished = True

    def commit(self, version: int) -> None:
        if self._pending != version or not self._finished:
            raise RuntimeError(f"commit({version}): no finished update of that version (pending {self._pending})")
        with self._lock:
            for name, staged in self._staged.items():
                self._spare[name], self._served[name] = self._served[name], staged
            self._version = version
        self._staged, self._names, self._pending = {}, None, None

    def abort(self) -> None:
        for name, staged in self._staged.items():
            self._spare[name] = staged
        self._staged, self._names, self._pending, self._finished = {}, None, None, False

    def reset_caches(self) -> None:
        pass  # no caches

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The served tensors (a consistent snapshot of one version; do not modify)."""
        with self._lock:
            return dict(self._served)
