"""Progress of a command's long steps (Ray and actor start-up, plan validation, each version) on a terminal.

A ``tqdm`` bar on stderr (``merge.progress.bar``: it draws also on a terminal that reports no size),
shown only when stderr is a terminal (never in logs, pipes or tests);
table lines go through ``Steps.write`` so a live bar is cleared and redrawn around them.
"""

from __future__ import annotations

import sys

from tqdm import tqdm

from sync_service.merge.progress import bar

__all__ = ["Steps"]


class Steps:
    """A count of named steps: ``step("starting Ray")`` marks the previous step done and names the
    current one; the bar shows ``n/total``, the current step and the time since the start.

    Args:
        total: steps the command will take (the bar's length).
        enabled: show the bar; ``None``: only when stderr is a terminal.
    """

    def __init__(self, total: int, *, enabled: bool | None = None) -> None:
        self._bar = bar(total, enabled=enabled, leave=False, dynamic_ncols=True,
                        bar_format="{n_fmt}/{total_fmt} {desc} [{elapsed}]")
        self._started = False

    def step(self, what: str) -> None:
        """The previous step is done; ``what`` runs now (drawn at once: steps are seconds apart)."""
        self._bar.set_description_str(what, refresh=False)
        if self._started:
            self._bar.update(1)
        self._started = True
        self._bar.refresh()

    @staticmethod
    def write(line: str) -> None:
        """Print ``line`` to stdout above the bar (clears and redraws a live bar)."""
        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> "Steps":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
