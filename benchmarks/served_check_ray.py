"""Benchmark the served check inside a push through Ray actors: push seconds with ``check_served`` off / log / enforce.

The deployment's path, next to ``python -m sync_service.bench.served_cost`` (in process, the most pessimistic
ratio): trainer shard actors (``--ep``) and one transformers engine actor (``RolloutEngine``, its own process) over
the same synthetic fp32 Qwen3-MoE as that row (H=512, I=256, E=16, 2 layers, r=8 adapter), three ``WeightSync``s on
the same actors (one per mode: each channel installs its own check, as separate syncs would), every push full
(``delta=False``) over shm, modes interleaved after one untimed round; medians of ``--repeats`` of
``SyncMetrics.seconds`` and the ratios to ``off``.

Usage::

    flock /tmp/heavy.lock .venv/bin/python benchmarks/served_check_ray.py [--repeats 9] [--ep 1]
"""

from __future__ import annotations

import argparse
import shutil
import statistics

MODES = ("off", "log", "enforce")


def measure(repeats: int, ep: int) -> dict[str, float]:
    """``{mode: median push seconds}`` plus ``"payload_bytes"`` (module docstring)."""
    import ray

    from actors.launch import start_engines, start_trainers
    from sync_service.api import SyncConfig, WeightSync
    from sync_service.entrypoints.sync_cli import start_ray
    from sync_service.entrypoints.workdir import ray_temp, run_dir
    from sync_service.synthetic import make_adapter, make_base

    work = run_dir("s")
    try:
        base = make_base("qwen3_moe", work / "base", hidden=512, intermediate=256, num_experts=16)
        lora = make_adapter("qwen3_moe", base, work / "lora", kind="target_parameters", r=8, seed=1)
        start_ray(ray_temp(work))
        trainers = start_trainers(base, lora, ep=ep)
        engines = start_engines(base, 1, prefix="e")
        syncs = {mode: WeightSync(trainers=trainers, engines=engines, config=SyncConfig(
            transport="shm", timeout_s=120, check_served=mode, delta=False)) for mode in MODES}
        seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
        version, payload = 1, 0
        for measured in [False] + [True] * repeats:
            for mode in MODES:
                metrics = syncs[mode].push(version)
                version += 1
                payload = metrics.bytes
                if measured:
                    seconds[mode].append(metrics.seconds)
        for sync in syncs.values():
            sync.close()
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    out = {mode: statistics.median(s) for mode, s in seconds.items()}
    out["payload_bytes"] = float(payload)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--ep", type=int, default=1)
    args = parser.parse_args()
    got = measure(args.repeats, args.ep)
    print(f"full push of {got['payload_bytes'] / 1e6:.1f} MB through Ray actors, median of {args.repeats}:")
    for mode in MODES:
        print(f"  check_served={mode:<8} {got[mode]:.3f} s  ({got[mode] / got['off']:.3f} x off)")


if __name__ == "__main__":
    main()
