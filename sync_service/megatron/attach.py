"""``attach_megatron``: a weight-sync endpoint in a Megatron-Core training rank, over its live model with Bridge LoRA.

    # on every rank, inside the Ray actor that runs it, after provide_distributed_model (Bridge LoRA applied):
    handle = attach_megatron(model_chunks, hf_config="Qwen3-30B-A3B/")   # the HF model it was converted from
    # the driver: WeightSync(trainers=[handles in rank order], engines=..., config=...)

The same endpoint contract as ``live.attach.attach_trainer`` (``live.endpoint.TrainerEndpoint`` over a
``state.MegatronState``), so ``WeightSync`` pushes full and delta versions into every engine kind unchanged.
Collective: every rank of the job calls it. Placements come from Megatron's own ``parallel_state`` and parameter
attributes (TP, EP, expert-TP, PP); whatever a rank cannot read (grouped-GEMM experts, a name outside the table,
an unknown Bridge version at expert-TP > 1, no alpha) fails attach on every rank, in one line naming it.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path

import torch

from sync_service.defaults import MAX_TIMEOUT_S
from sync_service.live.attach import AttachError
from sync_service.live.endpoint import TrainerEndpoint
from sync_service.live.handle import EndpointHandle, register
from sync_service.megatron.deviations import expert_fc2_rule
from sync_service.sharding.replicas import ReplicasDisagreeError

__all__ = ["attach_megatron", "build_megatron_endpoint", "MegatronEndpoint", "weightsync_group"]

_ERROR_BYTES = 600


class MegatronEndpoint(TrainerEndpoint):
    """``TrainerEndpoint`` over a ``MegatronState`` (merged mode and factor streaming: ``factor_terms.py``)."""


def attach_megatron(model_chunks, *, hf_config, lora_alpha: float | None = None, group=None, timeout_s: float = 120.0,
                    before_send: Callable[[int], None] | None = None) -> EndpointHandle:
    """Attach a weight-sync endpoint to this Megatron-Core rank's live model; returns its handle.

    Args:
        model_chunks: the rank's model chunks (``provide_distributed_model``'s list; DDP-wrapped or not) with
            Megatron-Bridge LoRA applied (``LoRA(target_modules=[...], dim, alpha)``). Read in place, never written.
        hf_config: the HF model the Megatron model was converted from: its directory (``config.json``), the
            ``config.json`` dict, or a transformers ``PretrainedConfig`` — the engines' names and the q/k/v geometry.
        lora_alpha: Bridge's LoRA alpha, where the adapter modules carry none (Bridge's do: then it must equal theirs).
        group: process group for weightsync's own collectives; ``None``: a new gloo group over all ranks.
        timeout_s: bound of every collective weightsync runs.
        before_send: called with the version at the start of each send (a test injection point).

    Must run inside a Ray actor that accepts concurrent calls (``live/handle.py``).

    Raises:
        AttachError: on every rank alike, one line naming the rank and the reason (a placement weightsync cannot read,
            grouped-GEMM experts, an unknown Bridge version at expert-TP > 1, alpha missing or differing, replicas
            that disagree). RuntimeError: not inside a Ray actor.
    """
    import ray

    try:
        actor = ray.get_runtime_context().current_actor if ray.is_initialized() else None
    except RuntimeError:
        actor = None
    if actor is None:
        raise RuntimeError("attach_megatron runs inside the Ray actor of a Megatron training rank (the coordinator "
                           "reaches the endpoint through that actor); call it from the actor's method")
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("attach_megatron: torch.distributed is not initialized (Megatron's ranks initialize it)")
    _check_timeout(timeout_s)
    group = group if group is not None else weightsync_group(timeout_s)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    endpoint = build_megatron_endpoint(model_chunks, hf_config=hf_config, lora_alpha=lora_alpha, group=group,
                                       rank=rank, world=world, timeout_s=timeout_s, before_send=before_send)
    endpoint_id = f"megatron{rank}-{uuid.uuid4().hex[:8]}"
    register(endpoint_id, endpoint)
    return EndpointHandle(actor=actor, endpoint_id=endpoint_id, rank=rank, world=world)


def build_megatron_endpoint(model_chunks, *, hf_config, lora_alpha=None, group, rank: int, world: int,
                            timeout_s: float = 120.0, before_send=None) -> MegatronEndpoint:
    """The endpoint of ``attach_megatron`` without the Ray registration. Collective on ``group``.

    Raises:
        As ``attach_megatron``.
    """
    from megatron.core import parallel_state as ps

    from sync_service.megatron.state import MegatronState

    _check_timeout(timeout_s)
    error, state, digest = None, None, 0
    try:
        config = _config(hf_config)
        rule = expert_fc2_rule(ps.get_expert_tensor_parallel_world_size())
        state = MegatronState(model_chunks, config=config, alpha=lora_alpha, group=group, rank=rank, world=world,
                              timeout_s=timeout_s, fc2_rule=rule)
        digest = _digest(config, rule, state)
    except Exception as exc:  # noqa: BLE001 - whatever one rank hits fails every rank now, not after timeout_s
        error = exc
    _agree(rank, world, group, error, digest, timeout_s)
    try:
        state.prepare()
    except (ReplicasDisagreeError, ValueError) as exc:  # raised alike on every rank
        raise AttachError(f"attach_megatron: {exc}; no rank attached") from exc
    return MegatronEndpoint(state, rank=rank, before_send=before_send)


def weightsync_group(timeout_s: float):
    """A new gloo group over every rank of the job, for attach's collectives. Collective; gloo connects every rank
    at creation, so a rank that never calls attach is waited for ``timeout_s`` (torch's default: 30 minutes).

    Raises:
        AttachError: not every rank created it within ``timeout_s``."""
    import torch.distributed as dist

    try:
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as exc:  # DistStoreError: a rank did not create its end in time
        raise AttachError(f"attach_megatron: rank {dist.get_rank()}: not every rank called attach_megatron within "
                          f"timeout_s={timeout_s:g} ({type(exc).__name__}); call it on every rank of the job") from None


def _check_timeout(timeout_s) -> None:
    """Raises AttachError: ``timeout_s`` is not a number of seconds in (0, ``MAX_TIMEOUT_S``]."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise AttachError(f"attach_megatron: timeout_s={timeout_s!r} must be a finite number of seconds > 0 and "
                          f"<= {MAX_TIMEOUT_S:.0f}")


def _config(hf_config) -> dict:
    """``hf_config`` (a directory, a ``config.json`` path, a dict, a ``PretrainedConfig``) as a dict.

    Raises:
        ValueError: no such config (named)."""
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    path = Path(hf_config)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"attach_megatron: hf_config={str(hf_config)!r} has no config.json; give the HF model "
                         f"directory the Megatron model was converted from")
    try:
        config = json.loads(path.read_text())
    except (ValueError, OSError) as exc:  # JSONDecodeError / UnicodeDecodeError are ValueErrors
        raise ValueError(f"attach_megatron: hf_config {str(path)!r} is not a JSON config ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:120]}); give the HF model directory the Megatron model was "
                         f"converted from") from None
    if not isinstance(config, dict):
        raise ValueError(f"attach_megatron: hf_config {str(path)!r} holds {type(config).__name__}, not a config object; "
                         f"give the HF model directory the Megatron model was converted from")
    return config


def _digest(config: dict, rule: str, state) -> int:
    """What every rank must agree on: the HF config, the fc2 rule, the LoRA scales."""
    scales = sorted({round(t.scale, 12) for t in state.terms.values()})
    text = json.dumps([config, rule, scales], sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _agree(rank: int, world: int, group, error, digest: int, timeout_s: float) -> None:
    """All-gather (failed, digest, the error's first bytes) and fail every rank alike, in one line.

    Raises:
        AttachError: a rank failed (its message, on every rank), or the ranks disagree."""
    text = "" if error is None else " ".join(f"{type(error).__name__}: {error}".split())
    raw = text.encode()[:_ERROR_BYTES]
    mine = torch.zeros(2 + _ERROR_BYTES, dtype=torch.int64)
    mine[0], mine[1] = int(error is not None), digest
    mine[2:2 + len(raw)] = torch.tensor(list(raw), dtype=torch.int64) if raw else mine[2:2]
    rows = [mine]
    if world > 1:
        import torch.distributed as dist

        rows = [torch.empty_like(mine) for _ in range(world)]
        try:
            dist.all_gather(rows, mine, group=group, async_op=True).wait(timedelta(seconds=timeout_s))
        except (RuntimeError, dist.DistError) as exc:  # a rank died or failed outside the checks before agreeing
            raise AttachError(f"attach_megatron: rank {rank}: not every rank reached attach's agreement within "
                              f"timeout_s={timeout_s:g} ({type(exc).__name__}: {' '.join(str(exc).split())[:160]}); "
                              f"see the other ranks' logs; no rank attached") from error
    failed = [k for k, row in enumerate(rows) if row[0]]
    if failed:
        first = rows[failed[0]]
        message = bytes(int(v) for v in first[2:] if v).decode(errors="replace")
        raise AttachError(f"attach_megatron: rank {failed[0]}"
                          f"{f' (and {len(failed) - 1} more)' if len(failed) > 1 else ''} refused: {message}; "
                          f"no rank attached") from error
    if len({int(row[1]) for row in rows}) > 1:
        raise AttachError("attach_megatron: the ranks disagree on the HF config, the LoRA scales or the Bridge rule; "
                          "attach the same model on every rank")
