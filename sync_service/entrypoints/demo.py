"""``weightsync demo``: the whole product on a fresh machine, no arguments.

Generates (once, cached under ``~/.cache/weightsync/demo`` or ``--cache-dir``) a small real
Qwen3-MoE checkpoint and a PEFT LoRA adapter on attention + experts (``target_parameters``), starts
a local Ray with 2 trainer shards (EP=2) and 2 transformers rollout engines, pushes 3 versions
(the factors change between versions as a training step would) and verifies each on every engine
(see ``sync_cli``). Exits non-zero if anything is unverified.

``weightsync demo --rl`` runs the toy GRPO loop instead (``sync_service.entrypoints.rl``): trainers learn from
rewards while ``push_async`` refreshes the engines, plus a control run with sync disabled; writes the
reward curves as a PNG (``--png``) and, with ``--json``, ``reward_curve`` / ``control_reward_curve`` /
``versions_seen``. Exits non-zero unless the synced reward rose and the control's did not.

``weightsync demo --trainer fsdp2|ddp|ep|hsdp|fsdp2-tp|fsdp2-ep|tp-ep`` runs a live training loop instead of trainer shards:
2 training ranks (4 on the 2-D meshes) train the demo model with AdamW and weightsync reads their live PEFT model in place
(``sync_service.entrypoints.demo_live``); every version is verified against PEFT's float64 merge.
``--trainer megatron|megatron-pp``: 4 Megatron-Core ranks with Megatron-Bridge LoRA train with Megatron's own step and
every version is verified against Megatron's own forward (``sync_service.entrypoints.demo_megatron``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sync_service.entrypoints.demo_live import TRAINERS
from sync_service.entrypoints.demo_megatron import MEGATRON_TRAINERS
from sync_service.entrypoints.preflight import check_run_arguments, check_transport, fail, resolve_engines, resolve_parallel
from sync_service.entrypoints.sync_cli import RunConfig, add_common_arguments, execute_engine, quiet_libraries, version_options
from sync_service.entrypoints.sync_args import absolute_path
from sync_service.synthetic.demo_files import DEMO_ADAPTER, DEMO_MODEL, ensure_files, ensure_tp_base

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", type=absolute_path, default=Path.home() / ".cache" / "weightsync" / "demo",
                        help="where the generated checkpoint + adapter are cached (default ~/.cache/weightsync/demo)")
    add_common_arguments(parser, versions=3)
    parser.add_argument("--rl", action="store_true",
                        help="run the toy GRPO loop with live weight refresh (and a control run without sync)")
    parser.add_argument("--trainer", choices=(*TRAINERS, *MEGATRON_TRAINERS), default=None,
                        help="sync a live training loop instead of trainer shards (fsdp2, ddp, ep: 2 ranks; "
                             "hsdp: replicate 2 x shard 2, fsdp2-tp: shard 2 x tp 2, fsdp2-ep: dp 2 x ep 2, tp-ep: ep 2 x tp 2, "
                             "4 ranks); verified against "
                             "PEFT's float64 merge; megatron: Megatron-Core tp 2 x dp 2, experts ep 2 x etp 2, megatron-pp: "
                             "tp 2 x pp 2, 4 ranks, verified against Megatron's own forward)")
    parser.add_argument("--png", type=absolute_path, default=Path("weightsync_rl_rewards.png"),
                        help="--rl: where the reward-curve PNG goes (default ./weightsync_rl_rewards.png)")


def run(args: argparse.Namespace) -> int:
    if args.rl:
        if args.trainer is not None:
            fail(args, f"--rl trains its own trainer shards; drop --trainer {args.trainer} (or --rl)")
        check_run_arguments(args)
        from sync_service.entrypoints.rl import RLConfig
        from sync_service.entrypoints.rl.run import run_demo_rl

        return run_demo_rl(args.cache_dir, config=RLConfig(timeout_s=args.timeout, transport=args.transport),
                           png_path=args.png, json_path=args.json, launcher=args.launcher)

    if args.trainer is not None:
        return _run_live(args)
    ep, tp = resolve_parallel(args)
    check_run_arguments(args)
    engines = resolve_engines(args, adapter=args.cache_dir / "lora")
    check_transport(args, ep * tp)
    quiet_libraries()
    base, adapter = ensure_files(args.cache_dir)
    cfg = RunConfig(base=base, adapter=adapter, ep=ep, tp=tp, engine=args.engine, engines=engines,
                    versions=args.versions, transport=args.transport, bucket_bytes=args.bucket_bytes,
                    timeout_s=args.timeout, json_path=args.json, metrics_port=args.metrics_port,
                    check_served=args.check_served, **version_options(args))
    return execute_engine(cfg, {"model": DEMO_MODEL, "adapter": DEMO_ADAPTER, "cache_dir": str(args.cache_dir)},
                          args.launcher)


def _run_live(args: argparse.Namespace) -> int:
    from sync_service.entrypoints.demo_live import run_trainer_demo

    world = (TRAINERS.get(args.trainer) or MEGATRON_TRAINERS[args.trainer]).world
    if args.engine != "hf":
        fail(args, f"--trainer {args.trainer} verifies transformers engines; drop --engine {args.engine}")
    if args.ep is not None or args.trainers is not None or args.tp != 1:
        fail(args, f"--trainer {args.trainer} runs {world} training ranks of its own; drop --ep / --tp / --trainers")
    resolve_parallel(args)  # --engines / --versions bounds
    engines = resolve_engines(args, adapter=None)
    check_run_arguments(args)
    check_transport(args, world, fix=f"drop --transport {args.transport} (--trainer {args.trainer} runs {world} ranks)")
    if args.trainer in MEGATRON_TRAINERS:
        return _run_megatron(args, engines)
    quiet_libraries()
    base, _ = ensure_files(args.cache_dir)
    if TRAINERS[args.trainer].tp_base:
        base = ensure_tp_base(args.cache_dir)
    cfg = RunConfig(base=base, adapter=None, engine="hf", engines=engines, versions=args.versions,
                    transport=args.transport, bucket_bytes=args.bucket_bytes, timeout_s=args.timeout,
                    json_path=args.json, metrics_port=args.metrics_port,
                    check_served=args.check_served, **version_options(args))
    return run_trainer_demo(cfg, {"model": DEMO_MODEL, "cache_dir": str(args.cache_dir)}, kind=args.trainer,
                            launcher=args.launcher)


def _run_megatron(args: argparse.Namespace, engines: int) -> int:
    from sync_service.entrypoints.demo_megatron import megatron_missing, run_megatron_demo

    missing = megatron_missing()
    if missing is not None:
        fail(args, missing)
    quiet_libraries()
    base = ensure_tp_base(args.cache_dir)
    kind = MEGATRON_TRAINERS[args.trainer]
    cfg = RunConfig(base=base, adapter=None, ep=kind.ep, tp=kind.tp, engine="hf", engines=engines,
                    versions=args.versions, transport=args.transport, bucket_bytes=args.bucket_bytes,
                    timeout_s=args.timeout, json_path=args.json, metrics_port=args.metrics_port,
                    check_served=args.check_served, **version_options(args))
    return run_megatron_demo(cfg, {"model": DEMO_MODEL, "cache_dir": str(args.cache_dir)}, kind=args.trainer,
                             launcher=args.launcher)
