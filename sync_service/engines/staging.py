"""The staging every engine adapter shares: one buffer per announced tensor, box checks, completeness.

An engine never writes a received box into a served tensor. ``Staging.begin`` takes one buffer per
name announced for the sync (a buffer of an earlier sync is reused when its shape and dtype still fit),
``apply`` checks the box and copies into the buffer, ``check_complete`` (at ``finish_update``) refuses a
sync that did not cover every element of every announced tensor, ``take`` hands the filled buffers to the
engine's commit, ``drop`` discards them (abort), ``release`` frees the spares when no sync is coming. ``reserve`` allocates and touches the buffers of a
plan's names ahead of its first sync (at channel open): a page's first touch (~1-3 GB/s here) or a
copy-on-write fault then never lands inside a sync, whose copies run into touched memory (~20 GB/s
quiet). Boxes of one sync are disjoint (the plan guarantees it;
``protocols.wire_check`` checks it), so covered elements are counted, not tracked.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Iterable, Sequence

import torch

from protocols.params import Box, box_numel, box_shape
from sync_service.engines import faults

__all__ = ["APPLY_CHUNK_BYTES", "Staging", "check_box", "privatize_mapped", "refusal"]

APPLY_CHUNK_BYTES = 1 << 20
"""``ChunkedApply.apply_chunk_bytes`` of the engines that copy into ``Staging``: a piece and its
staging destination stay in this CPU's 1 MiB L2 / 32 MiB L3 while the receiver hashes it. Measured
(one thread, 64 MiB buckets from memory, quiet): hash then copy 2.4 GB/s; fused 1.7 (64 KiB pieces:
per-call overhead), 3.1 (256 KiB), 3.5 (1 MiB)."""


def privatize_mapped(tensors: Iterable[torch.Tensor], maps_path: str = "/proc/self/maps") -> int:
    """Give every tensor whose memory lies in a file mapping (``/proc/self/maps`` rows with an inode:
    the copy-on-write mapping of a safetensors file that transformers leaves unconverted tensors in)
    a private, touched copy (``t.data = t.data.clone()``). Such memory, reused as a staging buffer,
    takes a copy-on-write fault per 4 KiB page on its first write — inside a sync. Returns the bytes
    copied; does nothing where ``maps_path`` cannot be read (not Linux)."""
    try:
        with open(maps_path) as f:
            rows = [line.split(maxsplit=5) for line in f]
    except OSError:
        return 0
    spans = sorted((int(a, 16), int(b, 16)) for r in rows if len(r) >= 5 and r[4] != "0"
                   for a, b in [r[0].split("-")])
    starts = [a for a, _ in spans]
    copied = 0
    for t in tensors:
        if t.device.type != "cpu":  # a device pointer is no file mapping (and may fall in one's address range)
            continue
        i = bisect.bisect_right(starts, t.data_ptr()) - 1
        if t.numel() and i >= 0 and t.data_ptr() < spans[i][1]:
            t.data = t.data.clone()
            copied += t.nbytes
    return copied


def check_box(name: str, box: Box, shape: Sequence[int], data: torch.Tensor | None = None) -> None:
    """Raises ValueError unless ``box`` lies inside ``shape``, is non-empty along every non-empty dimension
    (a tensor with a zero-size dimension travels as its empty box), and ``data`` (when given) has the box's
    shape. The one box check of every engine adapter."""
    shape = tuple(shape)
    if len(box) != len(shape) or any(not (0 <= a <= b <= n and (a < b or n == 0)) for (a, b), n in zip(box, shape)):
        raise ValueError(f"box {box} of {name!r} is outside its shape {shape}")
    if data is not None and tuple(data.shape) != box_shape(box):
        raise ValueError(f"data for {name!r} box {box} has shape {tuple(data.shape)}, expected {box_shape(box)}")


def refusal(version: int, staged: int | None, finished: bool, served: int | None) -> str:
    """The error text of a refused ``commit(version)`` (``staged``: the version in progress, ``served``:
    the committed one). Every engine drops its staged update when it refuses a commit (a replayed or
    stale commit must not leave a sync behind that makes the next ``begin_update`` fail)."""
    return (f"commit({version}): no finished update of that version (in progress: {staged}, finished: "
            f"{finished}); the staged update is dropped, version {served} stays served")


class Staging:
    """Staging buffers of one engine (see the module docstring).

    Args:
        allocate: ``name → new buffer`` of the tensor's shape and dtype (contents undefined).
        owner: the engine's name in error messages (``"HFEngine"``).
    """

    def __init__(self, allocate: Callable[[str], torch.Tensor], owner: str) -> None:
        self._allocate = allocate
        self._owner = owner
        self._buffers: dict[str, torch.Tensor] = {}
        self._applied: dict[str, int] = {}
        self._spare: dict[str, torch.Tensor] = {}
        self._faults: dict[str, str] = {}
        self.version: int | None = None
        """The version being staged; ``None`` between syncs."""

    def begin(self, version: int, names: Sequence[str]) -> None:
        """Take a buffer per name (duplicates once). The caller has checked the names.

        Raises:
            RuntimeError: a sync is already staged (commit or abort it first).
        """
        if self.version is not None:
            raise RuntimeError(f"{self._owner}: begin_update({version}) while version {self.version} is in progress; "
                               f"commit or abort it first")
        self._buffers = {n: self._buffer(n) for n in dict.fromkeys(names)}
        self._applied = dict.fromkeys(self._buffers, 0)
        self._faults = faults.armed() if os.environ.get(faults.ENV) else {}  # test-only (engines.faults)
        self.version = version

    def apply(self, name: str, box: Box, data: torch.Tensor) -> None:
        """Copy ``data`` into ``box`` of ``name``'s buffer.

        Raises:
            RuntimeError: no sync begun. KeyError: ``name`` was not announced. ValueError: as ``check_box``,
            or ``data``'s dtype is not the buffer's (a silent cast would hide a plan mismatch).
        """
        if self.version is None:
            raise RuntimeError(f"{self._owner}: apply({name!r}) without begin_update")
        buf = self._buffers.get(name)
        if buf is None:
            raise KeyError(f"{self._owner}: {name!r} was not announced in begin_update({self.version}); "
                           f"announce every name a sync sends")
        check_box(name, box, buf.shape, data)
        if data.dtype != buf.dtype:
            raise ValueError(f"{self._owner}: data for {name!r} is {data.dtype}, the engine holds {buf.dtype}; "
                             f"cast on the trainer side")
        fault = self._faults.get(name) if self._faults else None
        if fault is None:
            buf[tuple(slice(a, b) for a, b in box)].copy_(data)
        else:
            faults.inject(fault, buf, box, data)
        self._applied[name] += box_numel(box)

    def check_complete(self) -> None:
        """Raises ValueError naming the tensors whose applied elements differ from their size."""
        bad = {n: (a, self._buffers[n].numel()) for n, a in self._applied.items() if a != self._buffers[n].numel()}
        if bad:
            detail = ", ".join(f"{n}: {a}/{t}" for n, (a, t) in list(bad.items())[:5])
            raise ValueError(f"{self._owner}: incomplete update {self.version}, elements applied/expected: {detail} "
                             f"({len(bad)} tensors); a sync must cover every element of every name it announces")

    def reserve(self, names: Sequence[str]) -> int:
        """Allocate a spare buffer for every name that has none and touch every page of it (zero fill),
        so the next ``begin`` reuses faulted-in memory. The caller has checked the names. Returns the
        bytes allocated (0 once every name holds a spare or a staged buffer)."""
        allocated = 0
        for name in dict.fromkeys(names):
            if name in self._spare or name in self._buffers:
                continue
            self._spare[name] = self._allocate(name).zero_()
            allocated += self._spare[name].nbytes
        return allocated

    def release(self) -> int:
        """Free the spare buffers kept for the next sync (a sync being staged keeps its own). Returns the
        bytes freed; the next ``begin`` or ``reserve`` allocates again."""
        freed = sum(t.nbytes for t in self._spare.values())
        self._spare.clear()
        return freed

    @property
    def held_bytes(self) -> int:
        """Bytes of every buffer held (spares kept for the next sync and buffers being staged), on the
        device of the served tensors (``allocate`` makes them like those)."""
        return sum(t.nbytes for t in (*self._spare.values(), *self._buffers.values()))

    def names(self) -> list[str]:
        return list(self._buffers)

    def applied(self) -> dict[str, int]:
        """Elements applied per name of the sync being staged (a copy)."""
        return dict(self._applied)

    def buffer(self, name: str) -> torch.Tensor:
        return self._buffers[name]

    def take(self) -> dict[str, torch.Tensor]:
        """The filled buffers (name → tensor); staging is empty afterwards. Give replaced tensors back with
        ``keep_spare`` so the next sync reuses them."""
        buffers, self._buffers, self._applied, self.version = self._buffers, {}, {}, None
        return buffers

    def keep_spare(self, name: str, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` (no longer served) as ``name``'s next staging buffer."""
        self._spare[name] = tensor

    def drop(self) -> None:
        """Discard the staged sync (buffers are kept for the next one). Idempotent."""
        self._spare.update(self._buffers)
        self._buffers, self._applied, self.version = {}, {}, None

    def _buffer(self, name: str) -> torch.Tensor:
        spare = self._spare.pop(name, None)
        return spare if spare is not None else self._allocate(name)
