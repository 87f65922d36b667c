"""The scaling s of a PEFT LoRA module: ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA), per PEFT's
``rank_pattern`` / ``alpha_pattern``, checked to be a finite float32 scalar."""

from __future__ import annotations

import math

import torch

from sync_service.merge.errors import MergeError


def scaling(config, key: str) -> tuple[int, float]:
    """(r, s) of a PEFT module key, with rank_pattern / alpha_pattern (PEFT ``get_pattern_key``)."""
    from peft.utils.other import get_pattern_key

    r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), key), config.r)
    alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), key), config.lora_alpha)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise MergeError(f"adapter module {key}: r must be a positive int, got {r!r}; fix r / rank_pattern in the adapter_config")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not _finite(alpha):
        raise MergeError(f"adapter module {key}: lora_alpha must be a finite number, got {alpha!r}; "
                         f"fix lora_alpha / alpha_pattern in the adapter_config")
    s = float(alpha) / (math.sqrt(r) if config.use_rslora else r)
    if abs(s) > MAX_SCALING:  # the merge's addmm_(alpha=s) takes a float32 scalar
        rule = f"lora_alpha / sqrt(r) = {float(alpha):g} / sqrt({r})" if config.use_rslora else f"lora_alpha / r = {float(alpha):g} / {r}"
        raise MergeError(f"adapter module {key}: scaling {rule} = {s:g} overflows float32, in which the merge applies "
                         f"it (|scaling| <= {MAX_SCALING:.4g}); fix lora_alpha / alpha_pattern in the adapter_config")
    return r, s


MAX_SCALING = float(torch.finfo(torch.float32).max)
"""Largest |lora_alpha / r| merged: the merge applies it as a float32 scalar (``staging.apply_parts``)."""


def _finite(v: int | float) -> bool:
    """``v`` is a finite number that converts to float (an int past ~1.8e308 does not)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False
