"""Reload a set of vLLM modules from checkpoint-format tensors, post-load processing included.

Uses vLLM's layerwise reload (``vllm.model_executor.model_loader.reload``; see
https://docs.vllm.ai/en/latest/training/layerwise/): each module is put back into its checkpoint
layout on ``meta``, the model's own ``load_weights`` routes the tensors (stacking q/k/v, experts into
``w13``/``w2``), and as soon as a module has all its elements its ``process_weights_after_loading``
runs and the processed values are copied into the original parameter storage (kernel handles are
rebuilt on the module). Only the given modules are rewired; the rest of the model is not touched.

One gap is closed here. In vLLM 0.32 ``UnquantizedFusedMoEMethod._setup_kernel`` treats any call
after the first as a weight update and skips the experts' own post-load step, which on CPU is the
grouped-GEMM prepack of ``w13_weight`` / ``w2_weight`` (``CPUUnquantizedExperts``): the reloaded
experts would be read in the wrong layout. ``_forget_moe_kernel`` clears the method's ``moe_kernel``
so the reload takes the first-load path, exactly as a freshly started engine does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = ["reload_modules"]


def _forget_moe_kernel(module: torch.nn.Module) -> None:
    for sub in module.modules():
        method = getattr(sub, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel = None


@torch.no_grad()
def reload_modules(
    model: torch.nn.Module,
    model_config: object,
    module_names: Sequence[str],
    weights: Iterable[tuple[str, torch.Tensor]],
) -> set[str]:
    """Load ``weights`` (checkpoint names) into ``module_names`` and re-run their post-load processing.

    ``weights`` must hold every checkpoint tensor of every listed module (``layer_map``); a module
    left incomplete is processed with what arrived and logged by vLLM. Blocks; runs in the worker.

    Returns:
        The vLLM parameter names ``load_weights`` reports as loaded.
    """
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    modules = [model.get_submodule(name) for name in module_names]
    for module in modules:
        _forget_moe_kernel(module)
        initialize_layerwise_reload(module)
    try:
        loaded = model.load_weights(weights)
    finally:
        for module in modules:
            finalize_layerwise_reload(module, model_config)
    return set(loaded or ())
