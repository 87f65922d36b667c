"""``weightsync`` command line: one sub-command per module, imported lazily.

Each sub-command module exposes ``add_arguments(parser: argparse.ArgumentParser) -> None`` and
``run(args: argparse.Namespace) -> int``. Lazy import keeps ``weightsync merge`` free of Ray.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# sub-command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "merge": ("sync_service.merge.cli", "merge a PEFT LoRA adapter into a base checkpoint, streamed to safetensors"),
    "demo": ("sync_service.demo", "run the whole product locally on a generated Qwen3-MoE + LoRA, verify every version"),
    "sync": ("sync_service.sync_cli", "stream your base + LoRA adapter from sharded trainers to local engines, verify"),
    "bench": ("sync_service.bench.cli", "time a sync next to the disk and full-gather paths and the copy floor; JSON + plot"),
    "run": ("sync_service.run_cli", "place trainers and engines on a Ray cluster by resources (--config FILE), sync, verify"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weightsync", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text)
        sp.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(sp)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
