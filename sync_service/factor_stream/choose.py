"""Per tensor: stream it merged or as factors (``SyncConfig.mode``: ``merged`` | ``factors`` | ``auto``).

Costs per weight version of one LoRA-targeted tensor T (bytes):

    merged:  numel(T) · itemsize(T)                        every version
    factors: Σ_terms (n_rows + n_cols) · r · n_e · 4         every version (fp32 factors)
             + numel(T) · itemsize(T) resident on the receiver (the pristine W0), once

``auto`` takes the eligible tensors with the largest saving per resident byte first while the saving
is at least ``min_saving``× and the resident bytes fit ``factor_memory_bytes``. Not eligible (always
merged): modules_to_save replacements, DoRA (not additive), trainable token rows (replaced, not
added), a merged dtype other than the base dtype, tensors without LoRA terms.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from protocols.endpoints import FactorCost as TargetCost  # the cost a trainer endpoint reports

MODES = ("merged", "factors", "auto")
log = logging.getLogger("weightsync.factors")


@dataclass(kw_only=True, slots=True)
class FactorPolicy:
    """How a WeightSync chooses between merged and factor streaming."""

    mode: str = "merged"
    """``"merged"`` (merge on the trainer), ``"factors"`` (every eligible LoRA target as factors),
    ``"auto"`` (per tensor, from bytes moved and ``factor_memory_bytes``)."""
    factor_memory_bytes: int | None = None
    """Receiver budget for resident pristine base copies, bytes; ``None``: no limit. ``factors``
    raises when the eligible targets need more; ``auto`` stays within it."""
    experts_per_recipe: int = 8
    """Experts per recipe block: the granularity of a factor delta (only changed blocks move)."""
    min_saving: float = 2.0
    """``auto``: stream a tensor as factors only if merged bytes >= this × factor bytes."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}; use one of {MODES}")
        if self.factor_memory_bytes is not None and self.factor_memory_bytes < 0:
            raise ValueError(f"factor_memory_bytes={self.factor_memory_bytes} must be >= 0 or None")
        if self.experts_per_recipe < 1:
            raise ValueError(f"experts_per_recipe={self.experts_per_recipe} must be >= 1")


@dataclass(frozen=True, slots=True)
class FactorChoice:
    """The per-tensor decision. ``factors``: names streamed as factors; the rest of the changed set
    is streamed merged. Byte counts are per delta version (after the first full sync)."""

    mode: str
    factors: frozenset[str]
    merged_bytes_per_version: int
    factor_bytes_per_version: int
    pristine_bytes: int
    reasons: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        return (f"factor streaming mode={self.mode}: {len(self.factors)} tensor(s) as factors, "
                f"{len(self.reasons) - len(self.factors)} merged; per version {self.factor_bytes_per_version} B "
                f"(all merged: {self.merged_bytes_per_version} B); receiver resident pristine {self.pristine_bytes} B")


def choose(costs: list[TargetCost], policy: FactorPolicy) -> FactorChoice:
    """Decide per tensor; logs one line (logger ``weightsync.factors``).

    Raises:
        ValueError: ``mode="factors"`` and the eligible tensors need more resident bytes than
            ``factor_memory_bytes`` (the message gives both; use ``auto`` or raise the budget).
    """
    reasons = {c.name: c.why_not or "merged" for c in costs}
    eligible = [c for c in costs if not c.why_not]
    budget = policy.factor_memory_bytes
    picked: list[TargetCost] = []
    if policy.mode == "factors":
        picked = eligible
        need = sum(c.pristine_bytes for c in picked)
        if budget is not None and need > budget:
            raise ValueError(f"mode='factors' needs {need} bytes of resident pristine base on every receiver, "
                             f"factor_memory_bytes={budget}; raise the budget or use mode='auto'")
    elif policy.mode == "auto":
        used = 0
        ranked = sorted(eligible, key=lambda c: -(c.merged_bytes - c.factor_bytes) / max(c.pristine_bytes, 1))
        for c in ranked:
            if c.merged_bytes < policy.min_saving * c.factor_bytes:
                reasons[c.name] = f"merged: factors save < {policy.min_saving}x"
            elif budget is not None and used + c.pristine_bytes > budget:
                reasons[c.name] = "merged: receiver memory budget"
            else:
                picked.append(c)
                used += c.pristine_bytes
    for c in picked:
        reasons[c.name] = "factors"
    names = frozenset(c.name for c in picked)
    choice = FactorChoice(
        mode=policy.mode, factors=names,
        merged_bytes_per_version=sum(c.merged_bytes for c in costs),
        factor_bytes_per_version=sum(c.factor_bytes if c.name in names else c.merged_bytes for c in costs),
        pristine_bytes=sum(c.pristine_bytes for c in picked), reasons=reasons)
    log.info(choice.summary())
    return choice
