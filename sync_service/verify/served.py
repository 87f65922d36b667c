"""A vLLM engine's read back judged against a fresh vLLM engine that loaded the oracle checkpoint.

Both sides report the same kind of rows (``engines.vllm.served``: vLLM's parameters as held after post-load
processing, checkpoint-format copies where vLLM keeps a tensor opaque, ``unreadable`` ones named). The verdict
needs the same set of names with the same sources, dtypes and shapes; then, tensor by tensor, equal bytes
(digests) where the push's arithmetic is exact (``accumulate_dtype="float64"``: PEFT's float64 merge cast once,
bit for bit), else values within the merge's rounding (``peft_oracle.values_match``). An ``unreadable`` tensor
fails the verdict (it is named in ``mismatched_tensors``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from protocols.readback import ServedWeights
from sync_service.dtypes import torch_dtype
from sync_service.verify.peft_oracle import compare_state
from sync_service.verify.verdict import weight_bound

__all__ = ["served_verdict"]


def _tensors(rows: Sequence[tuple[str, str, tuple, bytes | None]]) -> dict[str, torch.Tensor]:
    return {n: torch.frombuffer(bytearray(v), dtype=torch_dtype(d)).reshape(tuple(s)).clone()
            for n, d, s, v in rows if v is not None and d}


def served_verdict(engine: ServedWeights, fresh: Sequence[Sequence], *, accumulate_dtype: str) -> dict:
    """The weight fields of an engine's verdict row: ``engine`` (read back with ``values=True``) against ``fresh``
    (rows ``[name, dtype, shape, xxh3_64, source, bytes]`` of a fresh engine on the oracle checkpoint).

    Returns ``weights_equal_reference``, ``weights_bitwise``, ``max_abs_diff``, ``weight_bound``,
    ``mismatched_tensors`` and ``served_sources`` (tensors per source, e.g. ``{"served": 12, "checkpoint-copy": 40}``).
    """
    got = {t.name: t for t in engine.tensors}
    want = {r[0]: r for r in fresh}
    shape_of = {n: (t.dtype, tuple(t.shape), t.source) for n, t in got.items()}
    bad = sorted(n for n in set(got) | set(want)
                 if n not in got or n not in want or shape_of[n] != (want[n][1], tuple(want[n][2]), want[n][4])
                 or got[n].source == "unreadable")
    same = {n for n in set(got) & set(want) if got[n].xxh3_64 == want[n][3] and got[n].xxh3_64}
    bitwise = not bad and same == set(got)
    check = compare_state(_tensors([(n, t.dtype, t.shape, t.values) for n, t in got.items() if n in want]),
                          _tensors([(n, r[1], r[2], r[5]) for n, r in want.items() if n in got]))
    exact = accumulate_dtype == "float64"
    mismatched = sorted(set(bad) | set(check.mismatched) | ({n for n in got if n not in same} if exact else set()))
    return {"weights_equal_reference": not mismatched, "weights_bitwise": bitwise,
            "max_abs_diff": check.max_abs_diff,
            "weight_bound": ("bitwise (float64 accumulation: PEFT's float64 merge cast once)" if exact
                             else weight_bound(0.0)) + "; against a fresh vLLM on the oracle checkpoint",
            "mismatched_tensors": mismatched[:8],
            "served_sources": dict(sorted(Counter(t.source for t in engine.tensors).items()))}
