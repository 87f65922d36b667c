"""Which vLLM module each checkpoint tensor loads into, found by vLLM's own loader.

vLLM maps checkpoint names to its fused parameters inside each model's ``load_weights``
(``WeightsMapper`` tables, ``stacked_params_mapping``: ``q/k/v_proj`` → ``qkv_proj``,
``expert_params_mapping``: ``experts.N.gate_proj`` → ``w13_weight`` rows of expert N, ...). Rather
than copying those tables, ``owner_modules`` asks the model: it points every parameter's
``weight_loader`` at a recorder (the same hook vLLM's layerwise reload rewires), feeds each name
once as a ``meta`` tensor (no memory, no copy), and records which module's parameter the loader was
called for. The original loaders are restored before it returns.

The result groups checkpoint names by the module whose post-load processing they feed; an update
that touches one name of a group must reload the whole group (see ``reload.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from protocols.params import ParamMeta
from sync_service.dtypes import torch_dtype

__all__ = ["owner_modules", "names_by_module"]

_MISSING = object()


def owner_modules(model: torch.nn.Module, metas: Iterable[ParamMeta]) -> dict[str, tuple[str, ...]]:
    """Checkpoint name → names of the vLLM modules whose parameters it loads into.

    A name the model ignores (e.g. ``rotary_emb.inv_freq``) maps to ``()``.

    Raises:
        ValueError: the model's ``load_weights`` rejects a name (message names it).
    """
    owner_of = {id(p): mod_name for mod_name, mod in model.named_modules() for _, p in mod.named_parameters(recurse=False)}
    params = list({id(p): p for _, p in model.named_parameters(remove_duplicate=False)}.values())
    saved = [(p, p.__dict__.get("weight_loader", _MISSING)) for p in params]
    hits: dict[str, set[str]] = {}
    current = [""]

    def record(param: torch.Tensor, *args: object, **kwargs: object) -> bool:
        hits.setdefault(current[0], set()).add(owner_of[id(param)])
        return True  # FusedMoE callers ask for ``return_success``

    for p in params:
        p.weight_loader = record
    try:
        for meta in metas:
            current[0] = meta.name
            probe = torch.empty(meta.shape, dtype=torch_dtype(meta.dtype), device="meta")
            try:
                model.load_weights([(meta.name, probe)])
            except Exception as e:  # noqa: BLE001 - re-raised with the name
                raise ValueError(f"vLLM's load_weights rejects checkpoint tensor {meta.name!r} {meta.shape}: {e}") from e
    finally:
        for p, loader in saved:
            if loader is _MISSING:
                del p.weight_loader
            else:
                p.weight_loader = loader
    return {m.name: tuple(sorted(hits.get(m.name, ()))) for m in metas}


def names_by_module(owners: Mapping[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """Inverse of ``owner_modules``: module → the checkpoint names that load into it."""
    out: dict[str, list[str]] = {}
    for name, modules in owners.items():
        for module in modules:
            out.setdefault(module, []).append(name)
    return {m: tuple(ns) for m, ns in out.items()}
