"""``FusedVLLMEngine``: a ``VLLMEngine`` presented in the hf-fused naming the trainers produce.

Trainers stream hf-fused tensors (transformers v5 in-memory names: ``mlp.experts.gate_up_proj``
[E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]); ``VLLMEngine`` takes the checkpoint (``hf``) naming
(``mlp.experts.N.gate_proj.weight`` [I, H], ...). This adapter's table is the engine's table read
backwards through the merge core's ``hf`` target table (``sync_service.merge.targets``): each
hf-fused tensor whose ``hf`` pieces are all in the engine's table. Every ``apply(name, box, data)``
is cut into the pieces it meets, each handed on as a view of ``data`` (expert dim dropped, last two
dims swapped where the target says so) — no copy here; the engine copies into its staging.
Everything else (lifecycle, generation) is the wrapped engine's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from protocols.interfaces import FinishReport
from protocols.params import Box, ParamMeta
from sync_service.engines.hf import GenerateResult
from sync_service.engines.staging import check_box
from sync_service.engines.vllm.config import VLLMEngineConfig
from sync_service.engines.vllm.engine import VLLMEngine, VLLMGeneration
from sync_service.merge.base import SafetensorsBase
from sync_service.merge.targets import Piece, target_pieces

__all__ = ["FusedVLLMEngine", "checkpoint_dtype"]


def checkpoint_dtype(model_dir: str | Path) -> str:
    """The dtype of the checkpoint's first tensor (``"float32"``, ``"bfloat16"``, ...), from its headers."""
    return SafetensorsBase(model_dir).metas()[0].dtype


class FusedVLLMEngine:
    """``EngineAdapter`` in hf-fused naming over a ``VLLMEngine`` (see the module docstring).

    Args:
        engine: the wrapped engine (its table in ``hf`` naming).
        model_dir: the checkpoint it started from (read for config + safetensors headers only).

    Raises (``apply`` / ``begin_update``): ``KeyError`` for a name outside the hf-fused table,
    ``ValueError`` for a box outside the tensor or data of the wrong shape / dtype.
    """

    def __init__(self, engine: VLLMEngine, model_dir: str) -> None:
        self.engine = engine
        inner = {m.name: m for m in engine.param_metas()}
        base = SafetensorsBase(model_dir)
        self._pieces: dict[str, list[Piece]] = {}
        metas = []
        for m in base.metas():
            pieces = target_pieces("hf", m.name, m.shape, base.layout)
            if not pieces or any(p.name not in inner for p in pieces):
                continue  # the engine ignores (part of) it
            self._pieces[m.name] = pieces
            metas.append(ParamMeta(m.name, inner[pieces[0].name].dtype, m.shape))
        self._metas = tuple(metas)
        self._announced = 0
        self._by_name = {m.name: m for m in metas}

    @classmethod
    def from_pretrained(cls, model_dir: str, **config: object) -> "FusedVLLMEngine":
        """Start a ``VLLMEngine`` on ``model_dir`` (``VLLMEngineConfig`` fields as keywords) and wrap it.

        ``dtype`` defaults to the checkpoint's (vLLM's ``"auto"`` serves fp32 checkpoints in bf16 on
        CPU, which the trainers' fp32 stream would not match)."""
        config.setdefault("dtype", checkpoint_dtype(model_dir))
        return cls(VLLMEngine(VLLMEngineConfig(model_dir=str(model_dir), **config)), str(model_dir))

    def param_metas(self) -> Sequence[ParamMeta]:
        return self._metas

    def weight_version(self) -> int | None:
        return self.engine.weight_version()

    def served_digests(self, names: Sequence[str] | None = None, values: bool = False) -> tuple[int | None, list[list]]:
        """The wrapped engine's read back (``VLLMEngine.served_digests``: vLLM's names, checkpoint copies)."""
        return self.engine.served_digests(names, values)

    @property
    def commit_gate(self):
        """The wrapped engine's ``CommitGate`` (its version fence, update tokens and pre-commit checks)."""
        return self.engine.commit_gate

    def begin_update(self, version: int, names: Sequence[str], *, reset_versions: bool = False) -> str:
        """The wrapped engine's ``begin_update`` over the pieces of ``names``; returns its update token."""
        unknown = sorted(set(names) - self._by_name.keys())
        if unknown:
            raise KeyError(f"names not in the vLLM engine's hf-fused table: {unknown[:5]} ({len(unknown)} in all)")
        update_id = self.engine.begin_update(version, [p.name for n in names for p in self._pieces[n]],
                                             reset_versions=reset_versions)
        self._announced = len(set(names))
        return update_id

    def apply(self, name: str, box: Box, data: torch.Tensor) -> None:
        meta = self._by_name.get(name)
        if meta is None:
            raise KeyError(f"{name!r} is not in the vLLM engine's hf-fused table")
        check_box(name, box, meta.shape, data)
        for piece in self._pieces[name]:
            sub = tuple((max(a, pa), min(b, pb)) for (a, b), (pa, pb) in zip(box, piece.box))
            if any(a >= b for a, b in sub):
                continue
            values = data[tuple(slice(a - ba, b - ba) for (a, b), (ba, _) in zip(sub, box))]
            rel = tuple((a - pa, b - pa) for (a, b), (pa, _) in zip(sub, piece.box))
            if piece.drop_dim0:
                rel = rel[1:]
            if piece.transpose:
                rel = rel[:-2] + (rel[-1], rel[-2])
            self.engine.apply(piece.name, rel, piece.to_target(values))

    def finish_update(self) -> FinishReport:
        """The engine's report, with ``tensors`` counted in this adapter's (hf-fused) naming."""
        return dataclasses.replace(self.engine.finish_update(), tensors=self._announced)

    def commit(self, version: int, update_id: str | None = None) -> None:
        self.engine.commit(version, update_id)

    def abort(self, update_id: str | None = None) -> bool:
        return self.engine.abort(update_id)

    def reset_caches(self) -> None:
        self.engine.reset_caches()

    def generate(self, prompt_token_ids: Sequence[int], max_new_tokens: int) -> GenerateResult:
        return self.engine.generate(prompt_token_ids, max_new_tokens)

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                       logprobs: bool = True) -> list[VLLMGeneration]:
        return self.engine.generate_batch(prompts, max_new_tokens, logprobs=logprobs)

    def record_applied(self, on: bool) -> None:
        self.engine.record_applied(on)

    def token_logprobs(self, sequences: Sequence[Sequence[int]]) -> tuple[int | None, list[torch.Tensor]]:
        return self.engine.token_logprobs(sequences)

    def shutdown(self) -> None:
        self.engine.shutdown()
