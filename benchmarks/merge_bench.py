"""Benchmark ``weightsync merge``: throughput (GB/s of merged output) and peak RSS.

Generates, per size, a synthetic bf16 Qwen3-MoE base (``sync_service.synthetic.make_base``: H=1024,
I=512, E=32, layers chosen to reach the size) and a ``target_parameters`` LoRA adapter (r=16, on
the experts and attention), then runs the ``weightsync merge`` CLI in a subprocess while a thread
samples the resident set size (psutil, process + children, every 10 ms).

GB/s = bytes written / the merge's own seconds (the CLI's JSON summary, without interpreter and
import start-up); wall seconds include start-up. Inputs sit in the page cache (just written).

Usage::

    .venv/bin/python benchmarks/merge_bench.py [--sizes-gb 0.25 1] [--json out.json] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

HIDDEN, INTERMEDIATE, EXPERTS, VOCAB = 1024, 512, 32, 1024
_BF16_BYTES = 2


def layers_for(size_gb: float) -> int:
    """Decoder layers so that the bf16 checkpoint is about ``size_gb`` GB (10^9 bytes)."""
    per_layer = EXPERTS * 3 * HIDDEN * INTERMEDIATE + 3 * HIDDEN * HIDDEN  # experts + q/k/v/o (1 kv head of 2)
    return max(1, round(size_gb * 1e9 / _BF16_BYTES / per_layer))


class RssSampler:
    """Peak RSS (bytes) of a process and its children, sampled in a daemon thread."""

    def __init__(self, pid: int, interval_s: float = 0.01):
        self._proc, self._interval_s = psutil.Process(pid), interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                procs = [self._proc, *self._proc.children(recursive=True)]
                self.peak_bytes = max(self.peak_bytes, sum(p.memory_info().rss for p in procs))
            except psutil.Error:
                pass
            time.sleep(self._interval_s)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def run_one(size_gb: float, workdir: Path) -> dict:
    from sync_service.synthetic import make_adapter, make_base

    base_dir, adapter_dir, out_dir = workdir / "base", workdir / "lora", workdir / "merged"
    t0 = time.perf_counter()
    make_base("qwen3_moe", base_dir, dtype="bfloat16", num_layers=layers_for(size_gb), num_experts=EXPERTS,
              hidden=HIDDEN, intermediate=INTERMEDIATE, vocab_size=VOCAB, max_shard_size="2GB")
    make_adapter("qwen3_moe", base_dir, adapter_dir, kind="target_parameters", r=16, lora_alpha=32)
    gen_s = time.perf_counter() - t0
    cli = Path(sys.executable).with_name("weightsync")
    cmd = [str(cli), "merge", "--base", str(base_dir), "--adapter", str(adapter_dir), "--out", str(out_dir),
           "--no-progress"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with RssSampler(proc.pid) as rss:
        stdout, stderr = proc.communicate(timeout=1800)
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"weightsync merge failed ({proc.returncode}): {stderr[-2000:]}")
    summary = json.loads(stdout.strip().splitlines()[-1])
    shutil.rmtree(workdir)
    return {
        "size_gb_requested": size_gb,
        "bytes": summary["bytes"],
        "tensors": summary["tensors"],
        "changed": summary["changed"],
        "shards": summary["shards"],
        "merge_s": summary["seconds"],
        "wall_s": wall_s,
        "gb_per_s": summary["bytes"] / summary["seconds"] / 1e9,
        "peak_rss_bytes": rss.peak_bytes,
        "generate_s": gen_s,
        "command": " ".join(["weightsync", *cmd[1:]]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[0.25, 1.0], help="checkpoint sizes, GB")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--workdir", type=Path, help="where to generate inputs (default: a temp dir)")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="merge-bench-", dir=args.workdir))
    rows = [run_one(size, root / f"{size:g}gb") for size in args.sizes_gb]
    shutil.rmtree(root, ignore_errors=True)
    print(f"{'GB':>6} {'tensors':>8} {'changed':>8} {'shards':>6} {'merge s':>8} {'wall s':>7} {'GB/s':>6} {'peak RSS GB':>11}")
    for r in rows:
        print(f"{r['bytes'] / 1e9:6.3f} {r['tensors']:8d} {r['changed']:8d} {r['shards']:6d} {r['merge_s']:8.2f} "
              f"{r['wall_s']:7.2f} {r['gb_per_s']:6.2f} {r['peak_rss_bytes'] / 1e9:11.2f}")
    if args.json:
        machine = {"cpus": psutil.cpu_count(), "memory_bytes": psutil.virtual_memory().total, "python": sys.version.split()[0]}
        args.json.write_text(json.dumps({"machine": machine, "runs": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
