"""Benchmark one trainer rank's whole merge fill: the bench model's EP rank, every box a delta sync sends.

``load_rank`` (the ``TrainerShard`` actor's own path) of rank 0 of ``--ep`` over the
``weightsync bench`` model of ``--size`` (generated into its cache by a bench run first), then per
measured fill: ``snapshot`` → ``source`` → every changed box packed (``pack_bucket``) into one reused,
already-touched 64 MiB bucket. Each ``--tiles`` value (``MergeConfig.tile_bytes``) is measured once per
round, the order reversing every round; medians of ``--rounds`` of the thread's CPU seconds
(``time.thread_time``: the machine is shared, CPU time leaves out the time other jobs got) and wall
seconds. The merged bytes are compared across tile sizes (bitwise).

Usage::

    .venv/bin/python benchmarks/rank_fill_bench.py [--size 1] [--ep 2] [--tiles 1048576,2097152] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from sync_service.bench.model import ensure_model, model_for_size
from sync_service.bench.rows import BenchConfig
from sync_service.live.checkpoint import load_rank
from sync_service.sharding.rules import ShardSpec
from sync_service.streaming import buckets_of, build_plan
from sync_service.streaming.checksum import checksum
from sync_service.streaming.sender import pack_bucket
from sync_service.streaming.views import as_byte_tensor

BUCKET = 64 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=1, help="bench model size (multiples of the 1x model)")
    ap.add_argument("--ep", type=int, default=2, help="expert-parallel ranks; rank 0 is measured")
    ap.add_argument("--tiles", default="1048576,2097152", help="MergeConfig.tile_bytes values, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cache-dir", default=BenchConfig().cache_dir, help="the bench's model cache (default: the bench's)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = ensure_model(model_for_size(args.size), args.cache_dir)
    state = load_rank(model.base_dir, model.adapter_dir, ShardSpec(rank=0, ep=args.ep, tp=1))
    arr = np.zeros(BUCKET, dtype=np.uint8)
    buf, version = as_byte_tensor(arr), 0

    def fill(tile_bytes: int) -> tuple[float, float, int, list[int]]:
        nonlocal version
        version += 1
        state.merge.tile_bytes = tile_bytes
        state.snapshot(version)
        source = state.source(version)
        changed = source.changed_names()
        plan = build_plan([m for m in source.param_metas() if m.name in changed], bucket_bytes=BUCKET)
        digests, cpu, wall = [], 0.0, 0.0
        for entries in buckets_of(plan, 0):
            c, w = time.thread_time(), time.perf_counter()
            n = pack_bucket(source, entries, buf)
            cpu, wall = cpu + time.thread_time() - c, wall + time.perf_counter() - w
            digests.append(checksum(arr[:n]))  # untimed: compares the bytes across tile sizes
        state.drop_snapshot(version)
        return cpu, wall, sum(e.nbytes for e in plan.entries), digests

    tiles = [int(t) for t in args.tiles.split(",")]
    want = fill(tiles[0])[3]  # warm-up: maps the base, allocates the scratch
    cpu: dict[int, list[float]] = {t: [] for t in tiles}
    wall: dict[int, list[float]] = {t: [] for t in tiles}
    for rnd in range(args.rounds):
        for t in (tiles if rnd % 2 == 0 else tiles[::-1]):
            c, w, nbytes, digests = fill(t)
            if digests != want:
                raise SystemExit(f"tile {t}: merged bytes differ from tile {tiles[0]}")
            cpu[t].append(c)
            wall[t].append(w)
    ref = statistics.median(cpu[tiles[0]])
    for t in tiles:
        c, w = statistics.median(cpu[t]), statistics.median(wall[t])
        print(f"tile {t >> 10:6d} KiB: cpu {c:.3f} s ({c / ref:.3f} x tile {tiles[0] >> 10} KiB), wall {w:.3f} s, "
              f"{nbytes / 1e9:.3f} GB merged")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
