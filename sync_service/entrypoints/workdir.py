"""Temporary directories of the commands: all of one process's under one per-run directory, which a
later run removes once that process is gone.

Layout: ``<system temp dir>/wsrun-<pid>-<start>/`` per process (``start``: the process's create time, ms
since the epoch, as psutil reports it; both in base 36, so the path stays short: Ray's AF_UNIX socket
paths under a run directory must fit in 107 bytes), and inside it the ``mkdtemp`` directories of
``run_dir(prefix)``. A command removes its own directories when it ends (its ``finally``); a driver
killed by SIGKILL or the OOM killer cannot, and leaves them — the next ``run_dir`` of any command
first removes every per-run directory whose owner is no longer running (``sweep_stale``), as the shm
transport's ``sweep_orphans`` does for ring segments. The create time in the name tells a recycled
pid from the owner: a directory is kept only while a process with its pid *and* its start time runs.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

import psutil

__all__ = ["RUN_PREFIX", "ray_temp", "run_dir", "run_root", "sweep_stale"]

RUN_PREFIX = "wsrun-"
"""Name prefix of every per-run directory in the system temp directory."""
MARKER = ".weightsync-run"
"""File every per-run directory holds: the sweep removes only directories that carry it (never another
program's directory whose name happens to match)."""
_NAME = re.compile(rf"{RUN_PREFIX}([0-9a-z]+)-([0-9a-z]+)")


def _start_ms(pid: int) -> int | None:
    """Create time of ``pid`` in ms since the epoch; ``None`` when no such process runs (a zombie counts as gone)."""
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else int(proc.create_time() * 1000)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _b36(n: int) -> str:
    """``n`` >= 0 in base 36 (digits, then lower-case letters): what ``int(s, 36)`` reads back."""
    digits = ""
    while True:
        n, r = divmod(n, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[r] + digits
        if not n:
            return digits


def _owner_dir(root: Path) -> Path:
    """This process's per-run directory under ``root`` (created on first use)."""
    path = root / f"{RUN_PREFIX}{_b36(os.getpid())}-{_b36(_start_ms(os.getpid()) or 0)}"
    if not path.is_dir():
        path.mkdir(mode=0o700, exist_ok=True)
        (path / MARKER).touch()
        atexit.register(_remove_if_empty, path)  # what the command removed itself leaves it empty
    return path


def _remove_if_empty(path: Path) -> None:
    """Remove ``path`` if it holds only its marker (what the command removed itself leaves)."""
    with contextlib.suppress(OSError):
        if [p.name for p in path.iterdir()] == [MARKER]:
            (path / MARKER).unlink()
            path.rmdir()


def sweep_stale(root: str | Path | None = None) -> list[Path]:
    """Remove every per-run directory under ``root`` (default: the system temp directory) whose owner
    process is gone (no process with its pid, or one started at another time: a recycled pid).
    Returns the removed paths; one that cannot be removed (another user's) is skipped."""
    root = Path(tempfile.gettempdir() if root is None else root)
    removed = []
    for path in root.glob(f"{RUN_PREFIX}*"):
        m = _NAME.fullmatch(path.name)
        if m is None or not (path / MARKER).is_file() or _start_ms(int(m.group(1), 36)) == int(m.group(2), 36):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    return removed


def run_root(root: str | Path | None = None) -> Path:
    """This process's per-run directory ``<root>/wsrun-<pid>-<start>`` (``root`` default: the system
    temp directory), the ``dir=`` of a ``tempfile.TemporaryDirectory``; sweeps stale per-run directories first."""
    root = Path(tempfile.gettempdir() if root is None else root)
    sweep_stale(root)
    return _owner_dir(root)


SOCKET_PATH_MAX = 107
"""AF_UNIX's longest socket path, bytes."""
RAY_SOCKET_TAIL = len("/session_2026-12-05_03-30-47_554491_4194304/sockets/plasma_store")
"""Longest path Ray puts under its ``_temp_dir`` for a socket (a 7-digit pid), bytes."""


def ray_temp(run: Path) -> Path:
    """Ray's ``_temp_dir`` inside the per-run directory ``run``: a one-letter name, since Ray's plasma
    socket ``<it>/session_<date>_<pid>/sockets/plasma_store`` must fit AF_UNIX's 107 bytes.

    Raises:
        ValueError: the system temp directory (``TMPDIR``) is too long for that socket path, naming it and the fix.
    """
    path = run / "r"
    if len(os.fsencode(path)) + RAY_SOCKET_TAIL > SOCKET_PATH_MAX:
        room = SOCKET_PATH_MAX - RAY_SOCKET_TAIL - (len(os.fsencode(path)) - len(os.fsencode(tempfile.gettempdir())))
        raise ValueError(f"TMPDIR {tempfile.gettempdir()} is too long for Ray's socket paths (AF_UNIX allows "
                         f"{SOCKET_PATH_MAX} bytes); set TMPDIR to a directory of at most {max(room, 1)} bytes, e.g. /tmp")
    return path


def run_dir(prefix: str, root: str | Path | None = None) -> Path:
    """A new private directory ``<run_root(root)>/<prefix>XXXXXXXX`` for the caller to remove when done."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=run_root(root)))
