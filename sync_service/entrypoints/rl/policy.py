"""``PolicyLearner``: the gradient step of the toy GRPO loop, on the LoRA factors of a PEFT model.

The learner holds the whole (tiny) model with the adapter as trainable PEFT parameters and applies
policy-gradient steps with torch autograd and Adam: loss = −mean over rollouts of A · log π(token |
prompt), A the group-normalised advantage (GRPO without the clipped ratio and KL term: rollouts are
at most ``max_staleness`` versions old). ``factors()`` returns the full PEFT state dict
(``adapter_model.safetensors`` keys) that a trainer shard slices to its own part.

Completions are scored on their first token only, so one forward pass over the prompts gives every
log-prob a step needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["PolicyLearner"]


class PolicyLearner:
    """PEFT model + Adam over its LoRA factors (float32, CPU).

    Args:
        base_dir: base checkpoint directory. adapter_dir: PEFT LoRA adapter directory (initial factors).
        lr: Adam learning rate. temperature: the rollouts' sampling temperature.
    """

    def __init__(self, base_dir: str | Path, adapter_dir: str | Path, *, lr: float, temperature: float = 1.0) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        self.model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True).train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.params, lr=lr)
        self.temperature = temperature
        self.steps = 0

    def step(self, prompts: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]],
             advantages: Sequence[Sequence[float]]) -> dict[str, float]:
        """One policy-gradient step. ``prompts`` [P][L] (one length L), ``tokens`` [P][G] sampled
        first tokens, ``advantages`` [P][G]. Returns ``loss`` and ``mean_logp``.

        Raises:
            ValueError: prompts of different lengths, or [P][G] shapes that disagree.
        """
        if len({len(p) for p in prompts}) != 1:
            raise ValueError(f"prompts must share one length, got {sorted({len(p) for p in prompts})}")
        ids = torch.tensor([list(p) for p in prompts], dtype=torch.long)
        tok = torch.tensor([list(t) for t in tokens], dtype=torch.long)
        adv = torch.tensor([list(a) for a in advantages], dtype=torch.float32)
        if tok.shape != adv.shape or tok.shape[0] != ids.shape[0]:
            raise ValueError(f"tokens {tuple(tok.shape)} / advantages {tuple(adv.shape)} do not match {ids.shape[0]} prompts")
        logits = self.model(input_ids=ids).logits[:, -1].float() / self.temperature
        logp = torch.log_softmax(logits, dim=-1).gather(1, tok)
        loss = -(adv * logp).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.steps += 1
        return {"loss": float(loss), "mean_logp": float(logp.mean())}

    def factors(self) -> dict[str, torch.Tensor]:
        """The full adapter state dict (``adapter_model.safetensors`` keys), detached copies."""
        from peft import get_peft_model_state_dict

        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model).items()}
