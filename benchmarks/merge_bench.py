"""Benchmark the merge: ``weightsync merge`` end to end, and ``MergedSource.fill`` against a plain copy.

End to end (default): throughput (GB/s of merged output) and peak RSS of ``weightsync merge``,
next to a plain safetensors read + write (``load_file`` + ``save_file``) of the same base.

Generates, per size, a synthetic bf16 Qwen3-MoE base (``sync_service.synthetic.make_base``: H=1024,
I=512, E=32, layers chosen to reach the size) and a ``target_parameters`` LoRA adapter (r=16, on
the experts and attention), then runs the ``weightsync merge`` CLI in a subprocess while a thread
samples the resident set size (psutil, process + children, every 10 ms).

GB/s = bytes written / the merge's own seconds (the CLI's JSON summary, without interpreter
start-up; it includes the setup: validation and adapter loading, which imports PEFT); "merge-only"
leaves the setup out. Wall seconds include start-up. Inputs sit in the page cache (just written).
Baseline: ``safetensors.torch.load_file`` + ``save_file`` of the base shards in this process, with
the same torch thread count: "x plain" = merge-only seconds / plain seconds.

``--fill``: in memory, one bf16 expert block [E, 2I, H] with a ``target_parameters`` term
(fp32 factors, rank r): ``MergedSource.fill`` into a preallocated, already-touched output, and a
plain bf16 ``copy_`` of the same bytes into touched memory, interleaved in one run (the machine is
shared: the ratio is what counts). Also fills per-expert boxes (bucket-sized views), and, as a
reference only, a bf16 ``baddbmm`` in place (factors rounded to bf16: not the merge's numerics).

Usage::

    .venv/bin/python benchmarks/merge_bench.py [--sizes-gb 0.25 1] [--json out.json] [--workdir DIR] [--threads 1]
    .venv/bin/python benchmarks/merge_bench.py --fill [--experts 32 --intermediate 512 --hidden 2048 --rank 16]
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


def plain_read_write(base_dir: Path, out_dir: Path) -> float:
    """Seconds to ``load_file`` + ``save_file`` every base shard (the floor a merge is compared to)."""
    from safetensors.torch import load_file, save_file

    out_dir.mkdir()
    t0 = time.perf_counter()
    for path in sorted(base_dir.glob("*.safetensors")):
        save_file(load_file(str(path)), str(out_dir / path.name), metadata={"format": "pt"})
    seconds = time.perf_counter() - t0
    shutil.rmtree(out_dir)
    return seconds


def run_one(size_gb: float, workdir: Path, threads: int) -> dict:
    from sync_service.synthetic import make_adapter, make_base

    base_dir, adapter_dir, out_dir = workdir / "base", workdir / "lora", workdir / "merged"
    t0 = time.perf_counter()
    make_base("qwen3_moe", base_dir, dtype="bfloat16", num_layers=layers_for(size_gb), num_experts=EXPERTS,
              hidden=HIDDEN, intermediate=INTERMEDIATE, vocab_size=VOCAB, max_shard_size="2GB")
    make_adapter("qwen3_moe", base_dir, adapter_dir, kind="target_parameters", r=16, lora_alpha=32)
    gen_s = time.perf_counter() - t0
    cli = Path(sys.executable).with_name("weightsync")
    cmd = [str(cli), "merge", "--base", str(base_dir), "--adapter", str(adapter_dir), "--out", str(out_dir),
           "--no-progress", "--threads", str(threads)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with RssSampler(proc.pid) as rss:
        stdout, stderr = proc.communicate(timeout=1800)
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"weightsync merge failed ({proc.returncode}): {stderr[-2000:]}")
    summary = json.loads(stdout.strip().splitlines()[-1])
    plain_s = plain_read_write(base_dir, workdir / "plain")
    shutil.rmtree(workdir)
    merge_only_s = summary["seconds"] - summary["setup_seconds"]
    return {
        "size_gb_requested": size_gb,
        "bytes": summary["bytes"],
        "tensors": summary["tensors"],
        "changed": summary["changed"],
        "shards": summary["shards"],
        "merge_s": summary["seconds"],
        "wall_s": wall_s,
        "setup_s": summary["setup_seconds"],
        "gb_per_s": summary["bytes"] / summary["seconds"] / 1e9,
        "merge_only_gb_per_s": summary["bytes"] / merge_only_s / 1e9,
        "plain_s": plain_s,
        "ratio_to_plain": merge_only_s / plain_s,
        "threads": threads,
        "load": _load(),
        "peak_rss_bytes": rss.peak_bytes,
        "generate_s": gen_s,
        "command": " ".join(["weightsync", *cmd[1:]]),
    }


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) of ``fn()``; with one torch thread the CPU time
    leaves out the time the shared machine's scheduler gave to other jobs."""
    w0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - w0, time.thread_time() - c0


def run_fill(experts: int, intermediate: int, hidden: int, rank: int, repeats: int) -> dict:
    """``MergedSource.fill`` of a bf16 [E, 2I, H] gate_up_proj vs a plain bf16 copy, interleaved."""
    import statistics

    import torch

    from protocols.params import full_box
    from sync_service.merge.terms import LoraAdapter, LoraTerm
    from sync_service.merge.base import TensorDictBase
    from sync_service.merge.source import MergeConfig, MergedSource

    name = "model.layers.0.mlp.experts.gate_up_proj"
    gen = torch.Generator().manual_seed(0)
    shape = (experts, 2 * intermediate, hidden)
    base = torch.randn(shape, generator=gen).to(torch.bfloat16)
    x = torch.randn(experts, 2 * intermediate, rank, generator=gen) * 0.05
    y = torch.randn(experts, rank, hidden, generator=gen) * 0.05
    scaling = 2.0
    term = LoraTerm((0, experts), (0, 2 * intermediate, 1), (0, hidden, 1), x, y, scaling)
    source = MergedSource(TensorDictBase({name: base}), LoraAdapter(terms={name: [term]}), config=MergeConfig())
    out, copy_dst, ref_out = (torch.zeros(shape, dtype=torch.bfloat16) for _ in range(3))  # touched
    x16, y16 = x.to(torch.bfloat16), y.to(torch.bfloat16)
    box = full_box(shape)

    def fill_experts() -> None:
        for e in range(experts):
            source.fill(name, ((e, e + 1),) + box[1:], out[e:e + 1])

    steps = {
        "copy": lambda: copy_dst.copy_(base),
        "fill": lambda: source.fill(name, box, out),
        "fill_experts": fill_experts,
        "bf16_baddbmm": lambda: torch.baddbmm(base, x16, y16, alpha=scaling, out=ref_out),
    }
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in steps}
    for _ in range(repeats + 1):  # the first round warms up
        for key, fn in steps.items():
            times[key].append(_timed(fn))
    nbytes = base.numel() * base.element_size()
    reference = base.float().baddbmm_(x, y, alpha=scaling).to(torch.bfloat16)
    source.fill(name, box, out)
    wall = {k: statistics.median(w for w, _ in v[1:]) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v[1:]) for k, v in times.items()}
    return {
        "shape": list(shape), "rank": rank, "bytes": nbytes, "threads": torch.get_num_threads(),
        "gb_per_s": {k: nbytes / t / 1e9 for k, t in wall.items()},
        "ratio_to_copy": {k: wall["copy"] / t for k, t in wall.items()},
        "cpu_gb_per_s": {k: nbytes / t / 1e9 for k, t in cpu.items()},
        "cpu_ratio_to_copy": {k: cpu["copy"] / t for k, t in cpu.items()},
        "bitwise_fraction": float((out.view(torch.int16) == reference.view(torch.int16)).float().mean()),
        "peak_staging_bytes": source.peak_staging_bytes,
        "load": _load(),
    }


def _load() -> str:
    import os

    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def print_fill(r: dict) -> None:
    print(f"fill bench: bf16 {r['shape']} r={r['rank']} ({r['bytes'] / 1e6:.0f} MB), threads={r['threads']}, "
          f"load {r['load']}, bitwise vs fp32 reference {r['bitwise_fraction']:.4f}")
    print(f"{'path':>14} {'wall GB/s':>10} {'x copy':>7} {'CPU GB/s':>9} {'x copy':>7}   (medians)")
    for k, v in r["gb_per_s"].items():
        print(f"{k:>14} {v:10.2f} {r['ratio_to_copy'][k]:7.3f} {r['cpu_gb_per_s'][k]:9.2f} {r['cpu_ratio_to_copy'][k]:7.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[0.25, 1.0], help="checkpoint sizes, GB")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--workdir", type=Path, help="where to generate inputs (default: a temp dir)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--fill", action="store_true", help="in-memory fill micro-benchmark instead of end to end")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds of the fill micro-benchmark")
    args = parser.parse_args(argv)
    if args.fill:
        import torch

        torch.set_num_threads(args.threads)
        result = run_fill(args.experts, args.intermediate, args.hidden, args.rank, args.repeats)
        print_fill(result)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    import torch

    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="merge-bench-", dir=args.workdir))
    rows = [run_one(size, root / f"{size:g}gb", args.threads) for size in args.sizes_gb]
    shutil.rmtree(root, ignore_errors=True)
    print(f"{'GB':>6} {'tensors':>8} {'changed':>8} {'shards':>6} {'merge s':>8} {'setup s':>8} {'wall s':>7} "
          f"{'GB/s':>6} {'merge-only GB/s':>15} {'plain s':>8} {'x plain':>7} {'peak RSS GB':>11}  load")
    for r in rows:
        print(f"{r['bytes'] / 1e9:6.3f} {r['tensors']:8d} {r['changed']:8d} {r['shards']:6d} {r['merge_s']:8.2f} "
              f"{r['setup_s']:8.2f} {r['wall_s']:7.2f} {r['gb_per_s']:6.3f} {r['merge_only_gb_per_s']:15.3f} "
              f"{r['plain_s']:8.2f} {r['ratio_to_plain']:7.2f} {r['peak_rss_bytes'] / 1e9:11.2f}  {r['load']}")
    if args.json:
        machine = {"cpus": psutil.cpu_count(), "memory_bytes": psutil.virtual_memory().total, "python": sys.version.split()[0]}
        args.json.write_text(json.dumps({"machine": machine, "runs": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
