"""``TensorSource``: a ``WeightSource`` over in-memory tensors (no merge). For full-weight
trainers, tests and benchmarks; LoRA trainers use ``sync_service.merge``'s ``MergedSource``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from protocols.params import Box, ParamMeta, box_shape
from sync_service.dtypes import wire_dtype


class TensorSource:
    """Serves ``tensors`` (name → tensor, any strides) whole; ``changed`` names the delta set."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], changed: Iterable[str] | None = None):
        self.tensors = dict(tensors)
        self.changed = frozenset(self.tensors if changed is None else changed)

    def param_metas(self) -> Sequence[ParamMeta]:
        return [ParamMeta(n, wire_dtype(t.dtype), tuple(t.shape)) for n, t in self.tensors.items()]

    def changed_names(self) -> frozenset[str]:
        return self.changed

    def fill(self, name: str, box: Box, out: torch.Tensor) -> None:
        t = self.tensors[name]
        if out.dtype != t.dtype or tuple(out.shape) != box_shape(box):
            raise ValueError(f"fill({name!r}): out {out.dtype}{tuple(out.shape)} != {t.dtype}{box_shape(box)}")
        out.copy_(t[tuple(slice(a, b) for a, b in box)])
