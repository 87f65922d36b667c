"""weightsync: stream merged LoRA weights from trainers to rollout engines (demo, sync, run, merge, bench, ...).

Each sub-command module exposes ``add_arguments(parser: argparse.ArgumentParser) -> None`` and
``run(args: argparse.Namespace) -> int``. Lazy import keeps ``weightsync merge`` free of Ray.

Errors: every failure ends in one line on stderr, ``weightsync <command>: error: <message>`` — no
traceback, no colour codes (``--traceback`` shows the traceback) — and the exit status says which
kind it was (``EXIT_CODES``): 2 bad input (flags, files, configs: nothing was changed), 1 a runtime
failure (a push failed, an actor died, a timeout, verification failed), 130 interrupted (Ctrl-C or SIGTERM:
every clean-up runs first).
An error raised inside a Ray actor is unwrapped to its cause and named with the actor.
Sub-commands that start actors find a ``protocols.endpoints.Launcher`` in ``args.launcher``: the
``weightsync`` console script (``actors/cli.py``) passes ``actors.launch.RayLauncher()``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import re
import signal
import sys
import threading
from typing import NoReturn

# sub-command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "merge": ("sync_service.entrypoints.merge_cli", "merge a PEFT LoRA adapter into a base checkpoint, streamed to safetensors"),
    "demo": ("sync_service.entrypoints.demo", "run the whole product locally on a generated Qwen3-MoE + LoRA, verify every version"),
    "sync": ("sync_service.entrypoints.sync_cli", "stream your base + LoRA adapter from sharded trainers to local engines, verify"),
    "bench": ("sync_service.bench.cli", "time a sync next to the disk and full-gather paths and the copy floor; JSON + plot"),
    "run": ("sync_service.entrypoints.run_cli", "place trainers and engines on a Ray cluster by resources (--config FILE), sync, verify"),
}

EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED = 2, 1, 130

# (module, class) -> exit status; first match wins. A class is looked up only when its module is
# already imported (an error of a module never loaded cannot have been raised), so this table
# imports nothing (``weightsync merge`` stays free of Ray).
EXIT_CODES: tuple[tuple[str, str, int], ...] = (
    ("sync_service.coordinator.metrics", "SyncError", EXIT_FAILED),
    ("protocols.endpoints", "EndpointError", EXIT_FAILED),
    ("builtins", "TimeoutError", EXIT_FAILED),
    ("sync_service.merge.errors", "MergeError", EXIT_BAD_INPUT),
    ("sync_service.cluster.config", "ConfigError", EXIT_BAD_INPUT),
    ("sync_service.coordinator.planning", "PlanMismatchError", EXIT_BAD_INPUT),
    ("builtins", "ValueError", EXIT_BAD_INPUT),
    ("builtins", "FileNotFoundError", EXIT_BAD_INPUT),
    ("builtins", "NotADirectoryError", EXIT_BAD_INPUT),
    ("builtins", "PermissionError", EXIT_BAD_INPUT),
)

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_RAY_CALL = re.compile(r"ray::([\w.]+)\(\)")
_PID = re.compile(r"\s*\(pid=\d+.*\)\s*$")  # Ray's "(pid=…, ip=…, actor_id=…, repr=…)" after a call
_WORKER = re.compile(r"^\s*\[rank\d+\]:")  # the prefix vLLM / torchrun workers put on every line
MAX_MESSAGE_CHARS = 2000
"""Longest message printed; a longer one keeps its start and its end (where a cause is)."""


class Parser(argparse.ArgumentParser):
    """argparse with the one-line error of every other weightsync error (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``weightsync`` parser. ``allow_abbrev=False`` everywhere: a flag is matched only when
    spelled out (``--engine`` is never read as ``--engines``)."""
    parser = Parser(prog="weightsync", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--traceback", action="store_true", help="on an error, show the full traceback")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, allow_abbrev=False)
        sp.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(sp)
    return parser


def _unwrap(exc: BaseException) -> tuple[BaseException, str]:
    """(the error to report, the Ray call that raised it, e.g. ``RolloutEngine.receive``): a Ray
    task error becomes its cause (repeatedly, for an actor that called another)."""
    task_error = getattr(sys.modules.get("ray.exceptions"), "RayTaskError", None)
    where = ""
    while task_error is not None and isinstance(exc, task_error) and getattr(exc, "cause", None) is not None:
        call = _RAY_CALL.search(_ANSI.sub("", str(exc)))
        where = call.group(1) if call else where
        exc = exc.cause
    return exc, where


def one_line(text: str) -> str:
    """``text`` as one line: no colour codes, no traceback frames (``File …`` + code + ``^^^``), no
    Ray process details or worker ``[rankN]:`` prefixes; its other lines joined by "; "; at most
    ``MAX_MESSAGE_CHARS`` (the start and the end)."""
    out: list[str] = []
    after_frame = False
    for raw in _ANSI.sub("", text).splitlines():
        raw = _WORKER.sub("", raw)
        line = _PID.sub("", raw).strip()
        frame_code, after_frame = after_frame and raw[:1].isspace(), line.startswith('File "')
        if not line or after_frame or frame_code or line.startswith("Traceback (") or not line.strip("^~ "):
            continue
        out.append(line)
    text = "; ".join(out)
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    head = MAX_MESSAGE_CHARS // 4
    return f"{text[:head]} … {text[len(text) - (MAX_MESSAGE_CHARS - head):]}"


def exit_code(exc: BaseException) -> int | None:
    """The exit status ``EXIT_CODES`` gives ``exc``; ``None`` for an error of no listed kind."""
    for module, name, code in EXIT_CODES:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and isinstance(exc, cls):
            return code
    return None


def describe(exc: BaseException) -> tuple[str, int]:
    """(one-line message, exit status) of an error that ended a command; an error of no listed kind
    is named by its type and exits 1."""
    cause, where = _unwrap(exc)
    text = one_line(str(cause)) or "(no message)"
    code = exit_code(cause)
    if code is None:
        text, code = f"{type(cause).__name__}: {text}", EXIT_FAILED
    return (f"{where}: {text}" if where else text), code


class _NoLauncher:
    """``args.launcher`` when ``main`` got none: checks run as usual, starting an actor fails naming the fix."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __getattr__(self, name: str):
        raise RuntimeError(f"weightsync {self.command} starts actors, and this entry point has no actor launcher: "
                           f"run the weightsync console script (actors.cli:main; after an update: pip install -e .) "
                           f"or python -m actors.cli")


def _interrupt(signum, frame) -> NoReturn:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def _sigterm_interrupts():
    """Within the block SIGTERM ends a command as Ctrl-C does: a ``KeyboardInterrupt``, so every ``finally``
    runs (temp dirs removed, Ray shut down, child processes stopped) and the command exits 130; the previous
    handler is back after. Only in the main thread (the only one that may set a handler)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def sigterm_kept():
    """Puts back, after the block, the Python SIGTERM handler set before it: ``ray.init`` installs its own
    (``sys.exit(15)``), which would make a command's SIGTERM an exit 15 instead of the interrupt of
    ``_sigterm_interrupts``. Keeps Ray's where no Python handler was set (outside a command)."""
    before = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    try:
        yield
    finally:
        if callable(before):
            signal.signal(signal.SIGTERM, before)


def _disarm_test_faults(command: str) -> None:
    """Drop ``$WEIGHTSYNC_TEST_FAULTS`` (the engines' test-only fault hook, ``engines/faults.py``) from this process
    before any engine, Ray worker or vLLM server inherits it: a variable left exported from a test session must never
    corrupt a real sync. Says so on stderr in one line."""
    import os

    from sync_service.engines.faults import ENV

    if os.environ.pop(ENV, None) is not None:
        print(f"weightsync {command}: ignoring ${ENV} (the engines' test-only fault hook; the commands never arm "
              f"it)", file=sys.stderr)


def main(argv: list[str] | None = None, *, launcher=None) -> int:
    """Parse ``argv`` and run the sub-command. ``launcher``: a ``protocols.endpoints.Launcher`` for
    sub-commands that start actors (``actors.cli.main``, the console script, passes one)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # name the sub-command, as its own errors do
        parser.exit(EXIT_BAD_INPUT, f"weightsync {args.command}: error: unrecognized arguments: {' '.join(unknown)} "
                                    f"(see weightsync {args.command} --help)\n")
    args.launcher = launcher if launcher is not None else _NoLauncher(args.command)
    _disarm_test_faults(args.command)
    from sync_service.entrypoints.progress import set_command

    set_command(f"weightsync {args.command}")  # the prefix of the progress log lines off a terminal
    try:
        with _sigterm_interrupts():
            return int(importlib.import_module(args._module).run(args) or 0)
    except KeyboardInterrupt:
        print(f"weightsync {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if args.traceback:
            raise
        message, code = describe(exc)
        hint = "" if code == EXIT_BAD_INPUT else f" (weightsync --traceback {args.command} … shows where)"
        print(f"weightsync {args.command}: error: {message}{hint}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
