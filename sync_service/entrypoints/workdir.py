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

__all__ = ["RUN_PREFIX", "check_temp_dir", "ray_temp", "run_dir", "run_root", "sweep_stale"]

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
LINUX_PID_MAX = 1 << 22
"""The largest ``/proc/sys/kernel/pid_max`` Linux allows (systemd's default); used where it cannot be read."""
RUN_DIR_PREFIX_MAX = 4
"""Longest prefix of a ``run_dir`` that hosts Ray (``"sync"``, ``"vsrv"``, ...), bytes."""


def pid_max() -> int:
    """This machine's ``/proc/sys/kernel/pid_max`` (every pid is below it); ``LINUX_PID_MAX`` where unreadable."""
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return LINUX_PID_MAX


def socket_budget() -> tuple[int, int, int]:
    """``(Ray's tail, weightsync's run directory, TMPDIR's room)`` in bytes, at the longest pid of this machine:
    Ray's plasma socket ``/session_<date>_<pid>/sockets/plasma_store`` under its ``_temp_dir``; the per-run
    directory ``/wsrun-<pid>-<start>`` (base 36; a start time of 8 digits, until the year 2059), a ``run_dir``
    (``RUN_DIR_PREFIX_MAX`` + ``mkdtemp``'s 8 random characters) and ``ray_temp``'s ``/r``; and what AF_UNIX's
    107 bytes leave to ``TMPDIR``: 11 bytes where pid_max is 32768, 7 where it is 4194304 (README)."""
    largest = pid_max() - 1
    ray = len(f"/session_2026-12-05_03-30-47_554491_{largest}/sockets/plasma_store")
    run = len(f"/{RUN_PREFIX}{_b36(largest)}-{_b36(36 ** 8 - 1)}/") + RUN_DIR_PREFIX_MAX + len("XXXXXXXX/r")
    return ray, run, SOCKET_PATH_MAX - ray - run


def check_temp_dir() -> None:
    """The system temp directory (``TMPDIR``) leaves room for Ray's socket paths under a run directory at any pid
    of this machine (``socket_budget``); what ``sync`` / ``demo`` / ``run`` check before Ray starts.

    Raises:
        ValueError: naming ``TMPDIR``, its length, the bound and the fix.
    """
    tmp = tempfile.gettempdir()
    ray, run, room = socket_budget()
    if len(os.fsencode(tmp)) > room:
        raise ValueError(f"TMPDIR {tmp} ({len(os.fsencode(tmp))} bytes) is too long for Ray's socket paths: AF_UNIX "
                         f"allows {SOCKET_PATH_MAX} bytes, of which Ray's names take {ray} and weightsync's run "
                         f"directory {run} at this machine's pid_max {pid_max()}; set TMPDIR to a directory of at "
                         f"most {room} bytes, e.g. /tmp")


def ray_temp(run: Path) -> Path:
    """Ray's ``_temp_dir`` inside the per-run directory ``run``: a one-letter name, since Ray's plasma
    socket ``<it>/session_<date>_<pid>/sockets/plasma_store`` must fit AF_UNIX's 107 bytes.

    Raises:
        ValueError: the system temp directory (``TMPDIR``) is too long for that socket path (``check_temp_dir``),
            or ``run`` is (a ``run_dir`` prefix longer than ``RUN_DIR_PREFIX_MAX``), naming it and the fix.
    """
    check_temp_dir()
    path = run / "r"
    if len(os.fsencode(path)) + socket_budget()[0] > SOCKET_PATH_MAX:
        raise ValueError(f"{run} is too long for Ray's socket paths (AF_UNIX allows {SOCKET_PATH_MAX} bytes); give "
                         f"Ray a run_dir whose prefix is at most {RUN_DIR_PREFIX_MAX} bytes")
    return path


def run_dir(prefix: str, root: str | Path | None = None) -> Path:
    """A new private directory ``<run_root(root)>/<prefix>XXXXXXXX`` for the caller to remove when done (one that
    hosts Ray, ``ray_temp``: a prefix of at most ``RUN_DIR_PREFIX_MAX`` bytes)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=run_root(root)))
