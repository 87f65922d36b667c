"""Benchmark the engine's receive side: checksum fused with the copy (``ChunkedApply``) against
verify-then-copy, with 1 and 4 engines reading one shm ring.

One sender (this process: ``TensorSource`` fill + per-entry xxh3) streams ``--gib`` of bf16 tensors in
64 MiB buckets through a shm ring to ``--engines`` receiver processes, each a ``MemoryEngine`` behind
``BucketReceiver`` (staging reserved first). Every round runs one sync in each mode, the order
swapping every round, so both modes share the machine's load; the engine mode is either the engine
as is (``fused``: it declares ``ChunkedApply``) or wrapped so it does not (``verify_first``: the
receiver hashes each bucket, then the apply thread copies it). Reported per mode: the sync's wall
seconds (sender's ``send_sync``, until every engine acked) and each engine process's CPU seconds
(``time.process_time`` over the sync), medians over the rounds.

Usage::

    .venv/bin/python benchmarks/receive_bench.py [--gib 0.25] [--engines 1,4] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
import uuid

import torch

BUCKET = 64 << 20


def _tensors(gib: float) -> dict[str, torch.Tensor]:
    n = max(1, round(gib * (1 << 30) / (16 << 20)))  # [8, 1024, 1024] bf16 = 16 MiB each
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(8, 1024, 1024, generator=g).bfloat16() for i in range(n)}


class VerifyFirst:
    """An engine wrapper without ``ChunkedApply``: the receiver verifies each bucket before any apply."""

    def __init__(self, engine):
        self.engine = engine
        for name in ("param_metas", "weight_version", "begin_update", "apply", "finish_update", "commit", "abort",
                     "reset_caches"):
            setattr(self, name, getattr(engine, name))


def _engine(spec_bytes: bytes, index: int, gib: float, cmd, out) -> None:
    torch.set_num_threads(1)
    from sync_service.engines.memory import MemoryEngine
    from sync_service.streaming import BucketReceiver, build_plan
    from sync_service.streaming.tensor_source import TensorSource
    from sync_service.transports import TransportSpec, open_receiver

    ts = _tensors(gib)
    engine = MemoryEngine({n: torch.zeros_like(t) for n, t in ts.items()})
    engine.reserve_staging(list(ts))
    plan = build_plan(TensorSource(ts).param_metas(), bucket_bytes=BUCKET)
    rx = open_receiver(TransportSpec.from_bytes(spec_bytes), receiver=index)
    adapters = {"fused": engine, "verify_first": VerifyFirst(engine)}
    while (mode := cmd.get()) is not None:
        c = time.process_time()
        stats = BucketReceiver(adapters[mode], plan, receiver=index).receive_sync(rx, timeout_s=600, commit=True)
        out.put((mode, time.process_time() - c, stats.verify_s, stats.apply_s))
    rx.close()


def run(gib: float, engines: int, rounds: int) -> dict:
    from sync_service.streaming import BucketPool, Sender, build_plan
    from sync_service.streaming.tensor_source import TensorSource
    from sync_service.transports import TransportSpec, open_sender

    ctx = mp.get_context("spawn")
    spec = TransportSpec(kind="shm", name="rb" + uuid.uuid4().hex[:10], num_receivers=engines, bucket_bytes=BUCKET,
                         slots=3, connect_timeout_s=120)
    cmds, out = [ctx.Queue() for _ in range(engines)], ctx.Queue()
    procs = [ctx.Process(target=_engine, args=(spec.to_bytes(), i, gib, cmds[i], out), daemon=True) for i in range(engines)]
    for p in procs:
        p.start()
    src = TensorSource(_tensors(gib))
    plan = build_plan(src.param_metas(), bucket_bytes=BUCKET)
    tx, pool = open_sender(spec, 0), BucketPool(bucket_bytes=BUCKET)
    res: dict = {m: {"wall_s": [], "engine_cpu_s": [], "verify_s": [], "apply_s": []} for m in ("fused", "verify_first")}
    try:
        for rnd in range(rounds + 1):  # round 0: warm-up, not recorded
            for mode in (("fused", "verify_first") if rnd % 2 else ("verify_first", "fused")):
                for q in cmds:
                    q.put(mode)
                t = time.perf_counter()
                Sender(tx, pool).send_sync(f"s{rnd}{mode}", 2 * rnd + (mode == "fused") + 1, src, plan, timeout_s=600)
                wall = time.perf_counter() - t
                got = [out.get(timeout=600) for _ in range(engines)]
                if rnd:
                    res[mode]["wall_s"].append(wall)
                    for key, i in (("engine_cpu_s", 1), ("verify_s", 2), ("apply_s", 3)):
                        res[mode][key].append(statistics.mean(g[i] for g in got))
    finally:
        for q in cmds:
            q.put(None)
        for p in procs:
            p.join(30)
        tx.close()
    return {m: {k: statistics.median(v) for k, v in d.items()} | {"runs": d} for m, d in res.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=0.25, help="payload per sync, GiB")
    ap.add_argument("--engines", default="1,4", help="engine counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds (each: one sync per mode)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = {}
    for n in (int(x) for x in args.engines.split(",")):
        r = results[n] = run(args.gib, n, args.rounds)
        for m in ("verify_first", "fused"):
            print(f"{n} engine(s) {m:12s}: wall {r[m]['wall_s']:.3f} s, engine CPU {r[m]['engine_cpu_s']:.3f} s "
                  f"(verify {r[m]['verify_s']:.3f}, apply {r[m]['apply_s']:.3f})", flush=True)
        print(f"{n} engine(s) fused / verify_first: wall {r['fused']['wall_s'] / r['verify_first']['wall_s']:.3f}, "
              f"engine CPU {r['fused']['engine_cpu_s'] / r['verify_first']['engine_cpu_s']:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gib": args.gib, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
