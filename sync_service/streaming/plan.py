"""Sync plans: which sender sends which box of which tensor, in which bucket, at which offset.

A plan is built once from a source's ``param_metas`` and reused every sync; a delta sync uses
``subset_plan(plan, names)``, the same entries re-packed densely (a deterministic function, so
sender and receivers derive the same sub-plan from the names in ``Begin``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache

from protocols.params import DTYPE_BYTES, Box, ParamMeta, box_numel
from protocols.wire import ALIGN_BYTES, PlanEntry, SyncPlan

DEFAULT_BUCKET_BYTES = 256 << 20


def split_box(box: Box, itemsize: int, cap_bytes: int) -> Iterator[Box]:
    """Cut ``box`` along its leading dims into boxes of at most ``cap_bytes`` each.

    Each piece is a run of whole rows of dim 0 when a row fits; otherwise each row of dim 0 is cut
    along dim 1, and so on. Pieces are yielded in row-major order.

    Raises:
        ValueError: one element is larger than ``cap_bytes``.
    """
    if box_numel(box) * itemsize <= cap_bytes:
        yield box
        return
    if not box:
        raise ValueError(f"bucket_bytes={cap_bytes} is smaller than one element ({itemsize} bytes)")
    (start, stop), rest = box[0], box[1:]
    row_bytes = box_numel(rest) * itemsize
    if row_bytes <= cap_bytes:
        rows = cap_bytes // row_bytes
        for s in range(start, stop, rows):
            yield ((s, min(s + rows, stop)),) + rest
        return
    for i in range(start, stop):
        for piece in split_box(rest, itemsize, cap_bytes):
            yield ((i, i + 1),) + piece


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def _pack(pieces: Iterable[tuple], sender: int, cap: int) -> list[PlanEntry]:
    """Greedy packing of ``(name, dtype, shape, box[, kind, recipe])`` pieces (recipes are kept)."""
    entries, bucket, offset = [], 0, 0
    for name, dtype, shape, box, *extra in pieces:
        kind, recipe = extra if extra else ("tensor", None)
        nbytes = box_numel(box) * DTYPE_BYTES[dtype]
        offset = _align(offset)
        if offset + nbytes > cap and offset > 0:
            bucket, offset = bucket + 1, 0
        entries.append(PlanEntry(name=name, dtype=dtype, shape=tuple(shape), box=box, sender=sender,
                                 bucket=bucket, offset=offset, nbytes=nbytes, kind=kind, recipe=recipe))
        offset += nbytes
    return entries


def build_plan(metas: Sequence[ParamMeta], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, sender: int = 0) -> SyncPlan:
    """Plan one sender's stream: ``metas`` in order, split to fit, packed greedily into buckets.

    Raises:
        ValueError: unknown dtype, a box outside its shape, a (name, box) listed twice, or
            ``bucket_bytes`` not a positive multiple of 64.
    """
    if bucket_bytes <= 0 or bucket_bytes % ALIGN_BYTES:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be a positive multiple of {ALIGN_BYTES}")
    pieces = []
    for m in metas:
        if m.dtype not in DTYPE_BYTES:
            raise ValueError(f"{m.name}: dtype {m.dtype!r} is not a wire dtype; use one of {sorted(DTYPE_BYTES)}")
        box = m.covered_box()
        if len(box) != len(m.shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(box, m.shape)):
            raise ValueError(f"{m.name}: box {box} is not inside shape {m.shape}")
        pieces.extend((m.name, m.dtype, m.shape, b) for b in split_box(box, DTYPE_BYTES[m.dtype], bucket_bytes))
    plan = SyncPlan(bucket_bytes=bucket_bytes, entries=tuple(_pack(pieces, sender, bucket_bytes)))
    _check_unique(plan.entries)
    return plan


def _check_unique(entries: Sequence[PlanEntry]) -> None:
    seen: set = set()
    for e in entries:
        if e.key in seen:
            raise ValueError(f"{e.name}: box {e.box} is planned twice (two senders or a repeated meta)")
        seen.add(e.key)


def combine_plans(plans: Sequence[SyncPlan]) -> SyncPlan:
    """One plan from per-sender plans (``build_plan(..., sender=rank)`` on each trainer shard).

    Raises:
        ValueError: different ``bucket_bytes``, a sender in two plans, or a box planned twice.
    """
    if not plans:
        raise ValueError("combine_plans needs at least one plan")
    caps = {p.bucket_bytes for p in plans}
    if len(caps) != 1:
        raise ValueError(f"plans disagree on bucket_bytes: {sorted(caps)}")
    entries = tuple(e for p in sorted(plans, key=lambda p: min((e.sender for e in p.entries), default=0))
                    for e in p.entries)
    owners = [sorted({e.sender for e in p.entries}) for p in plans]
    flat = [s for o in owners for s in o]
    if len(flat) != len(set(flat)):
        raise ValueError(f"a sender appears in two plans: senders per plan {owners}")
    _check_unique(entries)
    return SyncPlan(bucket_bytes=caps.pop(), entries=entries)


@lru_cache(maxsize=32)
def subset_plan(plan: SyncPlan, names: frozenset[str] | None) -> SyncPlan:
    """The entries of ``names`` (``None``: all), re-packed per sender. Cached: plans are immutable.

    Raises:
        KeyError: a name the plan does not contain.
    """
    if names is None:
        return plan
    missing = names - {e.name for e in plan.entries}
    if missing:
        raise KeyError(f"names not in the plan: {sorted(missing)[:5]} ({len(missing)} in all)")
    entries: list[PlanEntry] = []
    for sender in senders(plan):
        pieces = [(e.name, e.dtype, e.shape, e.box, e.kind, e.recipe) for e in plan.entries
                  if e.sender == sender and e.name in names]
        entries.extend(_pack(pieces, sender, plan.bucket_bytes))
    return SyncPlan(bucket_bytes=plan.bucket_bytes, entries=tuple(entries), session=plan.session, version=plan.version)


def senders(plan: SyncPlan) -> list[int]:
    """Sender indices of a plan, in order of first appearance."""
    return list(dict.fromkeys(e.sender for e in plan.entries))


def buckets_of(plan: SyncPlan, sender: int) -> list[tuple[PlanEntry, ...]]:
    """Entries of ``sender`` grouped by bucket index (index = sequence number)."""
    out: list[list[PlanEntry]] = []
    for e in plan.entries:
        if e.sender == sender:
            while len(out) <= e.bucket:
                out.append([])
            out[e.bucket].append(e)
    return [tuple(b) for b in out]


def count_pieces(box: Box, itemsize: int, cap_bytes: int) -> int:
    """How many boxes ``split_box(box, itemsize, cap_bytes)`` yields, computed without splitting (O(ndim)).

    Raises:
        ValueError: one element is larger than ``cap_bytes``.
    """
    if box_numel(box) * itemsize <= cap_bytes:
        return 1
    if not box:
        raise ValueError(f"bucket_bytes={cap_bytes} is smaller than one element ({itemsize} bytes)")
    (start, stop), rest = box[0], box[1:]
    row_bytes = box_numel(rest) * itemsize
    if row_bytes <= cap_bytes:
        return -(-(stop - start) // (cap_bytes // row_bytes))
    return (stop - start) * count_pieces(rest, itemsize, cap_bytes)


def plan_entries(metas: Iterable[ParamMeta], bucket_bytes: int) -> int:
    """Entries of a plan of ``metas`` (all senders) cut at ``bucket_bytes``, without building it."""
    return sum(count_pieces(m.covered_box(), DTYPE_BYTES[m.dtype], bucket_bytes) for m in metas)


def smallest_bucket_bytes(metas: Sequence[ParamMeta], max_entries: int) -> int:
    """The smallest multiple of 64 bytes whose plan of ``metas`` has at most ``max_entries`` entries
    (``plan_entries`` falls as ``bucket_bytes`` grows; at the largest tensor's size it is one per box)."""
    largest = max((box_numel(m.covered_box()) * DTYPE_BYTES[m.dtype] for m in metas), default=ALIGN_BYTES)
    lo, hi = 1, max(1, _align(largest) // ALIGN_BYTES)
    while lo < hi:
        mid = (lo + hi) // 2
        if plan_entries(metas, mid * ALIGN_BYTES) <= max_entries:
            hi = mid
        else:
            lo = mid + 1
    return lo * ALIGN_BYTES
