"""Peak resident set size of a group of processes (Ray actor pids), sampled by psutil in a thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import psutil

__all__ = ["RssSampler", "actor_pid"]


def actor_pid(actor, timeout_s: float = 60.0) -> int:
    """The OS pid of a Ray actor (runs ``os.getpid`` on the actor itself)."""
    import ray

    return ray.get(actor.__ray_call__.remote(_getpid), timeout=timeout_s)


def _getpid(_self) -> int:
    import os

    return os.getpid()


class RssSampler:
    """Samples RSS (bytes; shared pages a process touched count, e.g. shm rings and the Ray object
    store) of named process groups every ``interval_s`` while entered.

    ``groups``: group name (``"trainer"``, ``"engine"``) -> pids. After exit: ``base[pid]`` (RSS at
    enter), ``peak[pid]``; ``peak_bytes(group)`` the peak of the group's summed RSS;
    ``max_extra_bytes(group)`` the largest growth of one process over its RSS at enter. A process
    that exits is sampled as 0 from then on.
    """

    def __init__(self, groups: Mapping[str, list[int]], *, interval_s: float = 0.02) -> None:
        self.groups = {g: list(p) for g, p in groups.items()}
        self._procs = {pid: psutil.Process(pid) for pids in self.groups.values() for pid in pids}
        self.interval_s = interval_s
        self.base: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self._group_peak: dict[str, int] = {g: 0 for g in self.groups}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _sample(self) -> dict[int, int]:
        out = {}
        for pid, proc in self._procs.items():
            try:
                out[pid] = proc.memory_info().rss
            except psutil.Error:
                out[pid] = 0
        return out

    def _record(self, rss: dict[int, int]) -> None:
        for pid, value in rss.items():
            self.peak[pid] = max(self.peak.get(pid, 0), value)
        for g, pids in self.groups.items():
            self._group_peak[g] = max(self._group_peak[g], sum(rss[p] for p in pids))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._record(self._sample())

    def __enter__(self) -> "RssSampler":
        self.base = self._sample()
        self._record(self.base)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._record(self._sample())

    def peak_bytes(self, group: str) -> int:
        return self._group_peak.get(group, 0)

    def max_extra_bytes(self, group: str) -> int:
        return max((self.peak[p] - self.base[p] for p in self.groups.get(group, [])), default=0)
