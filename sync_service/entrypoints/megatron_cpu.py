"""The CPU launcher's patches for Megatron-Core 0.19.2 / Megatron-Bridge 0.6.2 on Python 3.11 without CUDA.

Megatron's forward and its checkpointing assume CUDA and Python >= 3.12; on a CPU machine (the demo,
the tests) these patches let them run. They are the one exception to "no monkey-patching": only the
Megatron demo (``weightsync demo --trainer megatron``) and the test harness (``tests/megatron/``) call
``apply()``; the product code (``sync_service/megatron/``) imports nothing from here and needs none of it
on a GPU machine with Python 3.12 (by construction: not yet measured on one).

Each patch, by name (``PATCHES``), and why:

- ``typing.override``: a Python 3.12 API that ``megatron/training/models/hybrid.py`` imports (through
  ``import megatron.bridge``); set to ``typing_extensions.override`` (the same decorator, back-ported).
- ``transformer_engine`` stub: ``megatron/bridge/peft/lora_layers.py`` imports ``transformer_engine.pytorch``
  unconditionally and names ``te.ops.Sequential``, ``te.Linear``, ``te.LayerNormLinear`` in annotations and
  ``isinstance`` checks. A stub module with those three as fresh empty classes (no module is an instance
  of them) and ``__version__ = "0.0.0"``; installed only after Megatron-Core's own TE probes ran (it
  finds no TE and uses its local layers).
- ``megatron.bridge.peft.utils.HAVE_TE = False`` (and ``module_matcher``'s): with TE absent it still reads
  True (Megatron-Core's TE names are mock classes when TE is missing), and LoRA then wraps nothing.
- ``torch.cuda.current_device`` → ``torch.device("cpu")``: tensor-parallel layers and the Bridge's TP gathers
  allocate on it.
- ``torch.cuda.synchronize`` → no-op: ``dist_checkpointing.save/load`` call it.
- ``tensor_parallel.random.CudaRNGStatesTracker.fork`` → a null context: the tracker forks CUDA RNG states
  around dropout / init under TP; CPU has none (dropout is 0 in these models; init is the Bridge's load).
- ``schedules total_num_tokens``: Megatron's pipeline schedules (``get_forward_backward_func()``) allocate their
  token counter with ``torch.zeros([], device="cuda")``; the schedules module's ``torch`` becomes a view of
  ``torch`` whose ``zeros`` puts a ``"cuda"`` tensor on the CPU (every other name is ``torch``'s own).

``cpu_provider(provider)`` sets what the local (non-TE) layer spec on CPU needs: no grouped GEMM (TE), the
allgather token dispatcher (alltoall needs ``torch.cuda.Stream``), fusions off, fp32.
"""

from __future__ import annotations

import contextlib
import sys
import types

PATCHES = ("typing.override", "transformer_engine stub", "megatron.bridge.peft HAVE_TE", "torch.cuda.current_device",
           "torch.cuda.synchronize", "CudaRNGStatesTracker.fork", "schedules total_num_tokens")

_applied = False


def apply() -> None:
    """Apply every patch of ``PATCHES`` once (idempotent). Call before importing ``megatron.bridge``."""
    global _applied
    if _applied:
        return
    import typing

    import torch
    import typing_extensions

    if not hasattr(typing, "override"):
        typing.override = typing_extensions.override
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None

    # Megatron-Core's own TE probes run first and find no TE.
    import megatron.core.extensions.transformer_engine  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.tensor_parallel as tp

    if "transformer_engine" not in sys.modules:
        te = types.ModuleType("transformer_engine")
        te.__version__ = "0.0.0"
        te_torch = types.ModuleType("transformer_engine.pytorch")
        te_torch.ops = types.SimpleNamespace(Sequential=type("Sequential", (), {}))
        te_torch.Linear = type("Linear", (), {})
        te_torch.LayerNormLinear = type("LayerNormLinear", (), {})
        te.pytorch = te_torch
        sys.modules["transformer_engine"] = te
        sys.modules["transformer_engine.pytorch"] = te_torch

    tp.random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()

    import megatron.core.pipeline_parallel.schedules as schedules

    schedules.torch = _CpuZeros(torch)

    import megatron.bridge  # noqa: F401
    import megatron.bridge.peft.module_matcher as matcher
    import megatron.bridge.peft.utils as peft_utils

    peft_utils.HAVE_TE = False
    matcher.HAVE_TE = False
    _applied = True


class _CpuZeros(types.ModuleType):
    """``torch`` for Megatron's schedules module: ``zeros(..., device="cuda")`` allocates on the CPU."""

    def __init__(self, torch_module) -> None:
        super().__init__("torch")
        self._torch = torch_module

    def __getattr__(self, name: str):
        return getattr(self._torch, name)

    def zeros(self, *args, device=None, **kw):
        return self._torch.zeros(*args, device="cpu" if str(device).startswith("cuda") else device, **kw)


def cpu_provider(provider, *, tp: int = 1, ep: int = 1, etp: int | None = None, pp: int = 1):
    """Set ``provider`` (a Megatron-Bridge ``GPTModelProvider``) for CPU: local spec, no grouped GEMM, allgather
    dispatcher, fusions off, fp32, and the parallel sizes; returns it."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    provider.tensor_model_parallel_size = tp
    provider.expert_model_parallel_size = ep
    provider.expert_tensor_parallel_size = tp if etp is None else etp
    provider.pipeline_model_parallel_size = pp
    provider.sequence_parallel = False
    provider.moe_grouped_gemm = False
    provider.moe_token_dispatcher_type = "allgather"
    provider.moe_permute_fusion = False
    provider.moe_router_fusion = False
    provider.gradient_accumulation_fusion = False
    provider.bias_activation_fusion = False
    provider.bias_dropout_fusion = False
    provider.masked_softmax_fusion = False
    provider.apply_rope_fusion = False
    provider.persist_layer_norm = False
    provider.cross_entropy_loss_fusion = False
    provider.fp16 = False
    provider.bf16 = False
    provider.params_dtype = torch.float32
    provider.pipeline_dtype = torch.float32
    provider.autocast_dtype = torch.float32
    provider.attention_softmax_in_fp32 = True
    provider.moe_aux_loss_coeff = 0.0
    provider.transformer_layer_spec = lambda config, vp_stage=None: get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm,
        normalization=config.normalization)
    return provider
