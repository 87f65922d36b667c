"""TRL: a ``TrainerCallback`` that pushes the live policy to the rollout engines after every optimizer step.

    trainer = GRPOTrainer(model=..., peft_config=LoraConfig(...), args=GRPOConfig(...), callbacks=[
        WeightSyncCallback(engines=engines, config=SyncConfig(transport="shm"))])
    trainer.train()        # version k = state.global_step is on every engine after step k

The trainer runs inside a Ray actor that accepts concurrent calls (``max_concurrency >= 2``); at
``on_train_begin`` the callback attaches an endpoint to the trainer's PEFT model (``attach_trainer``,
read in place) and builds the coordinator in this process (one training process: TRL's single-rank
run). Requires ``trl`` (``pip install weightsync[trl]``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from transformers import TrainerCallback

from sync_service.api import SyncConfig, SyncMetrics, WeightSync
from sync_service.live import attach_trainer

__all__ = ["WeightSyncCallback"]


class WeightSyncCallback(TrainerCallback):
    """Pushes ``state.global_step`` after every optimizer step (and version 0 before the first).

    Args:
        engines: the rollout engine actors (``RolloutEngine`` / any rollout endpoint).
        config: the ``SyncConfig`` of the coordinator.
        on_push: called with ``(version, metrics, model)`` after each committed push (metrics, logging, tests).
        adapter_name: the PEFT adapter to sync (default: the active one).

    Raises (from ``trainer.train()``):
        AttachError / TypeError: the trainer's model is not a PEFT LoRA model (pass ``peft_config=``).
        SyncError: a push failed; every engine keeps serving the previous version.
    """

    def __init__(self, *, engines: Sequence, config: SyncConfig | None = None,
                 on_push: Callable[[int, SyncMetrics, object], None] | None = None, adapter_name: str | None = None) -> None:
        self.engines, self.config = list(engines), config or SyncConfig()
        self.on_push, self.adapter_name = on_push, adapter_name
        self.sync: WeightSync | None = None
        self.metrics: list[SyncMetrics] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("WeightSyncCallback: the trainer passed no model to on_train_begin")
        handle = attach_trainer(model, adapter_name=self.adapter_name, timeout_s=self.config.timeout_s)
        self.sync = WeightSync(trainers=[handle], engines=self.engines, config=self.config)
        self._push(state.global_step, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._push(state.global_step, model)

    def on_train_end(self, args, state, control, **kwargs):
        if self.sync is not None:
            self.sync.close()
            self.sync = None

    def _push(self, version: int, model) -> None:
        metrics = self.sync.push(version)
        self.metrics.append(metrics)
        if self.on_push is not None:
            self.on_push(version, metrics, model)
