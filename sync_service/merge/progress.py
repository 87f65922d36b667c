"""A ``tqdm`` bar on stderr that draws on every terminal, the merge's and the commands' (``Steps``).

tqdm sizes its bar from the terminal's window size and draws nothing when the terminal reports 0 × 0
(a pseudo-terminal nobody sized: ``script`` run from a non-terminal, ``pty.openpty``, some CI consoles and
``docker exec`` sessions): it reads rows = -1 and skips every redraw. ``bar`` passes the size of
``shutil.get_terminal_size`` ($COLUMNS / $LINES, else 80 × 24) in that case; a sized terminal keeps tqdm's
own (resizable) width. Disabled unless asked for or stderr is a terminal: never in logs, pipes or tests.
"""

from __future__ import annotations

import os
import shutil
import sys

from tqdm import tqdm

__all__ = ["bar", "unsized_shape"]


def unsized_shape(stream) -> tuple[int, int] | None:
    """``(columns, rows)`` to draw with when ``stream`` is a terminal that reports no size; ``None`` when
    it reports one (or is no terminal)."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return None
    if size.columns > 0 and size.lines > 0:
        return None
    fallback = shutil.get_terminal_size((80, 24))
    return max(fallback.columns, 20), max(fallback.lines, 2)


def bar(total: int, *, enabled: bool | None = None, **options) -> tqdm:
    """``tqdm(total=total, file=sys.stderr, **options)``, shown when ``enabled`` (``None``: when stderr is
    a terminal), sized as the module docstring says."""
    enabled = sys.stderr.isatty() if enabled is None else enabled
    shape = unsized_shape(sys.stderr) if enabled else None
    if shape is not None:
        options = {**options, "ncols": shape[0], "nrows": shape[1], "dynamic_ncols": False}
    return tqdm(total=total, file=sys.stderr, disable=not enabled, **options)
