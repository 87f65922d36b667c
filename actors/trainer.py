"""``TrainerShard``: a Ray actor holding one trainer rank's base shard + LoRA factors, sending syncs.

Threaded (``max_concurrency=2``): a training-step hook (``set_factors`` / ``train_step``) may run
while ``send`` streams a version — ``send`` works on the snapshot taken by ``snapshot(version)``,
so later factor changes never leak into it. Arguments and results are plain values (lists, ints,
numpy arrays, msgpack bytes), never project objects.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import numpy as np
import ray
import torch

from protocols.params import ParamMeta
from protocols.wire import SyncPlan
from protocols.wire_check import decode
from sync_service.sharding.ep_factors import local_factors
from sync_service.sharding.rules import ShardSpec
from sync_service.sharding.trainer_state import TrainerState
from sync_service.sharding.training import step_delta


def meta_to_list(m: ParamMeta) -> list:
    return [m.name, m.dtype, list(m.shape), None if m.box is None else [list(b) for b in m.box]]


def meta_from_list(v: list) -> ParamMeta:
    name, dtype, shape, box = v
    return ParamMeta(name=name, dtype=dtype, shape=tuple(shape), box=None if box is None else tuple(tuple(b) for b in box))


class _TimedSource:
    """WeightSource wrapper that sums the seconds spent in ``fill`` (merge + copy into the bucket)."""

    def __init__(self, source) -> None:
        self._source, self.fill_s = source, 0.0

    def param_metas(self):
        return self._source.param_metas()

    def changed_names(self):
        return self._source.changed_names()

    def fill(self, name, box, out) -> None:
        t0 = time.perf_counter()
        self._source.fill(name, box, out)
        self.fill_s += time.perf_counter() - t0


class TrainerShardCore:
    """One trainer rank. ``rank = ep_rank · tp + tp_rank``; ``world = ep · tp`` ranks in all.

    The plain class behind the ``TrainerShard`` actor, so trainers with their own training step
    (e.g. ``actors.policy_trainer.PolicyTrainer``) can extend it.
    """

    def __init__(self, *, base_dir: str, adapter_dir: str | None, rank: int = 0, ep: int = 1, tp: int = 1,
                 gather_timeout_s: float = 60.0) -> None:
        torch.set_num_threads(1)
        self.spec = ShardSpec(rank=rank, ep=ep, tp=tp)
        self._init = dict(base_dir=base_dir, adapter_dir=adapter_dir, gather_timeout_s=gather_timeout_s)
        self.state: TrainerState | None = None
        self._sender = None
        self._plan: SyncPlan | None = None
        self._factors = None  # sync_service.factor_stream.trainer.FactorTrainer, in factor modes
        self._full_shapes: dict[str, tuple[int, ...]] = {}
        self._send_lock = threading.Lock()  # one send at a time: sends share the bucket pool and the adapter
        self._rendezvous = None  # rank 0: the trainer group's reserved listening socket (rendezvous_address)

    # -- setup -----------------------------------------------------------------------------
    def rendezvous_address(self, host: str = "127.0.0.1") -> tuple[str, int]:
        """Reserve the trainer group's rendezvous: a socket listening on ``host`` only (never every
        interface), on a port the OS picks; kept open until ``setup`` hands it to the group's
        TCPStore, so no other process can take the port in between. Call on rank 0."""
        from sync_service.transports.store import bind_listener

        if self._rendezvous is not None:
            self._rendezvous.close()
        self._rendezvous = bind_listener(host, None)
        return host, self._rendezvous.getsockname()[1]

    def _init_group(self, host: str, port: int, timeout_s: float) -> None:
        """Join the gloo trainer group; rank 0 serves its TCPStore on the reserved socket (or binds
        ``host:port`` only), not on every interface as ``init_method="tcp://..."`` would."""
        import torch.distributed as dist

        from sync_service.transports.store import bind_listener

        world, listen_fd = self.spec.world_size, None
        if self.spec.rank == 0:
            sock = self._rendezvous if self._rendezvous is not None else bind_listener(host, (port, port))
            self._rendezvous, listen_fd = None, sock.detach()
        store = dist.TCPStore(host, port, world, self.spec.rank == 0, timeout=timedelta(seconds=timeout_s),
                              master_listen_fd=listen_fd)
        dist.init_process_group("gloo", store=store, rank=self.spec.rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))

    def setup(self, host: str | None, port: int | None, timeout_s: float, **reconfigure) -> int:
        """Join the gloo trainer group (when world > 1) and load this rank's shard; returns how many
        boxes it owns. ``reconfigure`` (``base_dir``, ``adapter_dir``, ``rank``, ``ep``, ``tp``)
        reloads a running actor with another shard (the old group and channel are closed first)."""
        import torch.distributed as dist

        unknown = set(reconfigure) - {"base_dir", "adapter_dir", "rank", "ep", "tp"}
        if unknown:
            raise TypeError(f"setup: unknown settings {sorted(unknown)}")
        self.close_transport()
        if dist.is_initialized():
            dist.destroy_process_group()
        if reconfigure:
            self._init.update({k: reconfigure[k] for k in ("base_dir", "adapter_dir") if k in reconfigure})
            self.spec = ShardSpec(rank=reconfigure.get("rank", self.spec.rank), ep=reconfigure.get("ep", self.spec.ep),
                                  tp=reconfigure.get("tp", self.spec.tp))
        self.state, self._full_shapes = None, {}
        if self.spec.world_size > 1:
            self._init_group(host, port, timeout_s)
        self.state = TrainerState.from_checkpoint(self._init["base_dir"], self._init["adapter_dir"], self.spec,
                                                  gather_timeout_s=self._init["gather_timeout_s"])
        if self._init["adapter_dir"] is not None:
            from safetensors import safe_open

            with safe_open(f"{self._init['adapter_dir']}/adapter_model.safetensors", framework="pt") as f:
                self._full_shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        return len(self.state.owned())

    def owned_metas(self) -> list[list]:
        """The global boxes this rank produces, as ``[name, dtype, shape, box]`` lists."""
        return [meta_to_list(m) for m in self._state().owned()]

    def open_transport(self, spec_bytes: bytes, plan_bytes: bytes, bucket_buffers: int = 2, *,
                       secret: bytes | None = None) -> None:
        """Open the sender side of a channel and keep the (combined) plan. Blocks until peers connect.
        ``secret``: the session's HMAC key; every bucket header is sealed with it (engines verify)."""
        from sync_service.streaming.pool import BucketPool
        from sync_service.streaming.sender import Sender
        from sync_service.transports import TransportSpec, open_sender

        self.close_transport()
        plan = decode(plan_bytes)
        if not isinstance(plan, SyncPlan):
            raise ValueError(f"open_transport: plan_bytes decode to {type(plan).__name__}, not a SyncPlan")
        spec = TransportSpec.from_bytes(spec_bytes)
        self._plan = plan
        self._sender = Sender(open_sender(spec, sender=self.spec.rank),
                              BucketPool(bucket_bytes=plan.bucket_bytes, num_buffers=bucket_buffers), sender=self.spec.rank,
                              secret=secret)

    def close_transport(self) -> None:
        if self._sender is not None:
            self._sender.transport.close()
            self._sender = None

    # -- training-side hooks ---------------------------------------------------------------
    def set_factors(self, updates: dict[str, np.ndarray]) -> None:
        """Replace local factor values (PEFT keys as this rank holds them)."""
        self._state().set_factors({k: torch.from_numpy(np.asarray(v)) for k, v in updates.items()})

    def train_step(self, step: int, scale: float = 0.02) -> None:
        """Change the factors as an optimizer step would: factor += ``step_delta`` (deterministic,
        defined on the full factor, sliced to this rank), so a reference can replay it."""
        state = self._state()
        full = {k: step_delta(k, self._full_shapes[k], step, scale) for k in state.factors}
        local = local_factors(full, self.spec, num_experts=state.num_experts)
        state.set_factors({k: state.factors[k] + local[k].to(state.factors[k].dtype) for k in local})

    def local_factors(self) -> dict[str, np.ndarray]:
        return {k: v.numpy().copy() for k, v in self._state().factors.items()}

    def update_base(self, tensors: dict[str, np.ndarray]) -> None:
        """Replace local base tensors (full fine-tuning; copy-on-write)."""
        self._state().update_base({k: torch.from_numpy(np.asarray(v).copy()) for k, v in tensors.items()})

    def local_base(self) -> dict[str, np.ndarray]:
        return {k: v.numpy().copy() for k, v in self._state().base.local_tensors().items()}

    # -- sync ------------------------------------------------------------------------------
    def snapshot(self, version: int) -> list[str] | None:
        """Freeze ``version``; returns the names a delta sync needs (``None``: all)."""
        changed = self._state().snapshot(version)
        return None if changed is None else sorted(changed)

    def send(self, session: str, version: int, names: list[str] | None, timeout_s: float, *,
             check_finite: bool = False) -> dict:
        """Refresh the adapter, merge and stream this rank's part of ``version``; blocks until every engine acked.
        ``check_finite``: a merged NaN/Inf fails the sync with ``MergeError`` naming the tensor (the
        engines are told to abort before anything is committed).

        Returns seconds per stage (``gather_s``, ``merge_s``, ``pack_s``, ``transfer_s``, ``ack_wait_s``,
        ``total_s``) and sizes (``payload_bytes``, ``buckets``, ``entries``).
        """
        if not self._send_lock.acquire(timeout=timeout_s):
            self._state().drop_snapshot(version)
            raise TimeoutError(f"trainer rank {self.spec.rank}: send({version}) waited {timeout_s:.0f} s for the "
                               f"previous send to end; raise SyncConfig.timeout_s or check that rank")
        try:
            return self._send(session, version, names, timeout_s, check_finite)
        finally:
            self._send_lock.release()

    def _send(self, session: str, version: int, names: list[str] | None, timeout_s: float, check_finite: bool) -> dict:
        if self._sender is None or self._plan is None:
            self._state().drop_snapshot(version)
            raise RuntimeError("send before open_transport")
        t0 = time.perf_counter()
        try:
            self._state().merge.check_finite = check_finite
            plain = self._factors is None or not any(e.recipe is not None for e in self._plan.entries)
            source = _TimedSource(self._state().source(version) if plain
                                  else self._factors.source(self._state(), version, self._plan))
        except BaseException:
            self._state().drop_snapshot(version)
            raise
        gather_s = time.perf_counter() - t0
        stats = self._sender.send_sync(session, version, source, self._plan,
                                       names=None if names is None else frozenset(names), timeout_s=timeout_s)
        return {"rank": self.spec.rank, "gather_s": gather_s, "merge_s": source.fill_s,
                "pack_s": max(stats.pack_s - source.fill_s, 0.0), "transfer_s": stats.transfer_s,
                "ack_wait_s": stats.ack_wait_s, "total_s": time.perf_counter() - t0,
                "payload_bytes": stats.payload_bytes, "buckets": stats.buckets, "entries": stats.entries}

    def drop_snapshot(self, version: int) -> None:
        self._state().drop_snapshot(version)

    # -- factor streaming (sync_service/factor_stream; SyncConfig.mode "factors" | "auto") ------------
    def factor_costs(self) -> list[list]:
        """Per changed tensor ``[name, merged_bytes, factor_bytes, pristine_bytes, why_not]``."""
        return self._factor_state().costs(self._state())

    def factor_recipes(self, names: list[str], experts_per_recipe: int, bucket_bytes: int) -> list[list]:
        """The recipe blocks of ``names`` (``protocols.recipe.recipe_list`` lists)."""
        return self._factor_state().recipes(self._state(), names, experts_per_recipe=experts_per_recipe,
                                            bucket_bytes=bucket_bytes)

    def factor_delta(self, version: int) -> list[str]:
        """Gather ``version``'s factors (collective) and return this rank's changed recipe blocks."""
        return self._factor_state().delta(self._state(), version, self._plan, self.spec.rank)

    def factor_committed(self, version: int) -> None:
        self._factor_state().ledger.commit(version)

    def factor_forget(self) -> None:
        self._factor_state().ledger.forget()

    def _factor_state(self):
        if self._factors is None:
            from sync_service.factor_stream.trainer import FactorTrainer

            self._factors = FactorTrainer()
        return self._factors

    def _state(self) -> TrainerState:
        if self.state is None:
            raise RuntimeError("TrainerShard used before setup()")
        return self.state


TrainerShard = ray.remote(num_cpus=0, max_concurrency=2)(TrainerShardCore)
"""The Ray actor class of a trainer rank (``TrainerShard.remote(base_dir=..., adapter_dir=..., rank=...)``)."""
