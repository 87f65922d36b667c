"""Peak memory of groups of processes (Ray actor pids), sampled in a thread: RSS (psutil) and the
memory a process allocated — anonymous + shared-memory pages (``RssAnon + RssShmem`` of
``/proc/<pid>/status``), i.e. RSS without the file-backed pages of memory-mapped checkpoints."""

from __future__ import annotations

import threading
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


def allocated_bytes(proc: psutil.Process) -> int:
    """Anonymous + shared-memory resident bytes of ``proc`` (shm rings and the Ray object store
    count; pages of a memory-mapped safetensors file do not: they are the page cache's). Falls back
    to RSS where ``/proc/<pid>/status`` has no ``RssAnon`` (non-Linux)."""
    fields = {}
    try:
        with open(f"/proc/{proc.pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssShmem"):
                    fields[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return sum(fields.values()) if "RssAnon" in fields else proc.memory_info().rss


def _process(group: str, pid: int) -> psutil.Process:
    """Raises RuntimeError naming the group when the process is gone (psutil's own error names only the pid)."""
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        raise RuntimeError(f"{group} process {pid} exited before its memory was sampled (killed: out of memory? "
                           f"see the Ray logs of its actor)") from None


class RssSampler:
    """Samples RSS (bytes; shared pages a process touched count, e.g. shm rings and the Ray object
    store) and allocated bytes (``allocated_bytes``) of named process groups every ``interval_s``
    while entered.

    ``groups``: group name (``"trainer"``, ``"engine"``) -> pids (RuntimeError naming the group if one is
    gone at construction). After exit: ``base[pid]`` (RSS at
    enter), ``peak[pid]``; ``peak_bytes(group)`` the peak of the group's summed RSS;
    ``max_extra_bytes(group)`` the largest growth of one process's *allocated* bytes over its value
    at enter (a trainer reading its memory-mapped base shard for the first time grows its RSS by the
    shard, which is not memory the sync allocates); ``max_extra_rss_bytes(group)`` the same for RSS.
    A process that exits is sampled as 0 from then on.
    """

    def __init__(self, groups: Mapping[str, list[int]], *, interval_s: float = 0.02) -> None:
        self.groups = {g: list(p) for g, p in groups.items()}
        self._procs = {pid: _process(g, pid) for g, pids in self.groups.items() for pid in pids}
        self.interval_s = interval_s
        self.base: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.alloc_base: dict[int, int] = {}
        self.alloc_peak: dict[int, int] = {}
        self._group_peak: dict[str, int] = {g: 0 for g in self.groups}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _sample(self) -> tuple[dict[int, int], dict[int, int]]:
        rss, alloc = {}, {}
        for pid, proc in self._procs.items():
            try:
                rss[pid], alloc[pid] = proc.memory_info().rss, allocated_bytes(proc)
            except psutil.Error:
                rss[pid], alloc[pid] = 0, 0
        return rss, alloc

    def _record(self, sample: tuple[dict[int, int], dict[int, int]]) -> None:
        rss, alloc = sample
        for pid, value in alloc.items():
            self.alloc_peak[pid] = max(self.alloc_peak.get(pid, 0), value)
        for pid, value in rss.items():
            self.peak[pid] = max(self.peak.get(pid, 0), value)
        for g, pids in self.groups.items():
            self._group_peak[g] = max(self._group_peak[g], sum(rss[p] for p in pids))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._record(self._sample())

    def __enter__(self) -> "RssSampler":
        sample = self._sample()
        self.base, self.alloc_base = sample
        self._record(sample)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._record(self._sample())

    def peak_bytes(self, group: str) -> int:
        return self._group_peak.get(group, 0)

    def max_extra_bytes(self, group: str) -> int:
        return max((self.alloc_peak[p] - self.alloc_base[p] for p in self.groups.get(group, [])), default=0)

    def max_extra_rss_bytes(self, group: str) -> int:
        return max((self.peak[p] - self.base[p] for p in self.groups.get(group, [])), default=0)
