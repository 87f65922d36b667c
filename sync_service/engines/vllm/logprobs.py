"""Teacher-forced next-token log-probabilities over the full vocabulary from a ``vllm.LLM`` (prompt logprobs).

``prompt_logprobs(llm, sequences)`` asks vLLM for ``prompt_logprobs=-1`` (every token id; the engine must be
started with ``max_logprobs=-1``) with one generated token, and assembles, per sequence, the ``[len - 1, vocab]``
float32 matrix whose row ``t`` is log π(· | sequence[:t + 1]). The rows are renormalised with ``log_softmax``
(a no-op on vLLM's logprobs; it turns ``logprobs_mode="raw_logits"`` values into logprobs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["logprob_matrix", "prompt_logprobs"]


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
    return [logprob_matrix(len(seq), vocab, [None if step is None else {i: lp.logprob for i, lp in step.items()}
                                             for step in out.prompt_logprobs])
            for seq, out in zip(sequences, outs)]


def logprob_matrix(length: int, vocab: int, rows: Sequence[Mapping[int, float] | None]) -> torch.Tensor:
    """The float32 ``[length - 1, vocab]`` log-softmax matrix of one sequence from vLLM's prompt logprobs ``rows``
    (per prompt position, token id → logprob; row 0, which has no context, is skipped). Shared by the engine in
    process and the server's ``/v1/completions`` answer (``vllm_server.engine.VLLMServerEngine.token_logprobs``).

    Raises:
        ValueError: a row holds fewer entries than the vocabulary (a server or engine not started with
            ``max_logprobs=-1`` / ``--max-logprobs -1``).
    """
    mat = torch.full((length - 1, vocab), float("-inf"), dtype=torch.float32)
    for t, step in enumerate(rows[1:length]):
        if step is None or len(step) < vocab:
            raise ValueError(f"prompt_logprobs: vLLM returned {0 if step is None else len(step)} of {vocab} token "
                             f"logprobs at position {t + 1}; start the engine with max_logprobs=-1")
        ids = torch.tensor([int(i) for i in step], dtype=torch.long)
        mat[t, ids] = torch.tensor([float(v) for v in step.values()], dtype=torch.float32)
    return torch.log_softmax(mat, dim=-1)
