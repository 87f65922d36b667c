"""Why an endpoint's actor died, in one line (``death_cause``), and the error that says it (``died_error``).

Ray reports a worker process that vanished as ``ActorDiedError`` ("Worker unexpectedly exits with a
connection error code 2. End of file": the raylet only saw the worker's socket close) whatever ended
it: a SIGKILL (the kernel's OOM killer, ``kill -9``), a fatal signal (SIGSEGV, SIGBUS — e.g. a
``/dev/shm`` page the kernel could not back —, SIGABRT from native code) or ``os._exit``. Ray's own
memory monitor says ``OUT_OF_MEMORY`` instead, ``ray.kill`` says so too. What the machine still
knows, looked up while the Ray session (and its logs) exist, first match wins:

1. the fatal error the dead worker wrote into its own log (``worker-*-<pid>.err``: Ray enables
   ``faulthandler`` in every worker, so a fatal signal leaves "Fatal Python error: Bus error" and the
   frame it hit; a C++ ``terminate`` leaves its ``what()``);
2. the kernel's line about the pid (``dmesg``, readable as root): "Killed process <pid> …" of the
   OOM killer, or a segfault line;
3. else "no fatal error in its log: killed by SIGKILL or os._exit (the kernel's OOM killer? memory
   available: N MiB)".
Only the driver's node is searched (a worker on another host keeps its logs there).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from protocols.endpoints import EndpointDiedError, clean_error_text

__all__ = ["death_cause", "died_error"]

_PID = re.compile(r"^\s*pid: (\d+)\s*$", re.M)
_CLASS = re.compile(r"^\s*class_name: (\S+)\s*$", re.M)
_TAIL_BYTES = 64 << 10
"""How much of the end of a dead worker's ``.err`` log is read."""

# (marker in a worker's stderr, how many lines from it are the message), in order of preference: Python's
# faulthandler names the frame, C++'s terminate its what(), Ray's own signal handler only the signal
FATAL_MARKERS: tuple[tuple[str, int], ...] = (
    ("Fatal Python error: ", 1),
    ("terminate called", 2),
    ("*** SIG", 1),
)
HINTS: dict[str, str] = {
    "Bus error": " (a memory-mapped page the kernel could not back: /dev/shm or the file's disk full?)",
}
"""What a fatal error usually means here, added after it."""
# (what Ray's own message says, the cause in our words)
RAY_REASONS: tuple[tuple[str, str], ...] = (
    ("ray.kill", "killed by ray.kill"),
    ("OUT_OF_MEMORY", "killed by Ray's memory monitor (OUT_OF_MEMORY)"),
    ("exit_actor", "exited by ray.actor.exit_actor"),
    ("creation task", "its __init__ raised"),
)


_INIT = re.compile(r"ray::(\w+\.__init__)\(\)")
"""Ray's name of a failed creation task (``ray::RolloutEngineCore.__init__()``)."""


def death_cause(exc: BaseException) -> str:
    """One line (no newline): why the actor of ``exc`` (a ``RayActorError``) died, as far as known;
    always starts "the actor died". Never raises; reads files and ``dmesg`` (bounded: 5 s)."""
    text = str(exc)
    pid_match, cls_match = _PID.search(text), _CLASS.search(text)
    who = " ".join(filter(None, [cls_match and cls_match.group(1), pid_match and f"pid {pid_match.group(1)}"]))
    head = f"the actor died ({who})" if who else "the actor died"
    for needle, reason in RAY_REASONS:
        if needle in text:
            detail = clean_error_text(text) if needle == "creation task" else ""
            init = _INIT.search(text) if needle == "creation task" else None
            reason = f"{init.group(1)} raised" if init else reason
            return f"{head}: {reason}" + (f": {detail}" if detail else "")
    if pid_match is None:
        return f"{head}: killed, crashed or out of memory (Ray did not say which process)"
    pid = int(pid_match.group(1))
    found = _fatal_in_log(pid) or _kernel_line(pid)
    if found:
        return f"{head}: {found}"
    return (f"{head}: no fatal error in its log: killed by SIGKILL or os._exit "
            f"(the kernel's OOM killer? memory available: {_available_mib()} MiB)")


def died_error(exc: BaseException, endpoint: str | None = None, call: str = "a call") -> EndpointDiedError:
    """``exc`` (a ``RayActorError``) as ``EndpointDiedError`` whose cause is ``death_cause(exc)``;
    ``endpoint`` defaults to the dead actor's class name."""
    cls = _CLASS.search(str(exc))
    return EndpointDiedError(endpoint or (f"actor {cls.group(1)}" if cls else "an actor"), call,
                             type(exc).__name__, death_cause(exc))


def _logs_dir() -> Path | None:
    """This node's Ray log directory; ``None`` when not connected."""
    import ray._private.worker as ray_worker

    node = getattr(ray_worker, "_global_node", None)
    return Path(node.get_logs_dir_path()) if node is not None else None


def _fatal_in_log(pid: int) -> str | None:
    """The fatal error the worker ``pid`` wrote last to its ``.err`` log (``FATAL_MARKERS``), with the
    innermost frame faulthandler names, or ``None``."""
    try:
        logs = _logs_dir()
        files = sorted(logs.glob(f"worker-*-{pid}.err")) if logs is not None else []
        if not files:
            return None
        with open(files[-1], "rb") as f:
            f.seek(max(0, f.seek(0, 2) - _TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for marker, count in FATAL_MARKERS:
        at = [i for i, line in enumerate(lines) if marker in line]
        if not at:
            continue
        said = [ln[ln.index(marker):] if j == 0 else ln.strip() for j, ln in enumerate(lines[at[-1]:at[-1] + count])]
        frame = next((ln.strip() for ln in lines[at[-1] + 1:at[-1] + 12] if ln.lstrip().startswith("File ")), "")
        text = "; ".join(filter(None, said)).strip(" *")
        hint = next((h for needle, h in HINTS.items() if needle in text), "")
        return f"crashed: {text}" + (f" at {frame}" if frame else "") + hint
    return None


def _kernel_line(pid: int) -> str | None:
    """The kernel's last log line naming ``pid`` (an OOM kill, a segfault), or ``None`` (no line, or
    the kernel log is not readable: not root)."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5.0).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    pattern = re.compile(rf"(Killed process {pid}\b|\[{pid}\]|\b{pid}\b.*segfault)")
    lines = [ln for ln in out.splitlines() if pattern.search(ln)]
    if not lines:
        return None
    line = re.sub(r"^\[\s*[\d.]+\]\s*", "", lines[-1]).strip()
    who = "the kernel's OOM killer" if "Killed process" in line else "the kernel"
    return f"killed by {who} (dmesg: {line[:300]})"


def _available_mib() -> str:
    """MemAvailable of /proc/meminfo in MiB (now, after the death), or "unknown"."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return str(int(line.split()[1]) // 1024)
    except (OSError, ValueError, IndexError):
        pass
    return "unknown"
