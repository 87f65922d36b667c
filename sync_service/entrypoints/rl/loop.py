"""The toy GRPO loop on Ray: ``PolicyTrainer`` shards learn, ``RolloutEngine``s sample, ``WeightSync``
refreshes the engines while training runs.

Per step t (the trainers hold policy version t):
  1. ``sync.wait_for_fresh()``: every engine serves a version >= t - max_staleness;
  2. every prompt is sampled ``group_size`` times on an engine (round robin), tagged with the version;
  3. rewards → group-normalised advantages → every trainer rank runs the same gradient step;
  4. ``sync.push_async(t + 1)`` snapshots the new factors and streams them while step t + 1 samples.
The control run is the same loop with the pushes after version 0 disabled: the engines keep serving
the initial policy, so its reward must stay flat however well the trainers learn.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sync_service.entrypoints.rl.config import RLConfig
from sync_service.entrypoints.rl.task import TargetTokenTask, group_advantages

__all__ = ["Curve", "RLResult", "run_rl", "run_curve", "window_means"]


@dataclass(slots=True)
class Curve:
    """One run: per step the mean reward, the versions of its rollouts and the largest policy lag
    (trainer's version − rollout's version); per push its metrics."""

    rewards: list[float] = field(default_factory=list)
    versions: list[list[int | None]] = field(default_factory=list)
    lag: list[int] = field(default_factory=list)
    pushes: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    ranks_agree: bool = False
    """Every trainer rank ended with bitwise the same full factors (identical deterministic steps)."""


@dataclass(slots=True)
class RLResult:
    """Both runs of ``run_rl``."""

    config: dict
    synced: Curve
    control: Curve

    def to_json(self) -> dict:
        w = self.config["window"]
        return {"reward_curve": self.synced.rewards, "control_reward_curve": self.control.rewards,
                "versions_seen": self.synced.versions, "control_versions_seen": self.control.versions,
                "policy_lag": self.synced.lag, "control_policy_lag": self.control.lag,
                "windows": {"synced": window_means(self.synced.rewards, w), "control": window_means(self.control.rewards, w)},
                "pushes": self.synced.pushes, "ranks_agree": self.synced.ranks_agree and self.control.ranks_agree, "seconds": {"synced": self.synced.seconds, "control": self.control.seconds},
                "config": self.config}


def window_means(curve: list[float], window: int) -> tuple[float, float]:
    """Mean of the first and of the last ``window`` values."""
    return sum(curve[:window]) / window, sum(curve[-window:]) / window


def run_rl(base_dir: str | Path, adapter_dir: str | Path, config: RLConfig, *, vocab_size: int, launcher) -> RLResult:
    """Start ``config.ep`` PolicyTrainer shards and ``config.engines`` engines on the running Ray
    (``launcher``: ``protocols.endpoints.Launcher``), run the loop with sync, then the control run on
    the same actors (reloaded to the adapter); kills them after.

    Raises:
        SyncError / TimeoutError: a push or a rollout failed.
    """
    import ray

    task = TargetTokenTask.from_vocab(vocab_size)
    trainers = launcher.start_policy_trainers(base_dir, adapter_dir, ep=config.ep, timeout_s=config.timeout_s)
    engines = launcher.start_engines(base_dir, config.engines, prefix="rollout", timeout_s=config.timeout_s)
    try:
        synced = run_curve(trainers, engines, base_dir, adapter_dir, task, config, sync_enabled=True, launcher=launcher)
        control = run_curve(trainers, engines, base_dir, adapter_dir, task, config, sync_enabled=False, launcher=launcher)
    finally:
        for actor in trainers + engines:
            ray.kill(actor)
    return RLResult(config=asdict(config), synced=synced, control=control)


def run_curve(trainers: list, engines: list, base_dir, adapter_dir, task: TargetTokenTask, config: RLConfig, *,
              sync_enabled: bool, launcher) -> Curve:
    """One run from the adapter's initial factors (trainers reloaded, version 0 pushed to every engine)."""
    import ray

    from sync_service.api import SyncConfig, WeightSync
    t0 = time.perf_counter()
    launcher.start_trainers(base_dir, adapter_dir, ep=config.ep, reuse=trainers, timeout_s=config.timeout_s)
    ray.get([t.start_learner.remote(config.lr, config.temperature) for t in trainers], timeout=config.timeout_s)
    sync = WeightSync(trainers=trainers, engines=engines, config=SyncConfig(
        transport=config.transport, bucket_bytes=config.bucket_bytes, timeout_s=config.timeout_s,
        max_in_flight=config.max_in_flight, max_staleness=config.max_staleness,
        reset_versions=True))  # the control run restarts at version 0 on the same engines
    curve, handles = Curve(), []
    try:
        sync.push(0)  # both runs start from the adapter's policy on every engine
        for step in range(config.steps):
            if sync_enabled:
                sync.wait_for_fresh()
            tokens, versions = sample_rollouts(engines, task, config, step)
            rewards = task.rewards(tokens)
            advantages = group_advantages(rewards)
            first = [[c[0] for c in group] for group in tokens]
            ray.get([t.learn.remote([list(p) for p in task.prompts], first, advantages) for t in trainers],
                    timeout=config.timeout_s)
            if sync_enabled:
                handles.append(sync.push_async(step + 1))
            curve.rewards.append(sum(map(sum, rewards)) / sum(map(len, rewards)))
            curve.versions.append(versions)
            curve.lag.append(max(step - (v if v is not None else -1) for v in versions))
        for h in handles:
            m = h.result(timeout=config.timeout_s * 2)
            curve.pushes.append({"version": m.version, "bytes": m.bytes, "seconds": m.seconds, "full": m.full,
                                 "backpressure_s": h.backpressure_s, "snapshot_s": h.snapshot_s})
        curve.ranks_agree = len(set(ray.get([t.learner_digest.remote() for t in trainers], timeout=config.timeout_s))) == 1
    finally:
        sync.close()
    curve.seconds = time.perf_counter() - t0
    return curve


def sample_rollouts(engines: list, task: TargetTokenTask, config: RLConfig, step: int):
    """``group_size`` one-token completions per prompt, prompts spread round robin over the engines.
    Returns (completions [P][G][1], the weight version of each prompt's group [P])."""
    import ray

    refs = [engines[p % len(engines)].sample.remote(list(prompt), 1, config.group_size, config.temperature,
                                                     config.seed * 1_000_003 + step * 101 + p)
            for p, prompt in enumerate(task.prompts)]
    results = ray.get(refs, timeout=config.timeout_s)
    return [tokens for tokens, _ in results], [version for _, version in results]
