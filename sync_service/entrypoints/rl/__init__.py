"""A toy GRPO loop on live-refreshed weights: trainer shards learn LoRA factors from rewards, rollout
engines sample with the weights ``WeightSync`` streams to them, every rollout tagged with its weight
version. ``run_rl`` runs it twice, with sync and with sync disabled (the control)."""

from sync_service.entrypoints.rl.config import RLConfig
from sync_service.entrypoints.rl.task import TargetTokenTask, group_advantages

__all__ = ["RLConfig", "TargetTokenTask", "group_advantages"]
