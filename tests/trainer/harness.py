"""The user-owned training rank of these tests: ``ExampleTrainingRank`` as a threaded Ray actor."""

from __future__ import annotations

import ray

from sync_service.live.example import MODES, ExampleTrainingRank, lora_config

__all__ = ["MODES", "TrainingRank", "lora_config"]

TrainingRank = ray.remote(num_cpus=0, max_concurrency=2)(ExampleTrainingRank)
