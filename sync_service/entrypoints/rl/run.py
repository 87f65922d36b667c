"""Entry point of the toy GRPO run (``weightsync demo --rl``, ``examples/rl_loop.py``): start a local
Ray, run ``run_rl`` on the demo model (both runs), print the curves, write the PNG and JSON."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from sync_service.entrypoints.rl.config import RLConfig
from sync_service.entrypoints.rl.loop import RLResult, run_rl, window_means
from sync_service.entrypoints.workdir import run_dir, ray_temp

__all__ = ["run_demo_rl", "rose"]

MIN_RISE = 0.2
"""The synced run's last window must beat its first by this much (reward is a fraction in [0, 1])."""
MAX_CONTROL_RISE = 0.1
"""The control's last window may beat its first by at most this much."""


def rose(result: RLResult) -> tuple[bool, bool]:
    """(the synced reward rose by >= MIN_RISE, the control's rose by < MAX_CONTROL_RISE) over the windows."""
    w = result.config["window"]
    s0, s1 = window_means(result.synced.rewards, w)
    c0, c1 = window_means(result.control.rewards, w)
    return s1 - s0 >= MIN_RISE, c1 - c0 < MAX_CONTROL_RISE


def run_demo_rl(cache_dir: Path, *, config: RLConfig, png_path: Path | None, json_path: Path | None, launcher) -> int:
    """Run both curves on the cached demo model (``launcher``: ``protocols.endpoints.Launcher``); 0 if
    the synced reward rose and the control did not."""
    from sync_service.synthetic.demo_files import DEMO_MODEL, ensure_files
    from sync_service.entrypoints.rl.plot import save_reward_plot
    from sync_service.entrypoints.sync_cli import quiet_libraries, start_ray

    import ray

    quiet_libraries()
    base, adapter = ensure_files(cache_dir)
    tmp = run_dir("rl")
    try:
        start_ray(ray_temp(tmp))
        result = run_rl(base, adapter, config, vocab_size=DEMO_MODEL["vocab_size"], launcher=launcher)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    print(" step  reward  control  rollout versions (synced)  lag")
    for t, (r, c, v, lag) in enumerate(zip(result.synced.rewards, result.control.rewards, result.synced.versions,
                                           result.synced.lag)):
        print(f"{t:5d}  {r:6.3f}  {c:7.3f}  {str(v):26s}  {lag:3d}")
    w = config.window
    (s0, s1), (c0, c1) = window_means(result.synced.rewards, w), window_means(result.control.rewards, w)
    ok_sync, ok_control = rose(result)
    print(f"reward, first vs last {w} steps: synced {s0:.3f} -> {s1:.3f}, control {c0:.3f} -> {c1:.3f}; "
          f"{result.synced.seconds:.1f} s + {result.control.seconds:.1f} s")
    if png_path is not None:
        print(f"reward curves: {save_reward_plot(result, png_path)}")
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result.to_json(), indent=1) + "\n")
        print(f"results: {json_path}")
    if not (ok_sync and ok_control):
        print(f"FAILED: synced rise >= {MIN_RISE}: {ok_sync}; control rise < {MAX_CONTROL_RISE}: {ok_control}",
              file=sys.stderr)
        return 1
    return 0
