"""Toy GRPO with live weight refresh: ``python examples/rl_loop.py [--steps N] [--json PATH] [--png PATH]``.

Two PolicyTrainer shards (EP=2) learn LoRA factors (attention + experts) of a small Qwen3-MoE from
rewards; two transformers rollout engines sample with the weights ``WeightSync.push_async`` streams
to them after every step (at most ``--max-staleness`` versions old); a control run with sync disabled
shows the reward rises only because the weights arrive. Same as ``weightsync demo --rl``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sync_service.entrypoints.rl.config import RLConfig
from actors.launch import RayLauncher
from sync_service.entrypoints.rl.run import run_demo_rl


def main(argv: list[str] | None = None) -> int:
    defaults = RLConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--max-staleness", type=int, default=defaults.max_staleness)
    parser.add_argument("--max-in-flight", type=int, default=defaults.max_in_flight)
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "weightsync" / "demo")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=Path("rl_rewards.png"))
    args = parser.parse_args(argv)
    config = RLConfig(steps=args.steps, max_staleness=args.max_staleness, max_in_flight=args.max_in_flight)
    return run_demo_rl(args.cache_dir, config=config, png_path=args.png, json_path=args.json, launcher=RayLauncher())


if __name__ == "__main__":
    sys.exit(main())
