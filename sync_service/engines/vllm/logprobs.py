"""Teacher-forced next-token log-probabilities over the full vocabulary from a ``vllm.LLM`` (prompt logprobs).

``prompt_logprobs(llm, sequences)`` asks vLLM for ``prompt_logprobs=-1`` (every token id; the engine must be
started with ``max_logprobs=-1``) with one generated token, and assembles, per sequence, the ``[len - 1, vocab]``
float32 matrix whose row ``t`` is log π(· | sequence[:t + 1]). The rows are renormalised with ``log_softmax``
(a no-op on vLLM's logprobs; it turns ``logprobs_mode="raw_logits"`` values into logprobs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["prompt_logprobs"]


def prompt_logprobs(llm: object, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Per sequence (>= 2 token ids) a float32 ``[len - 1, vocab]`` tensor of natural-log next-token probabilities.

    Raises:
        ValueError: a sequence shorter than 2 tokens, or vLLM returned fewer entries than the vocabulary at a
            position (an engine started without ``max_logprobs=-1``).
    """
    from vllm import SamplingParams

    if any(len(s) < 2 for s in sequences):
        raise ValueError("prompt_logprobs: every verification sequence needs >= 2 token ids")
    vocab = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=-1)
    outs = llm.generate([{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False)
    result = []
    for seq, out in zip(sequences, outs):
        rows = out.prompt_logprobs[1:]  # position 0 has no context
        mat = torch.full((len(seq) - 1, vocab), float("-inf"), dtype=torch.float32)
        for t, step in enumerate(rows):
            if step is None or len(step) < vocab:
                raise ValueError(f"prompt_logprobs: vLLM returned {0 if step is None else len(step)} of {vocab} token "
                                 f"logprobs at position {t + 1}; start the engine with max_logprobs=-1")
            ids = torch.tensor(list(step.keys()), dtype=torch.long)
            mat[t, ids] = torch.tensor([lp.logprob for lp in step.values()], dtype=torch.float32)
        result.append(torch.log_softmax(mat, dim=-1))
    return result
