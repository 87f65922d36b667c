"""PEFT ``ParamWrapper`` factors (``target_parameters`` on a 3D experts tensor) → per-expert LoRA factors.

PEFT 0.21 (``tuners/lora/layer.py`` ``ParamWrapper``) packs the factors of a parameter [E, d1, d2] as
A [r·E, in] with rows expert-major (e·r + k) and B [out, r·E] with columns rank-major (k·E + e), so
Δ[e] = s · B.reshape(out, r, E)[:, :, e] @ A.reshape(E, r, in)[e]. It reads ``is_transposed`` of the module
that holds the parameter (absent = False): False → out = d1, in = d2 (each expert [out, in]); True (gpt_oss)
→ in = d1, out = d2 and the stored Δ[e] is the transpose.
"""

from __future__ import annotations

import torch

from protocols.params import ParamMeta
from sync_service.merge.errors import MergeError


def expert_factors(module: str, param: str, meta: ParamMeta, a: torch.Tensor, b: torch.Tensor, r: int,
                   peft_transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` with Δ[e] = s · x[e] @ y[e] in the stored orientation of ``meta`` [E, d1, d2]: x [E, d1, r],
    y [E, r, d2] (views of ``a`` / ``b``).

    Raises:
        MergeError: A or B does not fit ``meta`` at rank ``r`` (names the module, its parameter and the shapes).
    """
    num_experts, d1, d2 = meta.shape
    in_f, out_f = (d1, d2) if peft_transposed else (d2, d1)
    if tuple(a.shape) != (r * num_experts, in_f) or tuple(b.shape) != (out_f, r * num_experts):
        raise MergeError(
            f"adapter module {module} ({param}): A {list(a.shape)}, B {list(b.shape)} do not fit base "
            f"{meta.name} {list(meta.shape)} with r={r}: expected A [{r * num_experts}, {in_f}], B [{out_f}, {r * num_experts}]"
        )
    a_e = a.reshape(num_experts, r, in_f)  # [E, r, in]
    b_e = b.reshape(out_f, r, num_experts).permute(2, 0, 1)  # [E, out, r]
    return (a_e.transpose(1, 2), b_e.transpose(1, 2)) if peft_transposed else (b_e, a_e)
