"""TRL: a ``TrainerCallback`` that pushes the live policy to the rollout engines after every optimizer step,
and a ``rollout_func`` that makes GRPO's completions on those engines.

    engines = start_engines(base_dir, 2)
    trainer = GRPOTrainer(model=..., peft_config=LoraConfig(...), args=GRPOConfig(...),
                          rollout_func=engine_rollout_func(engines, max_new_tokens=64),   # optional
                          callbacks=[WeightSyncCallback(engines=engines, config=SyncConfig(transport="shm"))])
    trainer.train()        # version k = state.global_step is on every engine after step k

Every training process runs inside a Ray actor that accepts concurrent calls (``max_concurrency >= 2``).
At ``on_train_begin`` the callback attaches an endpoint to the trainer's PEFT model (``attach_trainer``,
read in place). One process: it builds the coordinator (``WeightSync``) there. Several processes
(``torch.distributed`` initialized, world > 1, as accelerate sets it up): every rank attaches (a
collective), rank 0 gathers every rank's ``EndpointHandle`` and alone builds the coordinator and
pushes; the other ranks' endpoints are driven by it through their actors. After each push every rank
learns from rank 0 whether it committed (a broadcast on the training group), so no rank starts the next
step's generation before its version is served, and a failed push fails every rank. Requires ``trl``
(``pip install weightsync[trl]``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
from transformers import TrainerCallback

from sync_service.api import SyncConfig, SyncError, SyncMetrics, WeightSync
from sync_service.live import attach_trainer

__all__ = ["RankZeroFailed", "WeightSyncCallback", "engine_rollout_func", "gather_handles"]


class RankZeroFailed(SyncError):
    """Raised on the ranks other than 0 when rank 0's coordinator failed (rank 0 raises the error itself).
    Picklable (it crosses Ray from the rank's actor)."""

    def __init__(self, message: str, metrics: SyncMetrics | None = None) -> None:
        super().__init__(message, metrics)


class WeightSyncCallback(TrainerCallback):
    """Pushes ``state.global_step`` after every optimizer step (and version 0 before the first).

    Args:
        engines: the rollout engine actors (``RolloutEngine`` / any rollout endpoint).
        config: the ``SyncConfig`` of the coordinator.
        on_push: called on rank 0 with ``(version, metrics, model)`` after each committed push (metrics,
            logging, tests), before the other ranks go on.
        adapter_name: the PEFT adapter to sync (default: the active one).

    Raises (from ``trainer.train()``, on every rank alike):
        AttachError / TypeError: the trainer's model is not a PEFT LoRA model (pass ``peft_config=``).
        SyncError / ValueError: a push failed (every engine keeps serving the previous version; a
            ``ValueError``: a version at or below what the engines serve, see ``SyncConfig.reset_versions``),
            or ``on_push`` raised. On rank 0 the original error (the coordinator is closed); on the other
            ranks ``RankZeroFailed`` (a ``SyncError``) naming rank 0.
        RuntimeError: a rank did not reach the handle gather within ``config.timeout_s``, or rank 0's
            outcome of a push within ``2·timeout_s + 120`` s (gloo's timeout, named).
    """

    def __init__(self, *, engines: Sequence, config: SyncConfig | None = None,
                 on_push: Callable[[int, SyncMetrics, object], None] | None = None, adapter_name: str | None = None) -> None:
        self.engines, self.config = list(engines), config or SyncConfig()
        self.on_push, self.adapter_name = on_push, adapter_name
        self.sync: WeightSync | None = None
        self.metrics: list[SyncMetrics] = []
        self.rank, self.world = 0, 1

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("WeightSyncCallback: the trainer passed no model to on_train_begin")
        self.rank, self.world = _rank_world()
        handle = attach_trainer(model, adapter_name=self.adapter_name, timeout_s=self.config.timeout_s)
        handles = [handle] if self.world == 1 else gather_handles(handle, self.world, timeout_s=self.config.timeout_s)
        self._on_rank0(lambda: self._start(handles, state.global_step, model), f"start + push {state.global_step}")

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._on_rank0(lambda: self._push(state.global_step, model), f"push {state.global_step}")

    def on_train_end(self, args, state, control, **kwargs):
        self._on_rank0(self._close, "close")  # the other ranks stay up until rank 0 closed their channels

    def _start(self, handles: list, version: int, model) -> None:
        self.sync = WeightSync(trainers=handles, engines=self.engines, config=self.config)
        self._push(version, model)

    def _push(self, version: int, model) -> None:
        metrics = self.sync.push(version)
        self.metrics.append(metrics)
        if self.on_push is not None:
            self.on_push(version, metrics, model)

    def _close(self) -> None:
        if self.sync is not None:
            self.sync.close()
            self.sync = None

    def _close_after(self, error: BaseException) -> None:
        """Close the coordinator after a failure (training stops: ``on_train_end`` will not come)."""
        try:
            self._close()
        except Exception as exc:  # noqa: BLE001 - the first error is the one raised
            error.add_note(f"WeightSyncCallback: closing the coordinator after it also failed: {exc!r}")
            self.sync = None

    def _on_rank0(self, work: Callable[[], None], what: str) -> None:
        """Run ``work`` on rank 0 only; every rank then learns whether it succeeded (one broadcast on the
        default group, bounded) and raises if not."""
        error = None
        if self.rank == 0:
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others learned of it
                error = exc
                self._close_after(exc)  # while the other ranks (their endpoints) still wait below
        if self.world > 1:
            flag = torch.tensor([0 if error is None else 1], dtype=torch.int64)
            _wait(torch.distributed.broadcast(flag, src=0, async_op=True), self.config.timeout_s * 2 + 120,
                  f"rank 0's {what}")
            if self.rank != 0 and int(flag[0]):
                raise RankZeroFailed(f"WeightSyncCallback: rank 0's {what} failed (see rank 0's error); training stops "
                                     f"on every rank")
        if error is not None:
            raise error


def engine_rollout_func(engines: Sequence, *, max_new_tokens: int, temperature: float = 1.0, seed: int = 0,
                        timeout_s: float = 120.0, check_version: bool = True,
                        on_rollout: Callable[[int, list[int | None]], None] | None = None) -> Callable:
    """A ``rollout_func`` for TRL's ``GRPOTrainer``: completions sampled by the rollout engines' ``sample``.

    TRL calls it with this process's prompts (strings; each already repeated ``num_generations`` times
    by TRL's sampler, repeats adjacent) and the trainer. Each run of equal adjacent prompts becomes one
    ``engine.sample(prompt_ids, max_new_tokens, run_length, temperature, seed')`` call; runs go round
    robin over ``engines`` (offset by the process index), ``seed'`` derives from ``seed``, the global
    step, the process index and the run index (reproducible; different per rank). Prompts are
    tokenized as TRL does (``processing_class(text=prompts)``); each completion is cut after its first
    EOS token (kept), as TRL's own generation masks it.

    Args:
        engines: ``RolloutEngine`` actors (their ``sample`` returns ``(tokens, weight_version)``).
        max_new_tokens: tokens sampled per completion (>= 1); use ``GRPOConfig.max_completion_length``.
        temperature: sampling temperature (> 0), over the whole vocabulary.
        seed: base seed. timeout_s: bound of the engines' calls.
        check_version: require every engine's version to equal ``trainer.state.global_step`` — the
            version ``WeightSyncCallback`` pushed after the last optimizer step (off: engines never
            synced, e.g. a control run).
        on_rollout: called with ``(global_step, versions)`` after each rollout (one version per completion).

    Returns:
        ``rollout(prompts, trainer) -> dict`` with, per prompt in order (B = ``len(prompts)``):
        ``prompt_ids`` (B lists of int token ids), ``completion_ids`` (B lists of int ids, 1 to
        ``max_new_tokens`` long), ``logprobs`` ``None`` (the transformers engine reports none; TRL uses
        sampling logprobs only with its vLLM importance-sampling correction), and ``weight_version``
        (B ints or ``None``: the version that produced each completion; TRL passes it to the reward
        functions as a keyword argument).

    Raises (from the rollout):
        TypeError: a prompt that is not a string (conversational prompts: apply the chat template first).
        ValueError: bad arguments, all named at once (here): engines not a non-empty list of actors with
            ``sample``, ``max_new_tokens`` not an int in [1, 2**20], ``temperature`` / ``timeout_s`` not finite
            and > 0, ``seed`` not an int, ``on_rollout`` not callable; an empty tokenized prompt (the engine's).
        RuntimeError: ``check_version`` and an engine served another version than the step's.
        ray.exceptions.GetTimeoutError: the engines did not answer within ``timeout_s``.
    """
    engines = list(engines) if isinstance(engines, (list, tuple)) else engines
    problems = [
        *([] if isinstance(engines, list) and engines and all(hasattr(e, "sample") for e in engines)
          else [f"engines={engines!r}: a non-empty list of RolloutEngine actors"]),
        *([] if isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool) and 1 <= max_new_tokens <= 1 << 20
          else [f"max_new_tokens={max_new_tokens!r}: an int in [1, 2**20]"]),
        *([] if isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0
          else [f"temperature={temperature!r}: a finite number > 0"]),
        *([] if isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0
          else [f"timeout_s={timeout_s!r}: a finite number of seconds > 0"]),
        *([] if isinstance(seed, int) and not isinstance(seed, bool) else [f"seed={seed!r}: an int"]),
        *([] if on_rollout is None or callable(on_rollout) else [f"on_rollout={on_rollout!r}: a callable or None"]),
    ]
    if problems:
        raise ValueError("engine_rollout_func needs " + "; ".join(problems))
    return functools.partial(_rollout, engines=engines, max_new_tokens=max_new_tokens, temperature=temperature,
                             seed=seed, timeout_s=timeout_s, check_version=check_version, on_rollout=on_rollout)


def _rollout(prompts: list, trainer, *, engines: list, max_new_tokens: int, temperature: float, seed: int,
             timeout_s: float, check_version: bool, on_rollout) -> dict:
    """The rollout of ``engine_rollout_func`` (see there)."""
    import ray

    if not all(isinstance(p, str) for p in prompts):
        raise TypeError("engine_rollout_func: prompts must be strings (apply the chat template to conversational "
                        "prompts before training)")
    step, rank = trainer.state.global_step, trainer.accelerator.process_index
    prompt_ids = trainer.processing_class(text=prompts)["input_ids"]
    runs = _runs(prompts)
    seeds = [seed * 1_000_003 + step * 10_007 + rank * 101 + g for g in range(len(runs))]
    refs = [engines[(rank + g) % len(engines)].sample.remote(prompt_ids[start], max_new_tokens, count, temperature,
                                                             seeds[g]) for g, (start, count) in enumerate(runs)]
    results = ray.get(refs, timeout=timeout_s)
    eos = set(trainer.eos_token_ids)
    completions, versions = [], []
    for (tokens, version), (_, count) in zip(results, runs):
        completions += [_cut_at_eos(t, eos) for t in tokens[:count]]
        versions += [version] * count
    if check_version and any(v != step for v in versions):
        raise RuntimeError(f"engine_rollout_func: engines served versions {sorted(set(versions), key=str)} at "
                           f"step {step}; expected {step} (add WeightSyncCallback, or check_version=False)")
    if on_rollout is not None:
        on_rollout(step, versions)
    return {"prompt_ids": [list(p) for p in prompt_ids], "completion_ids": completions, "logprobs": None,
            "weight_version": versions}


class _HandleBox:
    """A job's mailbox of endpoint handles (a named Ray actor): each rank ``put``s its own, rank 0 takes them all.
    Ray carries the handles as it carries any actor argument; nothing of ours deserializes them."""

    def __init__(self, world: int) -> None:
        self.world, self.handles = world, {}

    def put(self, handle) -> None:
        self.handles[handle.rank] = handle

    def all(self) -> list | None:
        """The handles by rank (``world`` of them), or ``None`` while some are missing."""
        return [self.handles[r] for r in sorted(self.handles)] if len(self.handles) >= self.world else None


def gather_handles(handle, world: int, *, timeout_s: float) -> list:
    """Every rank's ``EndpointHandle`` in rank order on rank 0 (``[]`` on the others). Collective: rank 0 names a
    mailbox actor (32 hex characters broadcast on the default group, bounded by ``timeout_s``), every rank puts its
    handle there through Ray, rank 0 waits for all of them (at most ``timeout_s``) and removes the mailbox.

    Raises:
        RuntimeError: a rank did not join the broadcast, or its handle did not arrive, within ``timeout_s``.
        ValueError: the handles do not name ranks 0..world-1 (ranks of different groups attached).
    """
    import time
    import uuid

    import ray
    import torch.distributed as dist

    name = torch.frombuffer(bytearray(uuid.uuid4().hex.encode()), dtype=torch.uint8)
    box = None
    if dist.get_rank() == 0:  # rank 0 owns the mailbox: it lives until rank 0 has every handle
        box = ray.remote(num_cpus=0)(_HandleBox).options(name=_box_name(name)).remote(world)
        ray.get(box.__ray_ready__.remote(), timeout=timeout_s)
    _wait(dist.broadcast(name, src=0, async_op=True), timeout_s, "the handle mailbox's name")
    if box is None:
        ray.get(ray.get_actor(_box_name(name)).put.remote(handle), timeout=timeout_s)
        return []
    ray.get(box.put.remote(handle), timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while (handles := ray.get(box.all.remote(), timeout=timeout_s)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"WeightSyncCallback: not every rank's endpoint handle arrived within {timeout_s:.0f} s")
        time.sleep(0.05)
    ray.kill(box)
    if [h.rank for h in handles] != list(range(world)):
        raise ValueError(f"WeightSyncCallback: the gathered handles name ranks {[h.rank for h in handles]}, not "
                         f"0..{world - 1}: attach every rank of one group")
    return handles


def _box_name(name: torch.Tensor) -> str:
    return f"weightsync-handles-{bytes(name.tolist()).decode('ascii', 'replace')}"


def _wait(work, timeout_s: float, what: str) -> None:
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise RuntimeError(f"WeightSyncCallback: waiting for {what} failed or timed out ({timeout_s:.0f} s): "
                           f"{exc}") from exc


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _runs(prompts: list) -> list[tuple[int, int]]:
    """``(start, length)`` of each run of equal adjacent prompts."""
    runs: list[tuple[int, int]] = []
    for i, p in enumerate(prompts):
        if runs and prompts[runs[-1][0]] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return list(tokens[:i + 1])
    return list(tokens)
