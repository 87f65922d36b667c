"""``attach_trainer``: embed a weight-sync endpoint in a training rank, over its live PEFT model.

    # on every training rank, inside the Ray actor that runs it, after wrapping the model:
    handle = attach_trainer(peft_model)                     # plain, DDP, FSDP2 / HSDP / FSDP2 x TP (DTensors)
    handle = attach_trainer(peft_model, expert_range=(e0, e1))   # expert parallel: this rank's experts
    # the driver: WeightSync(trainers=[handles in rank order], engines=..., config=...)

Collective: every rank of the default process group calls it (it makes weightsync's own process group, NCCL for
CUDA parameters and gloo for CPU ones (``transports.devices.group_backend``), unless ``group=`` is given, and
checks that all ranks agree before returning). Bad input fails on
every rank, before any byte moves, naming the parameter and the fix.
"""

from __future__ import annotations

import hashlib
import operator
import uuid
from collections.abc import Callable
from datetime import timedelta

import torch

from sync_service.defaults import MAX_TIMEOUT_S
from sync_service.live.base import ExpertBlock
from sync_service.live.endpoint import TrainerEndpoint
from sync_service.live.handle import EndpointHandle, register
from sync_service.live.model import LiveModel, check_keys_match_peft, read_live_model
from sync_service.live.state import LiveState
from sync_service.sharding.replicas import ReplicasDisagreeError
from sync_service.transports.devices import group_backend, group_device

__all__ = ["attach_trainer", "AttachError"]


class AttachError(ValueError):
    """A rank refused to attach (its own reason, or a peer's); raised on every rank alike."""


def attach_trainer(model, *, group=None, expert_range: tuple[int, int] | None = None, adapter_name: str | None = None,
                   timeout_s: float = 120.0, before_send: Callable[[int], None] | None = None) -> EndpointHandle:
    """Attach a weight-sync endpoint to this training rank's live PEFT LoRA model; returns its handle.

    Args:
        model: the ``peft.PeftModel`` being trained (a DDP wrapper of it, or one whose parameters are
            DTensors on any mesh of the job's ranks: FSDP2 ``fully_shard`` on any dim, HSDP, FSDP2 × TP
            ``parallelize_module``; ``placement.py``). Read in place, never written.
        group: process group for weightsync's own collectives (factor gathers); ``None``: a new group over all
            ranks, of the parameters' device's backend (NCCL for CUDA, gloo for CPU), so the training group's
            collectives never interleave with a sync. A given group's backend must move tensors of the
            parameters' device (its gathers run there).
        expert_range: ``(e0, e1)``, the global experts this rank's module holds under expert parallelism
            (contiguous equal blocks in rank order, as torchtitan / Megatron place them); ``None`` otherwise.
        adapter_name: the PEFT adapter to sync (default: the active one).
        timeout_s: bound of every collective weightsync runs on ``group``.
        before_send: called with the version at the start of each send (test injection point).

    Must run inside a Ray actor that accepts concurrent calls (see ``handle.py``).

    Raises:
        TypeError: not a PEFT model. AttachError: a bad adapter name, a placement the endpoint cannot read
            (``Partial``, strided rows: named),
            an ``expert_range`` that is not two ints ``0 <= e0 < e1``, expert ranges that do not tile the
            experts, ranks that disagree (their models; or replicated LoRA factors whose values differ, naming the
            tensors and ranks: ``sharding/replicas.py``) — on every rank; a ``timeout_s`` that is not finite and > 0.
        RuntimeError: not inside a Ray actor.
    """
    import ray

    try:
        actor = ray.get_runtime_context().current_actor if ray.is_initialized() else None
    except RuntimeError:  # the driver, or a task: no actor
        actor = None
    if actor is None:
        raise RuntimeError("attach_trainer runs inside the Ray actor of a training rank (the coordinator reaches the "
                           "endpoint through that actor); call it from the actor's method")
    rank, world, group = _group(group, _param_device(model))
    endpoint = build_endpoint(model, group=group, rank=rank, world=world, expert_range=expert_range,
                              adapter_name=adapter_name, timeout_s=timeout_s, before_send=before_send)
    endpoint_id = f"trainer{rank}-{uuid.uuid4().hex[:8]}"
    register(endpoint_id, endpoint)
    return EndpointHandle(actor=actor, endpoint_id=endpoint_id, rank=rank, world=world)


def build_endpoint(model, *, group, rank: int, world: int, expert_range=None, adapter_name=None, timeout_s: float = 120.0,
                   before_send=None) -> TrainerEndpoint:
    """The endpoint of ``attach_trainer`` without the Ray registration (any process group, e.g. tests
    under ``torch.multiprocessing``). Collective on ``group`` when ``world > 1``.

    Raises:
        As ``attach_trainer``.
    """
    if not 0 < timeout_s <= MAX_TIMEOUT_S:  # also NaN; the same on every rank (before any collective)
        raise AttachError(f"attach_trainer: timeout_s={timeout_s!r} must be a finite number of seconds > 0 and "
                          f"<= {MAX_TIMEOUT_S:.0f} (a week)")
    error, state, shape_digest, experts_at = None, None, 0, None
    try:
        experts_at = _expert_range(expert_range)
        live = read_live_model(model, adapter_name=adapter_name)
        check_keys_match_peft(live, model)
        shape_digest = _digest(live, experts_at)
        experts = None if experts_at is None else _expert_block(experts_at, world)
        state = LiveState.over_model(live, group=group, rank=rank, world=world, experts=experts, timeout_s=timeout_s)
    except (ValueError, TypeError) as exc:
        error = exc
    ranges = _agree(rank, world, group, error, shape_digest, experts_at, timeout_s, _collective_device(group, world))
    if expert_range is not None:
        _check_tiling(ranges)
    try:
        state.prepare()  # normalises the adapter's structure once; replicas must agree (live/replicas.py)
    except ReplicasDisagreeError as exc:  # raised alike on every rank
        raise AttachError(f"attach_trainer: {exc}; no rank attached") from exc
    return TrainerEndpoint(state, rank=rank, before_send=before_send)


def _group(group, device: torch.device):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise RuntimeError("attach_trainer: group= given but torch.distributed is not initialized")
        return 0, 1, None
    if group is None:  # weightsync's own: never the training group's collectives
        group = dist.new_group(backend=group_backend(device))
    return dist.get_rank(group), dist.get_world_size(group), group


def _param_device(model) -> torch.device:
    """The device of the model's first parameter (``cpu`` without any): the group's backend follows it. A model
    spread over several devices is refused later, at ``read_live_model``, on every rank alike."""
    first = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return torch.device("cpu") if first is None else first.device


def _collective_device(group, world: int) -> torch.device:
    """Where ``group``'s collectives take their tensors (``transports.devices.group_device``); host without one."""
    if world == 1 or group is None:
        return torch.device("cpu")
    import torch.distributed as dist

    return group_device(dist.get_backend(group))


def _digest(live: LiveModel, expert_range) -> int:
    """A 62-bit digest of what every rank must agree on: names, shapes, dtypes, LoRA settings, EP or not."""
    c = live.peft_config
    parts = [f"{n}:{tuple(p.param.shape)}:{p.param.dtype}" for n, p in sorted({**live.base, **live.factors}.items())]
    parts += [f"r={c.r} alpha={c.lora_alpha} rslora={c.use_rslora} dora={c.use_dora} ep={expert_range is not None}",
              f"rank_pattern={sorted(c.rank_pattern.items())} alpha_pattern={sorted(c.alpha_pattern.items())}"]
    return int.from_bytes(hashlib.sha256("\n".join(parts).encode()).digest()[:8], "little") >> 2


def _agree(rank: int, world: int, group, error, digest: int, expert_range, timeout_s: float,
           device: torch.device) -> list[tuple[int, int]]:
    """All-gather (ok, digest, expert range) on ``device`` (the group's) and fail every rank alike; the expert
    ranges of all ranks.

    Raises:
        AttachError: this or another rank failed, or the ranks' models differ.
    """
    e0, e1 = expert_range if expert_range is not None else (-1, -1)
    mine = torch.tensor([0 if error is None else 1, digest, e0, e1], dtype=torch.int64, device=device)
    if world == 1:
        rows = [mine]
    else:
        import torch.distributed as dist

        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine, group=group, async_op=True).wait(timedelta(seconds=timeout_s))
        rows = [row.cpu() for row in rows]
    if error is not None:
        raise AttachError(str(error)) from error
    failed = [k for k, row in enumerate(rows) if row[0]]
    if failed:
        raise AttachError(f"attach_trainer: rank(s) {failed} refused to attach (see their error); no rank attached")
    digests = {int(row[1]) for row in rows}
    if len(digests) > 1:
        raise AttachError(f"attach_trainer: the ranks' models differ (parameter names, shapes, dtypes or LoRA "
                          f"settings; {len(digests)} variants over {world} ranks); attach the same PEFT model on every rank")
    return [(int(row[2]), int(row[3])) for row in rows]


def _expert_range(expert_range) -> tuple[int, int] | None:
    """``expert_range`` as two ints ``0 <= e0 < e1 < 2**62`` (what the ranks all-gather as int64), or ``None``.

    Raises:
        ValueError: anything else (a triple, floats, strings, bools, a reversed or negative range).
    """
    if expert_range is None:
        return None
    try:
        e0, e1 = (operator.index(e) for e in expert_range if not isinstance(e, bool))
    except (TypeError, ValueError):
        e0 = e1 = -1
    if not 0 <= e0 < e1 < 1 << 62:
        raise ValueError(f"attach_trainer: expert_range={expert_range!r} must be two ints (e0, e1) with 0 <= e0 < e1: "
                         f"the global experts [e0, e1) this rank holds")
    return e0, e1


def _expert_block(expert_range: tuple[int, int], world: int) -> ExpertBlock:
    e0, e1 = expert_range
    return ExpertBlock(start=e0, stop=e1, num_experts=(e1 - e0) * world)


def _check_tiling(ranges: list[tuple[int, int]]) -> None:
    """Every rank's expert range, in rank order, tiles ``[0, E)`` in equal contiguous blocks.

    Raises:
        AttachError: the ranges overlap, leave gaps, or differ in size (on every rank alike).
    """
    size = ranges[0][1] - ranges[0][0]
    expected = [(k * size, (k + 1) * size) for k in range(len(ranges))]
    if size < 1 or ranges != expected:
        raise AttachError(f"attach_trainer: expert_range per rank {ranges} must be equal contiguous blocks in rank "
                          f"order, {expected[:3]}…; pass each rank's own (e0, e1)")
