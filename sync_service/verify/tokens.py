"""The token half of a verdict: an engine's greedy tokens against the oracle's, exact up to near-ties.

Why not plain token equality: an engine whose weights are within the rounding of an fp32-accumulated
merge (1 ulp of bf16 away from PEFT's float64 merge cast once, on a few elements; ``peft_oracle``)
computes logits a few rounding steps away from the oracle's, and where the oracle's two best logits
are that close (a near-tie) the greedy token may flip. A flip there says nothing about the sync; a
flip anywhere else does. The rule, per prompt (``compare_tokens``):

- tokens equal to the oracle's up to the first step where they differ, and at that step
- the engine's token is the oracle's runner-up, and the oracle's top-2 logit gap is at most the bound:
  ``bound · max(1, |top logit|)``. After a flip the contexts differ; the rest of that prompt is not compared.

The bound (``token_bound``) follows from what the engine's weights are, not from a tuned constant:
``0`` when they are the oracle's cast bit for bit (``SyncConfig.accumulate_dtype="float64"``, or
weights read back equal: the forward is the same computation, so no flip is accepted);
otherwise ``NEAR_TIE_EPS · eps(serving dtype)``: a few rounding steps of a logit of that
magnitude. A wrong merge (a transposed expert, a scaling off) moves logits by orders of magnitude
more, and the weight check (``peft_oracle.compare_state``) catches what the tokens cannot.
Cost: the oracle's decode also keeps its top-2 logits per step (no extra forward).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["NEAR_TIE_EPS", "NearTie", "OracleDecode", "TokenCheck", "compare_tokens", "hf_decodes", "token_bound"]

NEAR_TIE_EPS = 4.0
"""Near-tie width in units of the serving dtype's epsilon, relative to the top logit's magnitude: a
logit rounds to ``eps/2·|l|`` per operation; 1-ulp weight differences move it by a few such steps."""


@dataclass(frozen=True, slots=True)
class OracleDecode:
    """The oracle's greedy decode of one prompt: ``tokens`` and, per step, its runner-up token, the
    top-2 logit gap (``>= 0``, float64) and the top logit (float64)."""

    tokens: tuple[int, ...]
    runner_up: tuple[int, ...]
    gaps: tuple[float, ...]
    top_logits: tuple[float, ...]

    @classmethod
    def from_top2(cls, tokens: Sequence[int], top2: Sequence[Sequence[Sequence[float]]]) -> "OracleDecode":
        """From per-step ``[[id1, logit1], [id2, logit2]]`` (best first; at a tie the chosen token is put
        first, whatever order the pair came in), e.g. ``vllm_oracle``'s ``top2``."""
        top2 = [s if int(s[0][0]) == int(t) or int(s[1][0]) != int(t) else [s[1], s[0]] for t, s in zip(tokens, top2)]
        return cls(tokens=tuple(int(t) for t in tokens), runner_up=tuple(int(s[1][0]) for s in top2),
                   gaps=tuple(float(s[0][1]) - float(s[1][1]) for s in top2),
                   top_logits=tuple(float(s[0][1]) for s in top2))


@dataclass(frozen=True, slots=True)
class NearTie:
    """A flip accepted at a near-tie: ``prompt`` index, decode ``step``, the oracle's top-2 ``gap`` and the
    largest gap ``allowed`` there (logit units)."""

    prompt: int
    step: int
    gap: float
    allowed: float


@dataclass(frozen=True, slots=True)
class TokenCheck:
    """An engine's greedy tokens against the oracle's.

    Attributes:
        ok: every prompt agrees up to near-ties (module docstring). identical: every token equal.
        bound: the relative near-tie bound used (``token_bound``; 0: no flip accepted).
        near_ties: the flips accepted. mismatched: indices of the prompts that disagree otherwise.
    """

    ok: bool
    identical: bool
    bound: float
    near_ties: tuple[NearTie, ...]
    mismatched: tuple[int, ...]

    def report(self) -> dict:
        """The ``--json`` fields: ``generations_equal`` (agree up to near-ties), ``tokens_identical``,
        ``token_bound``, ``near_ties`` (``[{prompt, step, gap, allowed}]``), ``mismatched_prompts``."""
        return {"generations_equal": self.ok, "tokens_identical": self.identical, "token_bound": self.bound,
                "near_ties": [{"prompt": t.prompt, "step": t.step, "gap": t.gap, "allowed": t.allowed}
                              for t in self.near_ties], "mismatched_prompts": list(self.mismatched)}


def token_bound(dtype: torch.dtype | str, *, bitwise: bool) -> float:
    """The relative near-tie bound for engines serving ``dtype`` (a torch dtype or its name):
    ``0.0`` when their weights are the oracle's bit for bit (``bitwise``), else ``NEAR_TIE_EPS · eps``."""
    if bitwise:
        return 0.0
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return NEAR_TIE_EPS * torch.finfo(dtype).eps


def compare_tokens(expected: Sequence[OracleDecode], got: Sequence[Sequence[int]], bound: float) -> TokenCheck:
    """``got`` (the engine's greedy tokens per prompt) against ``expected`` (the oracle's decodes of the
    same prompts, same ``max_new_tokens``) under the near-tie rule with relative ``bound``."""
    ties, bad = [], []
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        have = [int(t) for t in have]
        step = next((s for s, (a, b) in enumerate(zip(want.tokens, have)) if a != b), None)
        if step is None:
            if len(have) != len(want.tokens):
                bad.append(i)
            continue
        allowed = bound * max(1.0, abs(want.top_logits[step]))
        if bound > 0 and have[step] == want.runner_up[step] and want.gaps[step] <= allowed:  # 0: not even a tie
            ties.append(NearTie(prompt=i, step=step, gap=want.gaps[step], allowed=allowed))
        else:
            bad.append(i)
    return TokenCheck(ok=not bad, identical=not bad and not ties, bound=bound, near_ties=tuple(ties),
                      mismatched=tuple(bad))


def hf_decodes(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[OracleDecode]:
    """Greedy decodes of ``prompts`` by a transformers model, the call ``engines.hf.HFEngine.generate``
    makes (so the tokens are the engine's), keeping the raw logits of each step (``output_logits``)."""
    cfg = model.generation_config
    pad = next((p for p in (cfg.pad_token_id, cfg.eos_token_id) if p is not None), 0)  # as HFEngine (one row: unused)
    pad = pad[0] if isinstance(pad, list) else int(pad)
    out = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad, output_logits=True, return_dict_in_generate=True)
        tokens = gen.sequences[0, ids.shape[1]:].tolist()
        out.append(OracleDecode.from_top2(tokens, [_top2(step[0], t) for t, step in zip(tokens, gen.logits)]))
    return out


def _top2(logits: torch.Tensor, chosen: int) -> list[list]:
    """``[[chosen, its logit], [the best other token, its logit]]`` of one step's logits ``[V]`` (float64)."""
    values = logits.double()
    other = values.clone()
    other[chosen] = -torch.inf
    runner = int(torch.argmax(other))
    return [[chosen, float(values[chosen])], [runner, float(values[runner])]]
