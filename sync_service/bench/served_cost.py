"""What the served check costs a push: push seconds with ``check_served`` off / log / enforce in one run.

    python -m sync_service.bench.served_cost [--hidden 512] [--experts 16] [--repeats 3]   # this row alone

``weightsync bench`` runs it too, after the factor-streaming row (``report["served_check"]``, one printed line).

An in-process sync (``factor_stream.LocalSync``, merged mode: trainer threads → shm buckets → a memory engine)
of a synthetic fp32 Qwen3-MoE, every push a full one; the engine is the receiver's updater as in a rollout actor:
itself (``off``) or the served check's ``AppliedDigests`` in front of it with the check in its gate (``log``,
``enforce``; ``engines.served_check.install``, once per mode as a channel open does). Modes are interleaved after
one untimed round, each run ``repeats`` times; the median seconds per mode and the ratio to ``off`` are printed
(the goal: <= 1.05).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

__all__ = ["measure"]


def measure(work: Path, *, hidden: int = 512, intermediate: int = 256, experts: int = 16,
            repeats: int = 3) -> dict[str, float]:
    """``{mode: median push seconds}`` plus ``"payload_bytes"`` (module docstring)."""
    from peft import PeftConfig
    from safetensors.torch import load_file

    from protocols.params import full_box
    from sync_service.engines.served_check import install
    from sync_service.factor_stream.local import LocalSync, LocalSyncConfig
    from sync_service.merge.base import SafetensorsBase
    from sync_service.synthetic import make_adapter, make_base

    base = make_base("qwen3_moe", work / "base", hidden=hidden, intermediate=intermediate, num_experts=experts)
    lora = make_adapter("qwen3_moe", base, work / "lora", kind="target_parameters", r=8, seed=1)
    ckpt = SafetensorsBase(base)
    tensors = {m.name: ckpt.read(m.name, full_box(m.shape)).clone() for m in ckpt.metas()}
    state = load_file(str(Path(lora) / "adapter_model.safetensors"))
    run = LocalSync(tensors, ckpt.layout, PeftConfig.from_pretrained(str(lora)), config=LocalSyncConfig(bucket_bytes=16 << 20))
    seconds: dict[str, list[float]] = {"off": [], "log": [], "enforce": []}
    try:
        stats = run.push(0, state, full=True)  # plan, staging buffers, first touch
        # as a rollout actor does at channel open: one check per channel owner, installed once (here one per mode)
        updaters = {mode: run.memory if mode == "off" else install(run.memory, mode, "bench", mode) for mode in seconds}
        version = 1
        for measured in [False] + [True] * repeats:  # one untimed round: each check's scratch, first touch
            for mode in seconds:
                run.engine = updaters[mode]
                pushed = run.push(version, state, full=True).seconds
                version += 1
                if measured:
                    seconds[mode].append(pushed)
    finally:
        run.close()
    out = {mode: statistics.median(s) for mode, s in seconds.items()}
    out["payload_bytes"] = float(stats.bytes)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m sync_service.bench.served_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="wsserved") as tmp:
        got = measure(Path(tmp), hidden=args.hidden, intermediate=args.intermediate, experts=args.experts,
                      repeats=args.repeats)
    print(f"full push of {got['payload_bytes'] / 1e6:.1f} MB, median of {args.repeats}:")
    for mode in ("off", "log", "enforce"):
        print(f"  check_served={mode:<8} {got[mode]:.3f} s  ({got[mode] / got['off']:.3f} x off)")


if __name__ == "__main__":
    main()
