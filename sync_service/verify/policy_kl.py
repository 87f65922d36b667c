"""The train/inference mismatch of merged serving, measured: mean per-token KL(π_trainer ‖ π_engine).

π_trainer is the policy the trainer computes: transformers loads the base in the trainer's dtype (the base
checkpoint's), PEFT puts the adapter on it unmerged (``PeftModel.from_pretrained``: LoRA factors kept in
float32, as PEFT autocasts them), and the forward runs as PEFT runs it. π_engine is what an engine serves,
scored by the engine itself (``RolloutEngine.token_logprobs``: the HF engine's logits, vLLM's prompt logprobs
over the full vocabulary). Both score the same teacher-forced verification sequences (``verification_sequences``);
each position's KL is over the full vocabulary, in float64, and the figure is the mean over every position of
every sequence (natural log, nats).

The floor (``policy_kl_floor``) is what the trainer's own dtype costs: KL(π_fp32 ‖ π_trainer), π_fp32 the same
unmerged PEFT model with the base in float32; 0 for a float32 trainer. A merged engine's ``policy_kl`` near the
floor means merged serving costs about what the trainer's dtype costs already.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["SEQUENCES", "SEQUENCE_TOKENS", "mean_kl", "model_logprobs", "policy_check", "policy_floor",
           "trainer_policy", "warn_logprobs_refused", "verification_sequences", "vocab_size"]

SEQUENCES = 4
"""Verification sequences per version."""
SEQUENCE_TOKENS = 32
"""Tokens per verification sequence (31 scored positions each)."""


def verification_sequences(vocab_size: int, *, count: int = SEQUENCES, length: int = SEQUENCE_TOKENS,
                           seed: int = 0) -> list[list[int]]:
    """``count`` sequences of ``length`` token ids drawn uniformly from ``[0, vocab_size)`` by a ``torch.Generator``
    seeded with ``seed`` (the same for every run, engine and version)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, length), generator=gen).tolist()


def trainer_policy(base: str | Path, adapter: str | Path | None, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The PEFT model unmerged, base loaded in ``dtype`` (default: the checkpoint's, the trainer's), eval mode."""
    from sync_service.engines.hf import load_causal_lm
    from sync_service.verify.peft_oracle import _serving_dtype

    model = load_causal_lm(base, dtype=dtype or _serving_dtype(Path(base)))
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    return model.train(False)


@torch.no_grad()
def model_logprobs(model: torch.nn.Module, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Per sequence a float32 ``[len - 1, vocab]`` tensor: log_softmax of the model's logits at every position but
    the last (the next-token distribution, teacher-forced)."""
    out = []
    for seq in sequences:
        ids = torch.tensor([list(seq)], dtype=torch.long)
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, :-1]
        out.append(torch.log_softmax(logits.float(), dim=-1))
    return out


def mean_kl(p: Sequence[torch.Tensor], q: Sequence[torch.Tensor]) -> float:
    """Mean over every position of KL(p ‖ q) = Σ_v p_v (log p_v − log q_v), in float64 (``p``, ``q``: log-probs of
    equal shapes, per sequence ``[positions, vocab]``), each renormalized in float64 first: a float32 log-softmax
    misses normalization by ~1e-7, which without it can read as a small negative KL. A token with q = 0 where p > 0
    gives ``inf``.

    Raises:
        ValueError: different sequence counts or shapes.
    """
    if len(p) != len(q) or any(a.shape != b.shape for a, b in zip(p, q)):
        raise ValueError(f"mean_kl: shapes differ: {[tuple(a.shape) for a in p]} vs {[tuple(b.shape) for b in q]}")
    total, positions = 0.0, 0
    for a, b in zip(p, q):
        a, b = torch.log_softmax(a.double(), -1), torch.log_softmax(torch.as_tensor(b).double(), -1)
        terms = torch.where(a > float("-inf"), a.exp() * (a - b), torch.zeros_like(a))
        total += float(terms.sum())
        positions += a.shape[0]
    return total / positions if positions else 0.0


def policy_floor(base: str | Path, adapter: str | Path | None, sequences: Sequence[Sequence[int]],
                 trainer: Sequence[torch.Tensor], dtype: torch.dtype) -> float:
    """KL(π_fp32 ‖ π_trainer) on ``sequences``: ``trainer`` the trainer-dtype policy's logprobs; 0.0 for float32."""
    if dtype == torch.float32:
        return 0.0
    return mean_kl(model_logprobs(trainer_policy(base, adapter, torch.float32), sequences), trainer)


def vocab_size(base: str | Path) -> int:
    """The vocabulary size of the base's (text) config: the logits' last dimension."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(str(base)).get_text_config().vocab_size)


_REFUSED = re.compile(r"the server at (\S+) refuses full-vocabulary prompt logprobs")
_WARNED: set[str] = set()


def warn_logprobs_refused(error: BaseException) -> bool:
    """One stderr line per server URL and process when ``error`` (an engine's ``token_logprobs`` failure) is a vLLM
    server refusing full-vocabulary prompt logprobs (``VLLMServerEngine.token_logprobs``): its ``policy_kl`` is
    ``None`` because the server was started without ``--max-logprobs -1``. True when it printed the line."""
    found = _REFUSED.search(str(error))
    if found is None or found.group(1) in _WARNED:
        return False
    _WARNED.add(found.group(1))
    print(f"weightsync: policy_kl is null: the vLLM server at {found.group(1)} refuses full-vocabulary prompt "
          f"logprobs; restart it with --max-logprobs -1 (docs/vllm.md)", file=sys.stderr)
    return True


def policy_check(base: str | Path, adapter: str | Path | None, engines: Sequence, *,
                 timeout_s: float) -> tuple[float, list[float | None]]:
    """``(policy_kl_floor, [policy_kl per engine])`` of one version: the trainer-dtype unmerged PEFT policy against
    each engine's served model (Ray handles with ``token_logprobs``; ``None`` for an engine that reports no
    logprobs) on ``verification_sequences``, and the floor (``policy_floor``). Blocks up to ``timeout_s`` per engine."""
    import ray

    from sync_service.verify.peft_oracle import _serving_dtype

    sequences = verification_sequences(vocab_size(base))
    dtype = _serving_dtype(Path(base))
    trainer = model_logprobs(trainer_policy(base, adapter, dtype), sequences)
    kls: list[float | None] = []
    for engine in engines:
        try:
            logprobs, _ = ray.get(engine.token_logprobs.remote(sequences), timeout=timeout_s)
        except (TypeError, AttributeError) as exc:
            warn_logprobs_refused(exc)
            kls.append(None)
            continue
        kls.append(mean_kl(trainer, [torch.tensor(a) for a in logprobs]))
    return policy_floor(base, adapter, sequences, trainer, dtype), kls
