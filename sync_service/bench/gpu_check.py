"""The prepared device check (``scripts/gpu-check.sh``): four figures of the device path, one line each.

    python -m sync_service.bench.gpu_check --device cuda [--size 4G]     # on a GPU machine (H200)
    python -m sync_service.bench.gpu_check --device cpu                  # the same functions on CPU

Prints ``check N name: figure PASS|FAIL`` per check as each finishes and exits 1 on any FAIL. Needs neither Ray
nor vLLM (the GPU machine has neither, and nothing is installed there): processes are started with
``torch.multiprocessing`` (spawn) and the endpoints are driven directly, as the coordinator would drive them
through Ray. Each check runs in a process of its own under ``--check-timeout`` (default 180 s; its whole process
group is killed past it and the check is a FAIL line saying so), so one hung check cannot hold the device's
15 minutes; the default order runs the slowest (3, two processes and PEFT merges) last. ``--checks 2,1`` picks
checks and their order. A lent device runs it once with a timeout that leaves room for a rerun of what failed.

1. ``merge_pack``: ``MergedSource.fill`` of a bf16 expert set (fused gate_up / down, LoRA on both) packed
   into device buckets (``pack_bucket``), GB/s against a device-to-device copy of the same bytes; goal >= 0.5.
2. ``cuda_ipc``: buckets through the ``cuda_ipc`` transport to another process that copies each one out,
   GB/s against a device-to-device copy; goal >= 0.8 on CUDA (on CPU: the bytes arrive intact; figure only).
3. ``endpoints``: a trainer process syncs a full version and a delta into an HF engine process
   (``gpu_check_e2e.py``), each served version compared with PEFT's float64 merge.
4. ``factor_mode``: factor streaming's receiver merge bitwise equal to merged mode (``LocalSync``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

MERGE_GOAL = 0.5
"""Check 1: merge + pack GB/s over D2D copy GB/s, at least (the merge reads base and factors, writes once)."""
IPC_GOAL = 0.8
"""Check 2: the IPC transport's GB/s over D2D copy GB/s, at least (CUDA only)."""


@dataclass(kw_only=True, slots=True)
class CheckConfig:
    """What one run of the check measures."""

    device: str
    """``"cuda"`` (or ``"cuda:N"``) or ``"cpu"``: where buckets, bases and engines live."""
    size_bytes: int
    """Bytes merged and packed (check 1) and moved through the IPC transport (check 2)."""
    workdir: Path
    """Scratch directory for the synthetic checkpoints and adapters."""

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


@dataclass(frozen=True, slots=True)
class CheckResult:
    number: int
    name: str
    figure: str
    passed: bool

    def line(self) -> str:
        return f"check {self.number} {self.name}: {self.figure} {'PASS' if self.passed else 'FAIL'}"


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def copy_gbps(nbytes: int, device: str, repeats: int = 3) -> float:
    """GB/s of one ``copy_`` of ``nbytes`` between two buffers already allocated and touched on ``device``."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def expert_files(cfg: CheckConfig, *, layers: int = 1) -> tuple[Path, Path]:
    """A bf16 qwen3_moe base and a ``target_parameters`` LoRA on its experts, built once in ``cfg.workdir``:
    on CUDA wide enough that one layer's experts (~600 MB) stream from HBM, not from cache."""
    from sync_service.synthetic import make_adapter, make_base

    dims = dict(num_experts=64, hidden=2048, intermediate=768) if cfg.cuda else dict(num_experts=8, hidden=64,
                                                                                      intermediate=32)
    root = cfg.workdir / f"experts-{'cuda' if cfg.cuda else 'cpu'}-{layers}"
    if not (root / "lora" / "adapter_model.safetensors").exists():
        base = make_base("qwen3_moe", root / "base", dtype="bfloat16", num_layers=layers, **dims)
        make_adapter("qwen3_moe", base, root / "lora", kind="target_parameters", r=8)
    return root / "base", root / "lora"


def merged_source(base_dir: Path, adapter_dir: Path, device: str):
    """``MergedSource`` over the base and adapter, every tensor on ``device``."""
    from peft import PeftConfig
    from safetensors.torch import load_file

    from protocols.params import full_box
    from sync_service.merge.adapter import adapter_from_state_dict
    from sync_service.merge.base import SafetensorsBase, TensorDictBase
    from sync_service.merge.source import MergeConfig, MergedSource

    disk = SafetensorsBase(base_dir)
    base = TensorDictBase({m.name: disk.read(m.name, full_box(m.shape)).to(device) for m in disk.metas()})
    state = {k: v.to(device) for k, v in load_file(str(adapter_dir / "adapter_model.safetensors")).items()}
    adapter = adapter_from_state_dict(PeftConfig.from_pretrained(str(adapter_dir)), state, disk.layout, base.metas())
    return MergedSource(base, adapter, config=MergeConfig())


def check_merge_pack(cfg: CheckConfig) -> CheckResult:
    """Check 1: merge + pack of the expert tensors into device buckets, passes until ``size_bytes`` moved."""
    from sync_service.streaming import build_plan
    from sync_service.streaming.plan import buckets_of
    from sync_service.streaming.sender import pack_bucket

    source = merged_source(*expert_files(cfg), cfg.device)
    experts = [m for m in source.param_metas() if ".experts." in m.name]
    bucket_bytes = (256 << 20) if cfg.cuda else (1 << 20)
    buckets = buckets_of(build_plan(experts, bucket_bytes=bucket_bytes), 0)
    per_pass = sum(e.nbytes for b in buckets for e in b)
    bufs = [torch.zeros(bucket_bytes, dtype=torch.uint8, device=cfg.device) for _ in range(2)]
    passes = max(1, -(-cfg.size_bytes // per_pass))
    pack_bucket(source, buckets[0], bufs[0])  # warm-up: scratch buffers, kernels
    synchronize(cfg.device)
    t = time.perf_counter()
    for _ in range(passes):
        for k, entries in enumerate(buckets):
            pack_bucket(source, entries, bufs[k % 2])
    synchronize(cfg.device)
    gbps = passes * per_pass / (time.perf_counter() - t) / 1e9
    ratio = gbps / copy_gbps(bucket_bytes, cfg.device)
    goal = f"goal >= {MERGE_GOAL}" if cfg.cuda else "no goal on CPU"
    return CheckResult(1, "merge_pack", f"{gbps:.2f} GB/s = {ratio:.2f} x D2D copy ({passes * per_pass / 1e9:.2f} GB, "
                       f"{goal})", ratio >= MERGE_GOAL or not cfg.cuda)


def check_ipc(cfg: CheckConfig) -> CheckResult:
    """Check 2: ``cuda_ipc`` frames to a receiver process that copies each payload out (``gpu_check_ipc``)."""
    from sync_service.bench.gpu_check_ipc import run_ipc

    gbps, intact = run_ipc(cfg.device, cfg.size_bytes, (256 << 20) if cfg.cuda else (1 << 20))
    ratio = gbps / copy_gbps((256 << 20) if cfg.cuda else (1 << 20), cfg.device)
    goal = f"goal >= {IPC_GOAL}" if cfg.cuda else "no goal on CPU"
    return CheckResult(2, "cuda_ipc", f"{gbps:.2f} GB/s = {ratio:.2f} x D2D copy, bytes {'intact' if intact else 'CORRUPT'} "
                       f"({goal})", intact and (ratio >= IPC_GOAL or not cfg.cuda))


def check_endpoints(cfg: CheckConfig) -> CheckResult:
    """Check 3: full + delta sync between a trainer and an HF engine process, against PEFT's float64 merge."""
    from sync_service.bench.gpu_check_e2e import run_endpoints

    report = run_endpoints(cfg.device, expert_files(CheckConfig(device="cpu", size_bytes=0, workdir=cfg.workdir)),
                           cfg.workdir)
    return CheckResult(3, "endpoints", report.figure, report.ok)


def check_factor_mode(cfg: CheckConfig) -> CheckResult:
    """Check 4: three versions pushed merged and as factors; both engines bitwise equal after each."""
    from peft import PeftConfig
    from safetensors.torch import load_file

    from protocols.params import full_box
    from sync_service.factor_stream.choose import FactorPolicy
    from sync_service.factor_stream.local import LocalSync, LocalSyncConfig
    from sync_service.merge.base import SafetensorsBase
    from sync_service.sharding.training import step_delta

    base_dir, adapter_dir = expert_files(CheckConfig(device="cpu", size_bytes=0, workdir=cfg.workdir))
    disk = SafetensorsBase(base_dir)
    tensors = {m.name: disk.read(m.name, full_box(m.shape)).clone() for m in disk.metas()}
    peft_config, state = PeftConfig.from_pretrained(str(adapter_dir)), load_file(str(adapter_dir / "adapter_model.safetensors"))
    runs = {mode: LocalSync(tensors, disk.layout, peft_config, config=LocalSyncConfig(
        bucket_bytes=64 << 10, policy=FactorPolicy(mode=mode, experts_per_recipe=2))) for mode in ("merged", "factors")}
    differing: list[str] = []
    try:
        for v in range(3):
            state = {k: x + step_delta(k, tuple(x.shape), v, 0.02).to(x.dtype) for k, x in state.items()} if v else state
            for run in runs.values():
                run.push(v, state)
            a, b = runs["merged"].engine_state(), runs["factors"].engine_state()
            differing += [f"v{v}:{n}" for n in a if not torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8))]
    finally:
        for run in runs.values():
            run.close()
    figure = f"{len(tensors)} tensors x 3 versions, {len(differing)} differ{(': ' + ', '.join(differing[:3])) if differing else ''}"
    return CheckResult(4, "factor_mode", figure + " (receiver merge on CPU)", not differing)


CHECKS: dict[int, Callable[[CheckConfig], CheckResult]] = {
    1: check_merge_pack, 2: check_ipc, 3: check_endpoints, 4: check_factor_mode}


def run_check(number: int, cfg: CheckConfig) -> CheckResult:
    """One check; an exception is its FAIL line (the figure names the error)."""
    try:
        return CHECKS[number](cfg)
    except Exception as exc:  # reported, not raised: the other checks still run
        name = CHECKS[number].__name__.removeprefix("check_")
        first = (str(exc).strip().splitlines() or [""])[0]
        return CheckResult(number, name, f"error {type(exc).__name__}: {first[:300]}", False)


def parse_size(text: str) -> int:
    """``"4G"``, ``"512M"``, ``"64K"`` or bytes → bytes. Raises ValueError naming the flag."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1:].upper() in units else int(text)
    except (ValueError, IndexError):
        raise ValueError(f"--size={text!r}: give bytes or a number with K, M or G (e.g. 4G)") from None


DEFAULT_ORDER = "1,2,4,3"
"""The slowest check (3) last: a timed-out run still printed the other three."""


def _run_isolated(number: int, args, workdir: Path) -> CheckResult:
    """Check ``number`` in a child process (its own session) under ``args.check_timeout`` seconds; past it the
    child's whole process group is killed and the check is a FAIL line naming the timeout."""
    cmd = [sys.executable, "-m", "sync_service.bench.gpu_check", "--device", args.device, "--checks", str(number),
           "--in-process", "--workdir", str(workdir)] + (["--size", args.size] if args.size else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=args.check_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return CheckResult(number, CHECKS[number].__name__.removeprefix("check_"),
                           f"timed out after {args.check_timeout:g} s (--check-timeout; process group killed)", False)
    line = next((ln for ln in out.splitlines() if ln.startswith(f"check {number} ")), None)
    if line is None:
        last = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return CheckResult(number, CHECKS[number].__name__.removeprefix("check_"), f"error: {last[:300]}", False)
    figure, verdict = line.split(": ", 1)[1].rsplit(" ", 1)
    return CheckResult(number, CHECKS[number].__name__.removeprefix("check_"), figure, verdict == "PASS")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", default=None, help="bytes for checks 1-2 (default 4G on CUDA, 32M on CPU)")
    parser.add_argument("--checks", default=DEFAULT_ORDER,
                        help=f"comma-separated check numbers, run in this order (default {DEFAULT_ORDER}: the slowest last)")
    parser.add_argument("--check-timeout", type=float, default=180.0,
                        help="seconds per check; past it the check's processes are killed and it is a FAIL (default 180)")
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device={args.device}: no CUDA device here; use --device cpu", file=sys.stderr)
        return 2
    try:
        numbers = [int(n) for n in args.checks.split(",")]
        if not numbers or any(n not in CHECKS for n in numbers):
            raise ValueError
        size = parse_size(args.size or ("4G" if args.device.startswith("cuda") else "32M"))
    except ValueError as exc:
        print(str(exc) if str(exc) else f"--checks={args.checks!r}: give check numbers from {sorted(CHECKS)}, e.g. 2,1",
              file=sys.stderr)
        return 2
    failed = False
    with tempfile.TemporaryDirectory(prefix="weightsync-gpu-check-") as tmp:
        workdir = Path(args.workdir or tmp)
        for number in numbers:
            if args.in_process:
                result = run_check(number, CheckConfig(device=args.device, size_bytes=size, workdir=workdir))
            else:
                result = _run_isolated(number, args, workdir)
            print(result.line(), flush=True)
            failed |= not result.passed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
