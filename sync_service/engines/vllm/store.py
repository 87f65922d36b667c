"""Checkpoint-format copies of an engine's weights, kept inside the vLLM worker.

Why a store: vLLM's post-load processing turns checkpoint tensors into kernel layouts and often
drops the originals (on CPU, dense ``weight`` becomes an empty placeholder behind a oneDNN / packed
handle; ``w13_weight`` / ``w2_weight`` are prepacked in place). Re-running the processing for one
vLLM module needs *every* checkpoint tensor that feeds it (``q_proj`` alone cannot rebuild
``qkv_proj``), so the values a sync did not send come from here: the last committed value of a name
a sync has sent, else the checkpoint file the engine was started from (read lazily, never cached).

Per sync: ``begin`` takes one staging buffer per announced name (buffers of earlier syncs are
reused), ``apply`` copies boxes into staging, ``commit`` makes staging the committed copy, ``drop``
discards it. Memory: one staging buffer per name of the running sync, plus one committed copy per
name any sync has sent (a full sync holds a checkpoint-sized copy in host memory).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from protocols.params import Box, ParamMeta
from sync_service.dtypes import wire_dtype
from sync_service.engines.landed import finite
from sync_service.engines.readback import tensor_digest
from sync_service.engines.staging import Staging
from sync_service.merge.base import layer_order_key

__all__ = ["CheckpointStore", "checkpoint_files"]


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name → safetensors file, for a single-file or sharded (``*.index.json``) checkpoint.

    Raises:
        FileNotFoundError: no ``*.safetensors`` file in ``model_dir``.
    """
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors checkpoint in {str(model_dir)!r}; pass the dir the engine was started from")
    out: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


class CheckpointStore:
    """Committed and staged checkpoint-format tensors of one engine (see the module docstring).

    Args:
        model_dir: the checkpoint the engine was started from.
        dtype: the engine's parameter dtype; the table reports it and staging buffers use it.
    """

    def __init__(self, model_dir: str | Path, dtype: torch.dtype) -> None:
        self._files = checkpoint_files(model_dir)
        self._dtype = dtype
        shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(self._files.values())):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        order = sorted(shapes, key=lambda n: (layer_order_key(n), n))
        self._shapes = {n: shapes[n] for n in order}
        self._committed: dict[str, torch.Tensor] = {}
        self._staging = Staging(lambda n: torch.empty(self._shapes[n], dtype=self._dtype), "vLLM engine")
        self._record = False
        self._wrong: dict[str, Box] = {}  # the served check: name -> its first box that landed other than handed
        self._nonfinite: dict[str, None] = {}  # the served check: names whose landed boxes hold NaN / Inf

    # -- table -----------------------------------------------------------------------------
    def metas(self, names: Iterable[str] | None = None) -> list[ParamMeta]:
        """Whole tensors in checkpoint order, engine dtype; restricted to ``names`` when given."""
        keep = None if names is None else set(names)
        return [ParamMeta(n, wire_dtype(self._dtype), s) for n, s in self._shapes.items() if keep is None or n in keep]

    def staged_names(self) -> list[str]:
        return self._staging.names()

    # -- one sync --------------------------------------------------------------------------
    def begin(self, names: Sequence[str], known: frozenset[str]) -> None:
        """Take a staging buffer per name (duplicates ignored).

        Raises:
            KeyError: a name is not in ``known`` (the engine's table); nothing is staged.
        """
        unknown = sorted(set(names) - known)
        if unknown:
            raise KeyError(
                f"names not in the vLLM engine's parameter table (hf naming): {unknown[:5]} ({len(unknown)} in all); "
                "send tensors under the keys save_pretrained writes"
            )
        self.drop()
        self._wrong, self._nonfinite = {}, {}
        self._staging.begin(0, names)  # the engine tracks the version

    def apply(self, name: str, box: Box, data: torch.Tensor) -> None:
        """Copy ``data`` into ``box`` of the staging buffer of ``name``.

        Raises:
            as ``Staging.apply``.
        """
        self._staging.apply(name, box, data)
        if self._record:  # the served check: the box as it landed, right after the copy (engines.served_check)
            landed = self._staging.buffer(name)[tuple(slice(a, b) for a, b in box)]
            if not finite(landed):
                self._nonfinite.setdefault(name)
            if tensor_digest(landed) != tensor_digest(data):
                self._wrong.setdefault(name, tuple(tuple(d) for d in box))

    def record_applied(self, on: bool) -> None:
        """From the next sync on, compare every box ``apply`` copies, as it landed, with the bytes it was handed, and
        read its finiteness there (the served check)."""
        self._record, self._wrong, self._nonfinite = bool(on), {}, {}

    def staged_problems(self) -> list[str]:
        """The served check in the worker: what ``apply`` found as each box landed in the staging — a box holding
        other bytes than it was handed, a tensor holding NaN / Inf. Returns the findings (empty: none), each naming
        the tensor (checkpoint name) and the cause; ``[]`` when not recording. Reads nothing again."""
        out = [f"{name}: box {[list(d) for d in box]} holds other bytes than the trainers sent "
               f"(not applied, or corrupted after the transport's checksum, in the vLLM worker)"
               for name, box in self._wrong.items()]
        return out + [f"{n}: holds NaN/Inf (would be served)" for n in self._nonfinite]

    def check_complete(self) -> None:
        """Raises ``ValueError`` naming the tensors whose applied elements differ from their size."""
        self._staging.check_complete()

    def values(self, names: Iterable[str], *, staged: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` in table order: staged values first (when ``staged``), else committed,
        else the checkpoint file (its own dtype; vLLM's loader casts as on a fresh start)."""
        wanted, staged_names = set(names), set(self._staging.names()) if staged else set()
        for name in self._shapes:
            if name not in wanted:
                continue
            if name in staged_names:
                yield name, self._staging.buffer(name)
            elif name in self._committed:
                yield name, self._committed[name]
            else:
                yield name, self._read_file(name)

    def commit(self) -> None:
        """Staged values become the committed copies; replaced copies are kept as spare buffers."""
        for name, buffer in self._staging.take().items():
            old = self._committed.get(name)
            if old is not None:
                self._staging.keep_spare(name, old)
            self._committed[name] = buffer

    def drop(self) -> None:
        """Discard staging (buffers are kept for the next sync). Idempotent."""
        self._staging.drop()

    # -- internals -------------------------------------------------------------------------
    def _read_file(self, name: str) -> torch.Tensor:
        with safe_open(str(self._files[name]), framework="pt") as f:
            return f.get_tensor(name)
