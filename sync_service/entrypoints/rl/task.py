"""The toy task: after a short prompt, say a number or a colour.

Prompts are fixed word sequences of the synthetic word-level tokenizer
(``sync_service.synthetic.tokenizer``); the reward of a sampled completion is 1 when its first token
is one of the target words (``one`` … ``ten``, five colours), else 0. A random base model puts about
15/V of its probability there (V = vocabulary size), so rewards start low and only a policy that
learned — and whose weights reached the engines — scores higher.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sync_service.synthetic.tokenizer import vocabulary

__all__ = ["PROMPTS", "TARGET_WORDS", "TargetTokenTask", "group_advantages"]

PROMPTS = ("the cat is", "a dog was", "the sun and", "one bird in")
TARGET_WORDS = ("one two three four five six seven eight nine ten red green blue black white").split()


@dataclass(frozen=True, slots=True)
class TargetTokenTask:
    """Prompts (token ids, all of one length) and the target token ids."""

    prompts: tuple[tuple[int, ...], ...]
    targets: frozenset[int]

    @classmethod
    def from_vocab(cls, vocab_size: int) -> "TargetTokenTask":
        """The task over the synthetic tokenizer of ``vocab_size`` tokens.

        Raises:
            ValueError: the vocabulary lacks a prompt or target word (``vocab_size`` too small).
        """
        vocab = vocabulary(vocab_size)
        missing = sorted(({w for p in PROMPTS for w in p.split()} | set(TARGET_WORDS)) - set(vocab))
        if missing:
            raise ValueError(f"vocab_size={vocab_size} lacks the words {missing[:5]}; use vocab_size >= 90")
        return cls(prompts=tuple(tuple(vocab[w] for w in p.split()) for p in PROMPTS),
                   targets=frozenset(vocab[w] for w in TARGET_WORDS))

    def rewards(self, completions: Sequence[Sequence[Sequence[int]]]) -> list[list[float]]:
        """``completions[p][g]`` (token ids) → reward 1.0 if its first token is a target, else 0.0."""
        return [[1.0 if c and c[0] in self.targets else 0.0 for c in group] for group in completions]


def group_advantages(rewards: Sequence[Sequence[float]], eps: float = 1e-4) -> list[list[float]]:
    """GRPO advantages: per group (one prompt), (r - mean) / (std + eps), std with Bessel's correction
    (as ``torch.std``; DeepSeekMath, Shao et al. 2024, eq. 3 / TRL's GRPOTrainer). A group whose
    rewards are all equal gets zeros (no signal)."""
    out = []
    for group in rewards:
        n = len(group)
        mean = sum(group) / n
        std = (sum((r - mean) ** 2 for r in group) / max(n - 1, 1)) ** 0.5
        out.append([(r - mean) / (std + eps) for r in group])
    return out
