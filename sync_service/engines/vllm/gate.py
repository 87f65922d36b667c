"""``ServeGate``: generations versus the moment a new weight version goes live.

Generations enter through ``serving()``; an update ``close()``s the gate, which waits for the
generations inside to finish (they finish on the old version) and holds new ones until ``open()``.
Generations are also serialised among themselves: vLLM's synchronous ``LLM`` is not thread-safe
(batch prompts into one call instead).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ServeGate"]


class ServeGate:
    """See the module docstring. ``timeout_s`` bounds every wait; a wait past it raises ``TimeoutError``."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._cond = threading.Condition()
        self._active = 0
        self._closed = False
        self._serve_lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._closed

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Hold the gate open for one generation (blocks while an update holds it closed)."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._closed, timeout=self._timeout_s):
                raise TimeoutError(f"generation waited {self._timeout_s} s for a weight update to commit")
            self._active += 1
        try:
            if not self._serve_lock.acquire(timeout=self._timeout_s):
                raise TimeoutError(f"generation waited {self._timeout_s} s for the generation before it")
            try:
                yield
            finally:
                self._serve_lock.release()
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    def close(self) -> None:
        """Hold new generations and wait for running ones to finish. Idempotent.

        Raises:
            TimeoutError: generations still running after ``timeout_s`` (the gate is reopened).
        """
        with self._cond:
            self._closed = True
            if not self._cond.wait_for(lambda: self._active == 0, timeout=self._timeout_s):
                self._closed = False
                self._cond.notify_all()
                raise TimeoutError(f"{self._active} generation(s) still running after {self._timeout_s} s; update not applied")

    def open(self) -> None:
        with self._cond:
            self._closed = False
            self._cond.notify_all()
