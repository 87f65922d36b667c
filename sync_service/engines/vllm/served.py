"""What a vLLM worker serves, read back: per-tensor digests of its parameters after post-load processing.

Each parameter of the worker's model (vLLM's names: ``qkv_proj.weight``, ``routed_experts.w13_weight``, ...)
is digested as held (``source`` ``"served"``), except where vLLM's CPU build keeps it opaque (``OPAQUE``: a
dense weight replaced by an empty placeholder behind a oneDNN / packed handle; ``w13``/``w2`` prepacked into
the grouped-GEMM layout). For those the digests are of the committed checkpoint-format copies the worker keeps
(``store.CheckpointStore``: the tensors vLLM's post-load processing was run on, checkpoint names, cast to the
engine dtype as vLLM's loader casts; ``"checkpoint-copy"``); an opaque parameter fed by no checkpoint tensor
is reported ``"unreadable"`` — never left out. Digests: ``engines.readback.tensor_digest`` (xxh3_64 of the
bytes as held, C order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from sync_service.engines.readback import chosen, digest_row

__all__ = ["OPAQUE", "Opaque", "opaque_reason", "served_rows"]

_CPU_MOE_MODULE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"
"""vLLM's CPU MoE experts: every class there repacks ``w13``/``w2`` in its post-load processing (but zentorch)."""


def _cpu_prepacked_experts(module: torch.nn.Module) -> bool:
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    return type(experts).__module__ == _CPU_MOE_MODULE and not getattr(experts, "_use_zentorch", False)


@dataclass(frozen=True, slots=True)
class Opaque:
    """One way vLLM keeps a parameter opaque: ``why`` (for messages) and the test on ``(module, leaf name, param)``."""

    why: str
    test: Callable[[torch.nn.Module, str, torch.Tensor], bool]


OPAQUE: tuple[Opaque, ...] = (
    Opaque("emptied by vLLM's CPU GEMM dispatch (oneDNN / packed handle holds the values)",
           lambda module, leaf, p: p.numel() == 0),
    Opaque("prepacked in place by vLLM's CPU MoE experts",
           lambda module, leaf, p: leaf in ("w13_weight", "w2_weight") and _cpu_prepacked_experts(module)),
)
"""The rules, in order; a parameter no rule matches is served as held."""


def opaque_reason(module: torch.nn.Module, leaf: str, param: torch.Tensor) -> str | None:
    """The ``why`` of the first ``OPAQUE`` rule ``param`` (``module``'s parameter ``leaf``) matches, else ``None``."""
    return next((rule.why for rule in OPAQUE if rule.test(module, leaf, param)), None)


def served_rows(model: torch.nn.Module, feeds: Mapping[str, Sequence[str]],
                copies: Callable[[Iterable[str]], Iterable[tuple[str, torch.Tensor]]], dtype: torch.dtype,
                names: Sequence[str] | None = None, values: bool = False) -> list[list]:
    """``[name, wire dtype, shape, xxh3_64, source, bytes | None]`` per tensor the worker serves, sorted by name.

    Args:
        model: the worker's vLLM model. feeds: vLLM module name → the checkpoint names that load into it.
        copies: checkpoint names → ``(name, committed checkpoint-format tensor)`` (``CheckpointStore.values``).
        dtype: the engine's parameter dtype (copies read from the file are cast into it, as vLLM's loader does).
        names: only these (vLLM or checkpoint names, as a full read back reports them). values: the bytes too.

    Raises:
        KeyError: a name of ``names`` is not among them (the missing ones are named).
    """
    held: dict[str, tuple[torch.Tensor | None, str]] = {}
    wanted_copies: list[str] = []
    for pname, param in model.named_parameters():
        module_name, _, leaf = pname.rpartition(".")
        module = model.get_submodule(module_name)
        if opaque_reason(module, leaf, param) is None:
            held[pname] = (param.data, "served")
        elif feeds.get(module_name):
            wanted_copies.extend(feeds[module_name])
        else:
            held[pname] = (None, "unreadable")
    wanted_copies = [n for n in dict.fromkeys(wanted_copies) if n not in held]
    for name, tensor in copies(wanted_copies):
        held[name] = (tensor.to(dtype) if tensor.is_floating_point() else tensor, "checkpoint-copy")
    held = dict(sorted(held.items()))
    picked = chosen(held, names, "vLLM served_weights", "names come from a full read back (vLLM's names, checkpoint "
                    "names for checkpoint copies)")
    return [digest_row(name, *held[name], values) for name in picked]
