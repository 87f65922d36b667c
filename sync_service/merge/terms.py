"""Low-rank terms of a LoRA adapter in hf-fused coordinates: the types every adapter format reduces to.

Legend: E experts, r rank, s scaling. A term says: on the stored tensor ``name`` (hf-fused naming,
stored orientation), for experts ``[e0, e1)`` (or the whole 2D tensor), add
``s · x[e] @ y[e]`` to the rows ``range(*rows)`` and columns ``range(*cols)``. ``adapter.py`` reads
PEFT adapters into these types; the merge kernel (``source.py``) reads only these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

Sel = tuple[int, int, int]
"""``(start, stop, step)`` of a row or column selection, as ``range`` takes them."""


def sel_len(sel: Sel) -> int:
    return len(range(*sel))


@dataclass(slots=True)
class LoraTerm:
    """One low-rank update ``s · x @ y`` of a stored tensor.

    Attributes:
        experts: ``(e0, e1)`` expert range of a 3D tensor (dim 0), ``None`` for a 2D tensor.
        rows: selection on the stored tensor's second-to-last dim.
        cols: selection on the stored tensor's last dim.
        x: fp32 [n_e, n_rows, r] (3D target) or [n_rows, r] (2D).
        y: fp32 [n_e, r, n_cols] or [r, n_cols].
        scaling: s (α/r, α/√r with rsLoRA, rank_pattern / alpha_pattern applied).
    """

    experts: tuple[int, int] | None
    rows: Sel
    cols: Sel
    x: torch.Tensor
    y: torch.Tensor
    scaling: float

    def clone(self) -> LoraTerm:
        return LoraTerm(self.experts, self.rows, self.cols, self.x.clone(), self.y.clone(), self.scaling)


@dataclass(slots=True)
class RowOverride:
    """Rows written over a 2D tensor's merged values: PEFT trainable tokens
    (``trainable_token_indices``), merged by ``W.index_copy(0, indices, values)``
    (``peft/tuners/trainable_tokens/layer.py`` ``merge``): a replacement of whole rows, not an addition.

    Attributes:
        indices: int64 [n], distinct row ids of the stored tensor.
        values: [n, cols], the adapter's dtype (a view of the state dict normalised); cast once
            to the output dtype when written.
    """

    indices: torch.Tensor
    values: torch.Tensor

    def clone(self) -> RowOverride:
        return RowOverride(self.indices.clone(), self.values.clone())


@dataclass(slots=True)
class LoraAdapter:
    """A normalised adapter over hf-fused base names.

    Attributes:
        terms: base name → low-rank terms to add.
        dora_magnitudes: base name → DoRA magnitude m [out] (fp32): the merged tensor is
            ``m / ‖W + ΔW‖_row · (W + ΔW)`` (2D dense tensors only).
        replacements: base name → trained copy (modules_to_save); replaces the base tensor.
        row_overrides: base name → rows written last, over the merged values (``RowOverride``;
            trainable tokens, disjoint rows when several hit one tensor, e.g. a tied pair).
        untied: tied alias → the base tensor it shares (``{"lm_head.weight": "model.embed_tokens.weight"}``)
            when a modules_to_save copy replaces either of a tied pair: the merged model holds both
            as separate tensors, the replaced one the trained copy, the other the base values, and
            ``tie_word_embeddings`` is false — exactly what PEFT's ``merge_and_unload`` leaves.
        derived: ``(copy, source)`` pairs, in creation order: tensors above that are re-laid-out or
            cast copies of a view ``source`` of the state dict normalised (everything else is a view
            of it). ``refresh()`` re-derives them, so a trainer that writes new values into the same
            state-dict tensors gets an up-to-date adapter without normalising again.
    """

    terms: dict[str, list[LoraTerm]] = field(default_factory=dict)
    dora_magnitudes: dict[str, torch.Tensor] = field(default_factory=dict)
    replacements: dict[str, torch.Tensor] = field(default_factory=dict)
    row_overrides: dict[str, list[RowOverride]] = field(default_factory=dict)
    untied: dict[str, str] = field(default_factory=dict)
    derived: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def refresh(self) -> None:
        """Re-derive every copy from its state-dict source (after the sources changed in place).
        Costs one pass over the copied factor bytes; allocates nothing."""
        for copy, source in self.derived:
            copy.copy_(source)

    def changed_names(self) -> frozenset[str]:
        """Base names whose merged values differ from the base."""
        return (frozenset(self.terms) | frozenset(self.dora_magnitudes) | frozenset(self.replacements)
                | frozenset(self.row_overrides))

    def snapshot(self) -> LoraAdapter:
        """A deep copy of every tensor held, so the trainer may keep updating its factors."""
        return LoraAdapter(
            terms={n: [t.clone() for t in ts] for n, ts in self.terms.items()},
            dora_magnitudes={n: m.clone() for n, m in self.dora_magnitudes.items()},
            replacements={n: r.clone() for n, r in self.replacements.items()},
            row_overrides={n: [o.clone() for o in os] for n, os in self.row_overrides.items()},
            untied=dict(self.untied),
        )
