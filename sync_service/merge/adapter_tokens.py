"""PEFT trainable tokens (``LoraConfig.trainable_token_indices``) → row overrides of the merge.

PEFT saves ``<module>.token_adapter.trainable_tokens_delta`` [n, H] and merges by
``W.index_copy(0, indices, delta)``: the saved rows replace the base's (PEFT 0.21
``tuners/trainable_tokens/layer.py`` ``merge``), recorded here as ``terms.RowOverride``.
"""

from __future__ import annotations

import torch

from protocols.params import FLOAT_DTYPES
from sync_service.merge.errors import MergeError
from sync_service.merge.finite import all_finite
from sync_service.merge.terms import RowOverride

__all__ = ["TOKENS_DELTA", "add_token_rows", "token_indices"]

TOKENS_DELTA = ".token_adapter.trainable_tokens_delta"  # PEFT TrainableTokensWrapper's saved rows


def token_indices(config, module: str) -> list[int]:
    """The ``trainable_token_indices`` of ``module``: a list names the input embedding; a dict maps a
    layer name to its ids, matched as PEFT's ``_set_trainable`` does (``module.endswith(layer)``)."""
    spec = getattr(config, "trainable_token_indices", None)
    if isinstance(spec, dict):
        matches = [ids for layer, ids in spec.items() if module.endswith(layer)]
        spec = matches[0] if len(matches) == 1 else None
    if not isinstance(spec, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in spec):
        raise MergeError(f"adapter module {module}: holds trainable_tokens_delta but adapter_config "
                         f"trainable_token_indices {getattr(config, 'trainable_token_indices', None)!r} gives no list "
                         f"of token ids for it; save the adapter_config with the indices it was trained with")
    return list(spec)


def add_token_rows(ctx, module: str, t: torch.Tensor) -> None:
    """``<module>.token_adapter.trainable_tokens_delta`` [n, H]: PEFT trainable tokens
    (``trainable_token_indices``), merged as ``W.index_copy(0, indices, delta)`` — the saved rows
    replace the base's (``peft/tuners/trainable_tokens/layer.py`` ``merge``). On a tied pair either
    name writes the one shared tensor, as PEFT's merge does. ``ctx``: the adapter reader
    (``adapter_keys._Ctx``: ``resolve``, ``metas``, ``config``, ``out``, ``refuse_rows_and_copy``).

    Raises:
        MergeError: no base tensor, rows that do not fit, ids out of range or repeated, non-finite rows,
            LoRA on the same tensor, rows trained twice through tied names.
    """
    target = ctx.resolve(module + ".weight")
    if target is None:
        raise MergeError(f"adapter key {module}{TOKENS_DELTA}: trainable_token_indices rows for {module}, which "
                         f"has no base tensor {module}.weight; the adapter was trained on a different model")
    meta = ctx.metas[target]
    if meta.dtype not in FLOAT_DTYPES:
        raise MergeError(f"adapter module {module}: targets base {meta.name} of dtype {meta.dtype}; token rows "
                         f"replace rows of floating-point tensors only — fix trainable_token_indices or the base")
    indices = token_indices(ctx.config, module)
    key = f"{module}{TOKENS_DELTA}"
    if not t.is_floating_point() or t.dim() != 2 or tuple(t.shape) != (len(indices), meta.shape[-1]) or len(meta.shape) != 2:
        raise MergeError(f"adapter key {key}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)} does not fit "
                         f"{len(indices)} trainable_token_indices rows of {target} {list(meta.shape)}; the "
                         f"adapter_config does not describe these weights")
    bad = [i for i in indices if not 0 <= i < meta.shape[0]]
    if bad or len(set(indices)) != len(indices):
        raise MergeError(f"adapter_config trainable_token_indices for {module}: "
                         + (f"ids {bad[:4]} outside [0, {meta.shape[0]})" if bad else "repeated ids")
                         + f" of {target} {list(meta.shape)}; fix trainable_token_indices")
    if not all_finite(t):
        raise MergeError(f"adapter key {key}: holds NaN or Inf values; the adapter is corrupt or training diverged")
    if target in ctx.out.terms or target in ctx.out.dora_magnitudes:
        raise MergeError(f"adapter module {module}: LoRA and trainable_token_indices on the same tensor {target} "
                         f"are not merged here; train the tokens on a module without LoRA, or merge with PEFT")
    ctx.refuse_rows_and_copy(target, rows=True)
    held = ctx.out.row_overrides.setdefault(target, [])
    taken = set().union(*(o.indices.tolist() for o in held)) & set(indices)
    if taken:
        raise MergeError(f"adapter module {module}: trainable_token_indices rows {sorted(taken)[:4]} of {target} are "
                         f"trained twice (tied names); PEFT only merges disjoint token ids — fix trainable_token_indices")
    held.append(RowOverride(torch.tensor(indices, dtype=torch.int64), t))
