"""Measure how a late joiner is brought up: peer copy (what ``WeightSync.add_engine`` does) vs a full
sync from the trainers (the alternative), on the demo model. ``python examples/late_joiner.py [--json PATH]``.

Pushes versions 1-3 to two engines, adds a third engine (peer copy of version 3), pushes version 4
(delta for all three), then — for comparison — a forced full push (``SyncConfig(delta=False)``) to all
three, which is what a join costs when the trainers bring the joiner up over the shared channel.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path


# --medium: a larger Qwen3-MoE (≈ 25 MB fp32) so that timings are above the per-call overheads
MEDIUM = {"num_experts": 8, "hidden": 256, "intermediate": 128, "num_layers": 4, "vocab_size": 4096}


def files(cache_dir: Path, medium: bool, work: Path) -> tuple[Path, Path]:
    from sync_service.synthetic.demo_files import ensure_files
    from sync_service.synthetic import make_adapter, make_base

    if not medium:
        return ensure_files(cache_dir)
    base = make_base("qwen3_moe", work / "base", **MEDIUM)
    return base, make_adapter("qwen3_moe", base, work / "lora", kind="target_parameters", r=8, lora_alpha=16)


def measure(base: Path, adapter: Path, transport: str) -> dict:
    import ray

    from sync_service.api import SyncConfig, WeightSync
    from actors.launch import start_engines, start_trainers

    trainers = start_trainers(base, adapter, ep=2)
    engines = start_engines(base, 2, prefix="engine")
    [joiner] = start_engines(base, 1, prefix="joiner")
    cfg = dict(transport=transport, bucket_bytes=1 << 20)
    sync = WeightSync(trainers=trainers, engines=engines, config=SyncConfig(**cfg))
    rows = {}
    for v in (1, 2, 3):
        ray.get([t.train_step.remote(v) for t in trainers])
        m = sync.push(v)
        rows[f"push {v} ({'full' if m.full else 'delta'}, 2 engines)"] = _row(m.seconds, m.engines, m.merge_s)
    sync.add_engine(joiner)
    j = sync.joins[-1]
    rows[f"join by peer copy ({j.source}, v{j.version})"] = {"seconds": j.seconds, "bytes_per_engine": {j.engine: j.bytes},
                                                             "trainer_merge_s": 0.0}
    ray.get([t.train_step.remote(4) for t in trainers])
    m = sync.push(4)
    rows["push 4 (delta, 3 engines)"] = _row(m.seconds, m.engines, m.merge_s)
    sync.close()
    full = WeightSync(trainers=trainers, engines=engines + [joiner], config=SyncConfig(**cfg, delta=False))
    m = full.push(5)
    rows["push 5 (full from the trainers, 3 engines)"] = _row(m.seconds, m.engines, m.merge_s)
    full.close()
    return rows


def _row(seconds: float, engines, merge_s: float) -> dict:
    return {"seconds": seconds, "bytes_per_engine": {e.engine: e.payload_bytes for e in engines},
            "trainer_merge_s": merge_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "weightsync" / "demo")
    parser.add_argument("--transport", choices=("shm", "ray", "torch"), default="shm")
    parser.add_argument("--medium", action="store_true", help=f"a larger generated model: {MEDIUM}")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    import ray

    from sync_service.entrypoints.sync_cli import quiet_libraries, start_ray

    quiet_libraries()
    tmp = Path(tempfile.mkdtemp(prefix="wsjoin"))
    try:
        start_ray(tmp / "ray")
        rows = measure(*files(args.cache_dir, args.medium, tmp), args.transport)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'step':48s} {'seconds':>8s} {'merge s':>8s}  bytes per engine")
    for name, r in rows.items():
        print(f"{name:48s} {r['seconds']:8.3f} {r['trainer_merge_s']:8.3f}  {r['bytes_per_engine']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
