"""A Megatron rank's LoRA as merge-core terms (``merge.terms.LoraTerm``) for factor streaming.

In factor mode (``SyncConfig.mode`` "factors" / "auto") the engines merge: the trainers send the pristine base boxes
once and the LoRA factors of every version as recipe blocks (``factor_stream``). Each Megatron rank's update of a
segment it sends (``state.py``) is one term ``s · x @ y`` on the segment's rows and columns of the hf-fused tensor:
x = Bridge's ``linear_out`` rows of the segment (gathered where the split requires), y = ``linear_in``'s columns;
for the experts' ``linear_fc2`` at expert-TP > 1 under Bridge 0.6.2's block-diagonal rule, x = ETP · this rank's own
``linear_out`` rows, on those rows only (``deviations.py``). Terms of different ranks never overlap. The planning rank
(rank 0) must know every rank's terms: ``exchange`` all-gathers their descriptions (UTF-8 bytes, never pickles) and
orders them one way on every rank, so a recipe's term index means the same term everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch

from sync_service.merge.terms import LoraAdapter, LoraTerm

__all__ = ["TermSpec", "exchange", "structure", "term_values"]


@dataclass(frozen=True, slots=True, order=True)
class TermSpec:
    """One term's place: target, experts (``(-1, -1)``: a 2-D target), rows, cols (hf-fused), rank, scaling."""

    name: str
    experts: tuple[int, int]
    rows: tuple[int, int]
    cols: tuple[int, int]
    rank: int
    scaling: float

    def line(self) -> str:
        return "\x1f".join([self.name, *(f"{a},{b}" for a, b in (self.experts, self.rows, self.cols)), str(self.rank),
                            repr(self.scaling)])

    @classmethod
    def parse(cls, line: str) -> "TermSpec":
        name, e, r, c, rank, scaling = line.split("\x1f")
        pair = lambda s: tuple(int(v) for v in s.split(","))  # noqa: E731
        return cls(name, pair(e), pair(r), pair(c), int(rank), float(scaling))

    def zero(self) -> LoraTerm:
        """The term with zero factors (fp32)."""
        n, m = self.rows[1] - self.rows[0], self.cols[1] - self.cols[0]
        lead = () if self.experts == (-1, -1) else (self.experts[1] - self.experts[0],)
        return LoraTerm(None if not lead else self.experts, (*self.rows, 1), (*self.cols, 1),
                        torch.zeros((*lead, n, self.rank)), torch.zeros((*lead, self.rank, m)), self.scaling)


def exchange(mine: list[TermSpec], *, group, world: int, timeout_s: float) -> list[TermSpec]:
    """Every rank's term specs, sorted one way (collective on ``group``: an all-reduce and an all-gather of bytes)."""
    text = "\n".join(t.line() for t in mine).encode()
    if world == 1:
        return sorted(mine)
    import torch.distributed as dist

    wait = timedelta(seconds=timeout_s)
    size = torch.tensor([len(text)], dtype=torch.int64)
    dist.all_reduce(size, op=dist.ReduceOp.MAX, group=group, async_op=True).wait(wait)
    buf = torch.zeros(int(size) + 1, dtype=torch.uint8)
    if text:
        buf[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    rows = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(rows, buf, group=group, async_op=True).wait(wait)
    out = set()
    for row in rows:
        decoded = bytes(row.numpy()).rstrip(b"\0").decode()
        out.update(TermSpec.parse(line) for line in decoded.split("\n") if line)
    return sorted(out)


def structure(specs: list[TermSpec]) -> LoraAdapter:
    """The whole adapter's structure: every rank's terms, zero factors, in ``specs``' order per target."""
    terms: dict[str, list[LoraTerm]] = {}
    for spec in specs:
        terms.setdefault(spec.name, []).append(spec.zero())
    return LoraAdapter(terms=terms)


def term_values(spec: TermSpec, x: torch.Tensor, y: torch.Tensor) -> LoraTerm:
    """``spec``'s term with factors ``x`` [rows, r], ``y`` [r, cols] (fp32; a leading expert dim added for 3-D)."""
    x, y = x.to(torch.float32).contiguous(), y.to(torch.float32).contiguous()
    if spec.experts != (-1, -1):
        x, y = x.unsqueeze(0), y.unsqueeze(0)
    return LoraTerm(None if spec.experts == (-1, -1) else spec.experts, (*spec.rows, 1), (*spec.cols, 1), x, y,
                    spec.scaling)
