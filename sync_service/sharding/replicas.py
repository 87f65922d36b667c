"""Replicas must agree: the check every trainer endpoint runs, at attach and on every push.

Wherever several trainer ranks hold the same part of a tensor (plain replicated ranks, DDP, HSDP's replicate
axis, TP-replicated tensors such as norms and the router, the TP ranks of one EP block), their copies must hold
the same bytes: each rank merges its own rows from its own copy, so replicas that drifted apart (a step
that ran on some ranks only, a rank restored from another checkpoint) would make the engines serve a chimera.

A trainer endpoint names what it holds as ``ReplicaPart(name, part)``: ranks that name the same part hold
replicas of it (the replica groups follow from the names; no group list to keep in step with the mesh).
``ReplicaCheck(parts, ...)`` (collective, once) exchanges the names over weightsync's own process group;
``check(values, what=...)`` (collective, per push) hashes this rank's values (xxh3_64 of their bytes, r-thin
factors: cheap next to the merge), all-gathers one int64 per replicated part, and raises the same
``ReplicasDisagreeError`` on every rank when any replicas differ, naming the tensors and the ranks.
Nothing received is unpickled: the names cross as UTF-8 bytes, the digests as int64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import xxhash

__all__ = ["ReplicaCheck", "ReplicaPart", "ReplicasDisagreeError", "digest"]

_SHOWN = 3
"""Tensors an error names before "and N more"."""


@dataclass(frozen=True, slots=True, order=True)
class ReplicaPart:
    """A part of a tensor a trainer rank holds a copy of.

    Attributes:
        name: the tensor's name as errors print it (a PEFT state-dict key, a Megatron parameter name); no newline.
        part: which part of it, the same text on every rank holding that part (``""``: the whole tensor;
            e.g. a global box ``"((0, 4), (0, 32))"``, an expert block ``"ep block 1/2"``).
    """

    name: str
    part: str = ""

    def __str__(self) -> str:
        return self.name if not self.part else f"{self.name} [{self.part}]"


class ReplicasDisagreeError(ValueError):
    """Replicas of some tensors hold different values; raised alike on every rank of the group.

    Attributes:
        differing: per differing part, its holders grouped by equal value (group ranks, ascending).
    """

    def __init__(self, message: str, differing: dict[ReplicaPart, tuple[tuple[int, ...], ...]] | None = None) -> None:
        super().__init__(message)  # args == (message,): it pickles (Ray carries it to the coordinator as itself)
        self.differing = differing or {}


def digest(t: torch.Tensor) -> int:
    """xxh3_64 of ``t``'s bytes (any dtype, shape, strides or device; a device tensor is copied to the host) as a
    signed 64-bit int (what an int64 collective carries)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    value = xxhash.xxh3_64_intdigest(flat.numpy())
    return value - (1 << 64) if value >= 1 << 63 else value


class ReplicaCheck:
    """The replica check of one trainer rank (see the module docstring).

    Args:
        parts: what this rank holds, each part once (the order of ``check``'s values).
        group: weightsync's process group (``None``: the default group, or none with ``world == 1``).
        rank, world: this rank's index in ``group`` and the group size (errors name group ranks).
        timeout_s: bound of each collective.
        device: where ``group``'s collectives take their tensors (``cpu`` for gloo, the current CUDA device for NCCL).

    Collective: every rank of ``group`` constructs it (one all-reduce and one all-gather of the names' bytes) and
    calls every ``check`` alike.

    Raises:
        ValueError: a part listed twice, or a name holding a newline (on this rank: a caller's bug).
        RuntimeError: a collective did not complete within ``timeout_s``.
    """

    def __init__(self, parts: Sequence[ReplicaPart], *, group, rank: int, world: int, timeout_s: float,
                 device: torch.device | str = "cpu") -> None:
        self.parts, self.group, self.rank, self.world = list(parts), group, rank, world
        self.timeout, self.device = timedelta(seconds=timeout_s), torch.device(device)
        if len(set(self.parts)) != len(self.parts):
            raise ValueError("ReplicaCheck: a part is listed twice; list each part this rank holds once")
        if any("\n" in p.name or "\n" in p.part or "\x1f" in p.name + p.part for p in self.parts):
            raise ValueError("ReplicaCheck: a part's name holds a newline or \\x1f; name tensors on one line")
        held = self._all_parts()
        holders: dict[ReplicaPart, list[int]] = {}
        for k, row in enumerate(held):
            for p in row:
                holders.setdefault(p, []).append(k)
        self.replicated: dict[ReplicaPart, tuple[int, ...]] = {
            p: tuple(ks) for p, ks in sorted(holders.items()) if len(ks) > 1}
        """Each part held by several ranks → its holders (group ranks), in one order on every rank."""
        index = {p: i for i, p in enumerate(self.replicated)}
        self._mine = [(i, index[p]) for i, p in enumerate(self.parts) if p in index]
        """(index in ``parts``, slot in the digest row) of this rank's replicated parts."""

    def check(self, values: Sequence[torch.Tensor], *, what: str) -> None:
        """Raise on every rank if replicas differ. ``values[i]``: this rank's copy of ``parts[i]`` (any dtype or
        device). ``what``: when, for the error (``"attach"``, ``"push of version 3"``). Collective (one int64
        all-gather of one value per replicated part) when any part is replicated; blocks at most ``timeout_s``.

        Raises:
            ReplicasDisagreeError: some replicas differ (the same message on every rank, naming the tensors and
                the ranks). ValueError: ``values`` does not match ``parts`` (this rank's bug).
            RuntimeError: the collective did not complete within ``timeout_s``.
        """
        if len(values) != len(self.parts):
            raise ValueError(f"ReplicaCheck.check: {len(values)} values for {len(self.parts)} parts")
        if not self.replicated:
            return
        row = torch.zeros(len(self.replicated), dtype=torch.int64)
        for i, slot in self._mine:
            row[slot] = digest(values[i])
        rows = self._gather(row.to(self.device))
        differing = {}
        for slot, (part, ranks) in enumerate(self.replicated.items()):
            by_value: dict[int, list[int]] = {}
            for k in ranks:
                by_value.setdefault(int(rows[k, slot]), []).append(k)
            if len(by_value) > 1:
                differing[part] = tuple(sorted(tuple(ks) for ks in by_value.values()))
        if differing:
            raise ReplicasDisagreeError(_message(differing, what), differing)

    def _gather(self, row: torch.Tensor) -> torch.Tensor:
        """``[world, n]``: every rank's row, on the host."""
        if self.world == 1:
            return row.cpu().unsqueeze(0)
        import torch.distributed as dist

        out = torch.empty((self.world, row.numel()), dtype=row.dtype, device=row.device)
        dist.all_gather(list(out.unbind(0)), row, group=self.group, async_op=True).wait(self.timeout)
        return out.cpu()

    def _all_parts(self) -> list[list[ReplicaPart]]:
        """Every rank's parts, in group rank order (the names cross as UTF-8 bytes, padded to the longest)."""
        text = "\n".join(f"{p.name}\x1f{p.part}" for p in self.parts).encode()
        if self.world == 1:
            return [self.parts]
        import torch.distributed as dist

        size = torch.tensor([len(text)], dtype=torch.int64, device=self.device)
        dist.all_reduce(size, op=dist.ReduceOp.MAX, group=self.group, async_op=True).wait(self.timeout)
        mine = torch.zeros(int(size) + 1, dtype=torch.uint8)
        mine[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else mine[:0]
        out = torch.empty((self.world, mine.numel()), dtype=torch.uint8, device=self.device)
        dist.all_gather(list(out.unbind(0)), mine.to(self.device), group=self.group, async_op=True).wait(self.timeout)
        rows = []
        for raw in out.cpu():
            decoded = bytes(raw.numpy()).rstrip(b"\0").decode()
            rows.append([ReplicaPart(*line.split("\x1f", 1)) for line in decoded.split("\n")] if decoded else [])
        return rows


def _message(differing: dict[ReplicaPart, tuple[tuple[int, ...], ...]], what: str) -> str:
    shown = "; ".join(f"{part}: ranks {' vs '.join(str(list(ks)) for ks in groups)}"
                      for part, groups in list(differing.items())[:_SHOWN])
    more = f"; and {len(differing) - _SHOWN} more" if len(differing) > _SHOWN else ""
    ranks = sorted({k for groups in differing.values() for ks in groups for k in ks})
    return (f"replicas disagree at {what}: trainer ranks {ranks} hold different values of {len(differing)} "
            f"replicated tensor(s) — {shown}{more}. Ranks holding the same part of a tensor must hold the same "
            f"values (a step that ran on some ranks only, or a rank restored from another checkpoint?); "
            f"bring the ranks back in step (e.g. load one checkpoint on every rank) and push again")
