"""``RLConfig``: settings of the toy GRPO loop (``sync_service.entrypoints.rl.loop``)."""

from __future__ import annotations

from dataclasses import dataclass

from sync_service import defaults


@dataclass(kw_only=True, slots=True)
class RLConfig:
    """One toy GRPO run (and its control run)."""

    steps: int = 24
    """Training steps; step t trains on rollouts, then pushes weight version t + 1."""
    group_size: int = 8
    """G: sampled completions per prompt (one GRPO group)."""
    lr: float = 1e-2
    """Adam learning rate on the LoRA factors."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (the learner's log-probs use the same)."""
    engines: int = 2
    """Rollout engines (transformers on CPU); prompts are spread over them round robin."""
    ep: int = 2
    """Expert-parallel trainer ranks."""
    max_in_flight: int = 1
    """``SyncConfig.max_in_flight``: pushes in flight before ``push_async`` blocks."""
    max_staleness: int = 1
    """``SyncConfig.max_staleness``: rollouts use versions >= latest pushed - k."""
    window: int = 5
    """Steps averaged for the first / last window of a reward curve."""
    seed: int = 0
    """Seeds the rollout sampling (per step and prompt), so runs are comparable."""
    bucket_bytes: int = defaults.SMALL_MODEL_BUCKET_BYTES
    """``SyncConfig.bucket_bytes``."""
    transport: str = defaults.TRANSPORT
    """``SyncConfig.transport``."""
    timeout_s: float = defaults.TIMEOUT_S
    """Bound of every blocking step, seconds."""

    def __post_init__(self) -> None:
        if self.steps < 2 * self.window or self.window < 1:
            raise ValueError(f"RLConfig.steps={self.steps} must be >= 2·window (window={self.window} >= 1)")
        if self.group_size < 2 or self.engines < 1 or self.ep < 1:
            raise ValueError(f"RLConfig needs group_size >= 2, engines >= 1, ep >= 1; got "
                             f"{self.group_size} / {self.engines} / {self.ep}")
