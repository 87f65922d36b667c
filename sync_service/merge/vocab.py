"""A vocabulary resized before training: the adapter's saved embeddings have more (or fewer) rows than the base's.

PEFT's flow for such an adapter (its docs, "Fine-tuning with new tokens"): load the base,
``model.resize_token_embeddings(V')``, load the adapter (``PeftModel.from_pretrained``: the saved
``embed_tokens`` / ``lm_head`` copies of ``save_embedding_layers=True`` or ``modules_to_save`` overwrite
the resized tensors), ``merge_and_unload``. ``weightsync merge`` reproduces it: ``resized_shapes`` finds
the vocabulary tensors the adapter resizes, ``ResizedBase`` reports their new shapes (every value of
them then comes from the adapter's copy), and the written ``config.json`` carries the new
``vocab_size``. Sync paths cannot: the engines hold the base's shapes, so ``check_vocabulary`` refuses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from protocols.params import Box, ParamMeta
from sync_service.merge.errors import MergeError
from sync_service.merge.layouts import FamilyLayout

_PREFIX = "base_model.model."


@dataclasses.dataclass(frozen=True, slots=True)
class Resize:
    """One vocabulary tensor the adapter resizes.

    Attributes:
        name: base tensor (hf-fused naming).
        key: the adapter key that holds its resized copy or factor.
        base_rows: V, the base's rows. rows: V', the adapter's.
        copied: the adapter holds the whole resized tensor (not only LoRA factors of it).
    """

    name: str
    key: str
    base_rows: int
    rows: int
    copied: bool


def _vocab_rows(key: str, shape: Sequence[int]) -> tuple[str, int, bool] | None:
    """``(module or tensor name, vocabulary rows, whole copy)`` of an adapter key that spans the
    vocabulary, else ``None``: a saved copy ``<m>.weight`` / ``<m>.base_layer.weight`` [V', H], an
    embedding factor ``<m>.lora_embedding_A`` [r, V'], an output factor ``<m>.lora_B.weight`` [V', r]."""
    name = key.removeprefix(_PREFIX)
    if name.endswith(".lora_embedding_A") and len(shape) == 2:
        return name.removesuffix(".lora_embedding_A") + ".weight", shape[1], False
    if name.endswith(".lora_B.weight") and len(shape) == 2:
        return name.removesuffix(".lora_B.weight") + ".weight", shape[0], False
    if ".lora_" not in name and ".token_adapter." not in name and name.endswith(".weight") and len(shape) == 2:
        return name.replace(".base_layer.", "."), shape[0], True
    return None


def vocab_names(metas: Sequence[ParamMeta], layout: FamilyLayout) -> list[str]:
    """The base's vocabulary tensors: 2D tensors named like the family's tied pair (``embed_tokens``,
    ``lm_head``: ``layout.tied_alias``)."""
    return [m.name for m in metas if len(m.shape) == 2 and m.name.endswith(layout.tied_alias)]


def resized_shapes(adapter_shapes: Mapping[str, Sequence[int]], metas: Sequence[ParamMeta], layout: FamilyLayout,
                   tied: Mapping[str, str]) -> list[Resize]:
    """Every vocabulary tensor whose row count in the adapter differs from the base's (hidden size equal).

    Args:
        adapter_shapes: PEFT key → shape, as ``adapter_model.safetensors`` holds them.
        tied: tied alias → the base tensor it shares (``lm_head.weight`` → ``model.embed_tokens.weight``).
    """
    by_name = {m.name: m for m in metas}
    vocab = set(vocab_names(metas, layout))
    out = []
    for key, shape in adapter_shapes.items():
        found = _vocab_rows(key, tuple(shape))
        if found is None:
            continue
        name, rows, copied = found
        name = layout.from_disk(name)
        name = tied.get(name, name)
        if name in vocab and rows != by_name[name].shape[0]:
            out.append(Resize(name, key, by_name[name].shape[0], rows, copied))
    return out


def check_vocabulary(adapter_shapes: Mapping[str, Sequence[int]], metas: Sequence[ParamMeta], layout: FamilyLayout,
                     tied: Mapping[str, str]) -> None:
    """Refuse an adapter trained on a resized vocabulary where the receivers hold the base's shapes (sync).

    Raises:
        MergeError: one line naming the tensor, both vocabulary sizes and the fix.
    """
    for r in resized_shapes(adapter_shapes, metas, layout, tied):
        raise MergeError(
            f"adapter key {r.key}: {r.name} has a vocabulary of {r.rows} rows in the adapter and {r.base_rows} in "
            f"the base (resize_token_embeddings before training); engines hold the base's shapes — merge with "
            f"`weightsync merge` (it resizes as PEFT does) and start the engines from the merged checkpoint")


def plan_resize(adapter_shapes: Mapping[str, Sequence[int]], metas: Sequence[ParamMeta], layout: FamilyLayout,
                tied: Mapping[str, str]) -> dict[str, tuple[int, ...]]:
    """Base name → new shape of every vocabulary tensor for a merge of this adapter (empty: no resize).

    PEFT resizes every vocabulary tensor (``resize_token_embeddings``) and fills the new rows at
    random unless the adapter holds the whole resized tensor, so each must be copied in the adapter.

    Raises:
        MergeError: the adapter's tensors disagree on V', or a vocabulary tensor has no resized copy
            (its new rows would be random in PEFT's merge too).
    """
    resizes = resized_shapes(adapter_shapes, metas, layout, tied)
    if not resizes:
        return {}
    sizes = {r.rows for r in resizes}
    if len(sizes) > 1:
        raise MergeError(f"adapter vocabulary tensors disagree on the vocabulary size ({sorted(sizes)}: "
                         f"{', '.join(f'{r.key} {r.rows}' for r in resizes)}); re-save the adapter from one model")
    (rows,) = sizes
    copied = {r.name for r in resizes if r.copied}
    by_name = {m.name: m for m in metas}
    for name in vocab_names(metas, layout):
        if name not in copied:
            raise MergeError(
                f"the adapter resizes the vocabulary from {by_name[name].shape[0]} to {rows} rows but holds no resized "
                f"copy of {name}, whose new rows PEFT fills at random; save the adapter with "
                f"save_pretrained(..., save_embedding_layers=True) (or modules_to_save=['embed_tokens', 'lm_head'])")
    return {name: (rows, *by_name[name].shape[1:]) for name in vocab_names(metas, layout)}


class ResizedBase:
    """A ``BaseProvider`` whose vocabulary tensors have the adapter's shapes (``plan_resize``).

    Their values all come from the adapter's copies (``LoraAdapter.replacements``), so ``read`` of a
    resized tensor is refused; every other tensor reads through to ``base``.
    """

    def __init__(self, base, shapes: Mapping[str, tuple[int, ...]]):
        self.base = base
        self.shapes = dict(shapes)
        self.layout = getattr(base, "layout", None)
        self.tied_aliases = dict(getattr(base, "tied_aliases", {}) or {})

    def metas(self) -> list[ParamMeta]:
        return [dataclasses.replace(m, shape=self.shapes[m.name]) if m.name in self.shapes else m
                for m in self.base.metas()]

    def read(self, name: str, box: Box) -> torch.Tensor:
        if name in self.shapes:
            raise MergeError(f"{name} is resized to {list(self.shapes[name])} by the adapter, which holds no copy "
                             f"of it; save the adapter with save_embedding_layers=True")
        return self.base.read(name, box)
