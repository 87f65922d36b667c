"""``PolicyTrainer``: a trainer shard (``TrainerShardCore``) that also learns — the toy GRPO step.

Each rank holds its shard for syncing (base shard + its slice of the LoRA factors) and a
``PolicyLearner`` over the whole tiny model for compute. Every rank receives the same rollouts and
runs the same deterministic step (one thread), so replicated factors stay bitwise equal across ranks
(data parallel with identical batches, no collective); each rank then keeps only its own slice
(``local_factors``), exactly what ``snapshot`` / ``send`` stream. ``learn`` may run while ``send``
streams an earlier version: the send works on that version's snapshot.
"""

from __future__ import annotations

import hashlib

import ray

from actors.trainer import TrainerShardCore


class PolicyTrainerCore(TrainerShardCore):
    """A ``TrainerShard`` with ``start_learner`` / ``learn`` (see the module docstring)."""

    _learner = None

    def start_learner(self, lr: float, temperature: float) -> int:
        """(Re)create the learner from this rank's base + adapter directories and reset the rank's
        factors to the adapter's; returns the number of trainable tensors."""
        from sync_service.entrypoints.rl.policy import PolicyLearner

        if self._init["adapter_dir"] is None:
            raise ValueError("PolicyTrainer needs an adapter_dir: it trains LoRA factors")
        self._learner = PolicyLearner(self._init["base_dir"], self._init["adapter_dir"], lr=lr, temperature=temperature)
        self._keep_local_slice()
        return len(self._learner.params)

    def learn(self, prompts: list[list[int]], tokens: list[list[int]], advantages: list[list[float]]) -> dict:
        """One policy-gradient step on the rollouts, then this rank's factors = its slice of the result."""
        if self._learner is None:
            raise RuntimeError("learn before start_learner")
        stats = self._learner.step(prompts, tokens, advantages)
        self._keep_local_slice()
        return stats

    def learner_digest(self) -> str:
        """sha256 of the learner's full factors (every rank must agree)."""
        h = hashlib.sha256()
        for k, v in sorted(self._learner.factors().items()):
            h.update(k.encode())
            h.update(v.numpy().tobytes())
        return h.hexdigest()

    def _keep_local_slice(self) -> None:
        from sync_service.live.checkpoint import set_factors
        from sync_service.sharding.ep_factors import local_factors

        state = self._state()
        set_factors(state, local_factors(self._learner.factors(), self.spec, num_experts=state.num_experts))


PolicyTrainer = ray.remote(num_cpus=0, max_concurrency=3)(PolicyTrainerCore)
"""The Ray actor class (same constructor as ``TrainerShard``)."""
