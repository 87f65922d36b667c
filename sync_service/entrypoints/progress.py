"""Progress of a command's long steps (reading the checkpoint, Ray and actor start-up, plan validation, each
version's push and verification): a bar on a terminal, one log line per step elsewhere.

On a terminal: a ``tqdm`` bar on stderr (``merge.progress.bar``: it draws also on a terminal that reports no
size) naming the current step, its elapsed time ticking once a second while a step runs (Ray's start, an
engine's model load). Off a terminal (a log, a pipe, CI): one line per step on stderr,
``<command>: step i/n: <what> (<t> s in)``, so a log shows what a run is doing during minutes of start-up.
Table lines go through ``Steps.write`` so a live bar is cleared and redrawn around them.
"""

from __future__ import annotations

import sys
import threading
import time

from tqdm import tqdm

from sync_service.merge.progress import bar

__all__ = ["Steps", "set_command"]

TICK_S = 1.0
"""How often a terminal bar redraws its elapsed time while a step runs, seconds."""
COMMAND = ["weightsync"]
"""The running command, the log lines' prefix: ``cli.main`` sets ``"weightsync <command>"`` (``set_command``)."""


def set_command(name: str) -> None:
    """Name the running command (``"weightsync sync"``) for the log lines of every ``Steps`` made after."""
    COMMAND[0] = name


class Steps:
    """A count of named steps: ``step("starting Ray")`` marks the previous step done and names the
    current one; the bar shows ``n/total``, the current step and the time since the start.

    Args:
        total: steps the command will take (the bar's length).
        enabled: ``None``: a bar when stderr is a terminal, else one log line per step; ``True``: the bar;
            ``False``: nothing (``--no-progress``).
        command: the log lines' prefix (default: the running command, ``set_command``).
    """

    def __init__(self, total: int, *, enabled: bool | None = None, command: str | None = None) -> None:
        terminal = sys.stderr.isatty() if enabled is None else enabled
        self._bar = bar(total, enabled=terminal, leave=False, dynamic_ncols=True,
                        bar_format="{n_fmt}/{total_fmt} {desc} [{elapsed}]")
        self._log = (command or COMMAND[0]) if enabled is None and not terminal else None
        self._total, self._done, self._t0 = total, 0, time.monotonic()
        self._started = False
        self._stop = threading.Event()
        self._ticker = None
        if terminal:
            self._ticker = threading.Thread(target=self._tick, name="steps-tick", daemon=True)
            self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(TICK_S):
            self._bar.refresh()

    def step(self, what: str) -> None:
        """The previous step is done; ``what`` runs now (drawn at once: steps are seconds apart)."""
        self._bar.set_description_str(what, refresh=False)
        if self._started:
            self._bar.update(1)
            self._done += 1
        self._started = True
        self._bar.refresh()
        if self._log is not None:
            print(f"{self._log}: step {self._done + 1}/{self._total}: {what} ({time.monotonic() - self._t0:.1f} s in)",
                  file=sys.stderr, flush=True)

    @staticmethod
    def write(line: str) -> None:
        """Print ``line`` to stdout above the bar (clears and redraws a live bar)."""
        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join(timeout=5 * TICK_S)
        self._bar.close()

    def __enter__(self) -> "Steps":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
