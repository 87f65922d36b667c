"""The files of the shared-memory transports in ``SHM_DIR``: their names, owners, space and clean-up.

Every file starts with ``SEGMENT_PREFIX``. A ring segment (``shm.py``) names its sender's pid in its header;
a staging file (``<path>.init-<pid>``) and an owned segment (``<path>.pid-<pid>``, ``create_owned``: the
host slots of ``cuda_ipc.py``) name it in their file name, so ``shm.sweep_orphans`` can remove what a killed
process left. Space is reserved when a file is made (``posix_fallocate``), never at a first write.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from protocols.interfaces import TransportError

__all__ = ["OWNED", "SEGMENT_PREFIX", "SHM_DIR", "STAGING", "alive", "create_owned", "map_owned", "reserve", "unlink"]

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "weightsync-"
"""Every segment's file name starts with this (``weightsync-<spec.name>-s<sender>``)."""
STAGING = ".init-"
"""A staging file, ``<path>.init-<pid>``, is a segment being made by ``pid`` (linked to its name when done)."""
OWNED = ".pid-"
"""A segment named ``<...>.pid-<pid>`` belongs to process ``pid`` (the sweep removes it once that process is gone)."""


def unlink(path: str, inode: int | None = None) -> None:
    """Remove ``path``, no error if it is gone (when ``inode`` is given: only while it still names that file, not a
    newer segment that took the name); mappings stay valid until unmapped."""
    try:
        if inode is None or os.stat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, killed but not yet reaped, counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def reserve(fd: int, size: int, path: str) -> None:
    """Allocate every page of the segment now (``posix_fallocate``; ``ftruncate`` only sets the size and tmpfs
    backs a page when touched): a full ``SHM_DIR`` is a ``TransportError`` (sizes, fix) at channel open, not a
    SIGBUS that kills the writer at its first write into an unbacked page."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        where = os.path.dirname(path)
        st = os.statvfs(where)
        raise TransportError(
            f"shm segment {path}: {size >> 20} MiB do not fit in {where} ({st.f_bavail * st.f_frsize >> 20} MiB "
            f"free): {exc.strerror}; free {where}, give it more room, or lower bucket_bytes / slots") from exc


def create_owned(name: str, size: int) -> tuple[mmap.mmap, str]:
    """A new zero-filled segment ``SHM_DIR/weightsync-<name>.pid-<this pid>`` of ``size`` bytes, every page
    reserved and touched once, mapped; returns the mapping and its path. The caller unlinks it when done
    (``unlink``); if the process dies first, the next sender's ``sweep_orphans`` does.

    Raises:
        TransportError: ``SHM_DIR`` cannot hold it (sizes and fix named)."""
    path = f"{SHM_DIR}/{SEGMENT_PREFIX}{name}{OWNED}{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        reserve(fd, size, path)
        mm = mmap.mmap(fd, size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    np.frombuffer(mm, dtype=np.uint8)[:] = 0
    return mm, path


def map_owned(path: str, size: int) -> mmap.mmap:
    """Map the segment another process made with ``create_owned`` (read-write).

    Raises:
        TransportError: ``path`` is not a segment of this transport, is gone, or its size is not ``size``."""
    if not (path.startswith(f"{SHM_DIR}/{SEGMENT_PREFIX}") and "/" not in path[len(SHM_DIR) + 1:]
            and path.rpartition(OWNED)[2].isdigit()):
        raise TransportError(f"{path!r} is not a weightsync segment in {SHM_DIR}")
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise TransportError(f"segment {path}: {exc.strerror} (its sender ended?)") from exc
    try:
        if os.fstat(fd).st_size != size:
            raise TransportError(f"segment {path} has {os.fstat(fd).st_size} bytes, expected {size}: spec mismatch")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
