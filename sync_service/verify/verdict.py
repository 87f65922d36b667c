"""One engine's verdict for one version, shared by ``weightsync sync`` / ``demo`` / ``run`` (every engine
kind) and the tests: what "verified" means, and the bounds it used.

"Verified" = the engine's weights equal PEFT's ``merge_and_unload`` of the version (float64, cast once:
``peft_oracle``) up to the rounding of an fp32-accumulated merge (``peft_oracle.values_match``), and its
greedy tokens agree with the oracle model's up to near-ties (``tokens``; bound 0 when the weights are the
oracle's bit for bit). vLLM engines are judged on their tokens here (``token_verdict``, with the bound the push's
accumulation dtype implies) and on their read back against a fresh vLLM's (``verify.served``).

Each verdict is one dict (the ``engines`` rows of the commands' ``--json``): ``verified``,
``weights_equal_reference``, ``weights_bitwise``, ``max_abs_diff``, ``weight_bound``,
``weights_equal_merge_output``, the ``TokenCheck.report`` fields (``generations_equal``,
``tokens_identical``, ``token_bound``, ``near_ties``, ``mismatched_prompts``) and ``weight_version``;
the fields a check did not run are ``None``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sync_service.verify.peft_oracle import compare_state
from sync_service.verify.tokens import OracleDecode, compare_tokens, token_bound

__all__ = ["TP_EXTRA_ATOL", "Reference", "token_verdict", "verdict", "weight_bound"]

TP_EXTRA_ATOL = 2.4e-7
"""TP blocks: the fp32 GEMM's rounding depends on the block shape (absolute, added to the ulp bound)."""

_NO_TOKENS = {"generations_equal": None, "tokens_identical": None, "token_bound": None, "near_ties": None,
              "mismatched_prompts": None}


def weight_bound(extra_atol: float, *, fp8: bool = False) -> str:
    """The weight check's bound, as the JSON reports it (``peft_oracle.values_match``); ``fp8``: the oracle holds
    block-FP8 tensors (``verify.fp8_oracle``: transformers' ``Fp8Quantize`` of PEFT's float64 merge)."""
    bound = f"8*eps(float32)*(|oracle|+max|oracle|) + 1 ulp (16-bit and FP8 dtypes) + {extra_atol:g}"
    return ("FP8 values and scales (float32 or ue8m0) against transformers' Fp8Quantize of PEFT's float64 merge (1 "
            f"ulp = one FP8 step), other tensors against that merge cast once: {bound}") if fp8 else bound


@dataclass(frozen=True, slots=True)
class Reference:
    """What one version's engines are judged against.

    Attributes:
        oracle: PEFT's float64 merge cast once (``peft_oracle.model_state``), name → tensor.
        written: the ``weightsync merge`` output of the version read back, or ``None`` (not compared).
        decodes: the oracle model's greedy decodes of the verdict prompts, or ``None`` (weights only).
        extra_atol: absolute slack added to the weight bound (``TP_EXTRA_ATOL`` with TP blocks, else 0).
    """

    oracle: Mapping[str, torch.Tensor]
    written: Mapping[str, torch.Tensor] | None = None
    decodes: Sequence[OracleDecode] | None = None
    extra_atol: float = 0.0

    @property
    def dtype(self) -> torch.dtype:
        """The serving dtype the token bound is taken from: the coarsest (largest epsilon) floating dtype of the
        oracle's tensors, ``float8_e4m3fn`` where an engine serves block FP8 (float32 if none). ue8m0 scales
        (``float8_e8m0fnu``: exponents only, eps 1) scale weights but are none, so they do not count."""
        floats = {t.dtype for t in self.oracle.values() if t.is_floating_point() and t.dtype != torch.float8_e8m0fnu}
        return max(floats, key=lambda d: torch.finfo(d).eps, default=torch.float32)


def verdict(ref: Reference, state: Mapping[str, Any], tokens: Sequence[Sequence[int]] | None,
            version: int | None) -> dict:
    """An engine's verdict: ``state`` (``RolloutEngine.state()``: name → tensor or numpy, bf16 may be
    widened), ``tokens`` (its greedy tokens per prompt of ``ref.decodes``; ``None``: not checked),
    ``version`` (the version it reports). Token bound: 0 when ``state`` equals ``ref.oracle`` bit for bit."""
    check = compare_state(state, ref.oracle, extra_atol=ref.extra_atol)
    bitwise = check.ok and check.max_abs_diff == 0.0
    merge_ok = None if ref.written is None else compare_state(state, ref.written, extra_atol=ref.extra_atol).ok
    gen = None
    if tokens is not None and ref.decodes is not None:
        gen = compare_tokens(ref.decodes, tokens, token_bound(ref.dtype, bitwise=bitwise))
    ok = check.ok and merge_ok is not False and (gen is None or gen.ok)
    return {"verified": bool(ok), "weights_equal_reference": check.ok, "weights_bitwise": bitwise,
            "max_abs_diff": check.max_abs_diff,
            "weight_bound": weight_bound(ref.extra_atol, fp8=ref.dtype == torch.float8_e4m3fn),
            "weights_equal_merge_output": merge_ok, **(_NO_TOKENS if gen is None else gen.report()),
            "mismatched_tensors": list(check.mismatched[:8]), "weight_version": version}


def token_verdict(decodes: Sequence[OracleDecode], tokens: Sequence[Sequence[int]], version: int | None, *,
                  expected_version: int, dtype: torch.dtype | str, accumulate_dtype: str) -> dict:
    """The token half of a vLLM engine's verdict (its weights: ``verify.served``): its greedy ``tokens`` against a
    fresh engine's ``decodes`` on PEFT's merge, and ``version == expected_version``. Bound 0 when the push
    accumulated in float64 (the served weights are the oracle's cast bit for bit), else ``token_bound``."""
    gen = compare_tokens(decodes, tokens, token_bound(dtype, bitwise=accumulate_dtype == "float64"))
    return {"verified": bool(gen.ok and version == expected_version), "weights_equal_reference": None,
            "weights_bitwise": None, "max_abs_diff": None, "weight_bound": None, "weights_equal_merge_output": None,
            **gen.report(), "mismatched_tensors": None, "weight_version": version}
