"""``TrainerShard``: a Ray actor holding one trainer rank's base shard + LoRA factors, sending syncs.

Implements ``protocols.endpoints.TrainerEndpoint`` through the one endpoint implementation
(``sync_service.live.endpoint.TrainerEndpoint`` over a ``LiveState``, the same code and state a live
training rank runs, here over the rank's shard of a checkpoint: ``live/checkpoint.py``) plus
``FactorTrainerEndpoint`` (factor streaming).
Threaded (``max_concurrency=2``): a training-step hook (``set_factors`` / ``train_step``) may run
while ``send`` streams a version — ``send`` works on the snapshot taken by ``snapshot(version)``, so
later factor changes never leak into it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import numpy as np
import ray
import torch

from protocols.endpoints import FactorCost, OpenChannel, SendReport, SendRequest, SnapshotReport
from protocols.params import ParamMeta
from protocols.recipe import Recipe
from sync_service.live.checkpoint import load_rank, set_factors
from sync_service.live.endpoint import TrainerEndpoint
from sync_service.live.state import LiveState
from sync_service.sharding.ep_factors import local_factors
from sync_service.sharding.rules import ShardSpec
from sync_service.sharding.training import step_delta


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
        self.state: LiveState | None = None
        self.endpoint: TrainerEndpoint | None = None  # over ``state``; made by setup()
        self._full_shapes: dict[str, tuple[int, ...]] = {}
        self._rendezvous = None  # rank 0: the trainer group's reserved listening socket (rendezvous_address)

    # -- setup -----------------------------------------------------------------------------
    def node_address(self) -> str:
        """The address of this actor's Ray node (what its peers reach it by)."""
        return ray.util.get_node_ip_address()

    def rendezvous_address(self, peers: Sequence[str] = ()) -> tuple[str, int]:
        """Reserve the trainer group's rendezvous on one address only (never every interface):
        ``127.0.0.1`` when every peer rank's node address (``peers``) is this host's own, else this host's
        address on the route toward the first one that is not (``store.local_address_toward``: ranks on
        other hosts cannot reach a loopback store). A port the OS picks; the socket stays open until
        ``setup`` hands it to the group's TCPStore, so no other process takes the port in between.
        Call on rank 0. Raises TransportError when a peer is unroutable from here."""
        from sync_service.transports.store import bind_listener, local_address_toward

        routes = [(peer, local_address_toward(peer, 0)) for peer in peers]
        host = next((route for peer, route in routes if route != peer), "127.0.0.1")  # toward itself: the peer
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
        base_dir, adapter_dir = self._hf_inputs()  # before the group: transformers saves only on rank 0 of one
        if self.spec.world_size > 1:
            self._init_group(host, port, timeout_s)
        elif self._rendezvous is not None:  # one rank: no group, so the reserved socket stops listening
            self._rendezvous.close()
            self._rendezvous = None
        self.state = load_rank(base_dir, adapter_dir, self.spec, timeout_s=self._init["gather_timeout_s"])
        self.endpoint = TrainerEndpoint(self.state, rank=self.spec.rank)
        if adapter_dir is not None:
            from safetensors import safe_open

            with safe_open(f"{adapter_dir}/adapter_model.safetensors", framework="pt") as f:
                self._full_shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        return len(self.state.owned())

    def _hf_inputs(self) -> tuple[Path, Path | None]:
        """The base / adapter directories; a torch.distributed.checkpoint directory among them is written as
        HF directories in this actor's own temp dir first (``merge.dcp.resolve_inputs``, a whole read per rank)."""
        from sync_service.merge.dcp import is_dcp_dir, resolve_inputs

        base, adapter = Path(self._init["base_dir"]), self._init["adapter_dir"]
        adapter = None if adapter is None else Path(adapter)
        if not any(p is not None and is_dcp_dir(p) for p in (base, adapter)):
            return base, adapter
        self._dcp_tmp = tempfile.TemporaryDirectory(prefix="wsync-dcp")  # the previous one (if any) is removed
        return resolve_inputs(base, adapter, Path(self._dcp_tmp.name))

    # -- the endpoint calls (sync_service.live.endpoint.TrainerEndpoint) -------------------
    def owned_metas(self) -> tuple[ParamMeta, ...]:
        """The global boxes this rank produces, in production order."""
        return self._endpoint().owned_metas()

    def open_transport(self, request: OpenChannel) -> None:
        """Open the sender side of ``request.owner``'s channel (``TrainerEndpoint.open_transport``)."""
        self._endpoint().open_transport(request)

    def close_transport(self, owner: str | None = None) -> None:
        """Close ``owner``'s channel (``None``: every channel); a send blocked on it fails."""
        if self.endpoint is not None:
            self.endpoint.close_transport(owner)

    def snapshot(self, version: int) -> SnapshotReport:
        """Freeze ``version``; ``changed``: the names a delta sync needs (``None``: all)."""
        return self._endpoint().snapshot(version)

    def send(self, request: SendRequest) -> SendReport:
        """Merge and stream this rank's part of ``request.version`` (``TrainerEndpoint.send``)."""
        return self._endpoint().send(request)

    def drop_snapshot(self, version: int) -> None:
        self._endpoint().drop_snapshot(version)

    # -- training-side hooks ---------------------------------------------------------------
    def set_factors(self, updates: dict[str, np.ndarray]) -> None:
        """Replace local factor values (PEFT keys as this rank holds them)."""
        # a copy: arrays from ray.get are read-only views of the object store (torch warns on them)
        set_factors(self._state(), {k: torch.from_numpy(np.array(v, copy=True)) for k, v in updates.items()})

    def train_step(self, step: int, scale: float = 0.02) -> None:
        """Change the factors as an optimizer step would: factor += ``step_delta`` (deterministic,
        defined on the full factor, sliced to this rank), so a reference can replay it."""
        state = self._state()
        full = {k: step_delta(k, self._full_shapes[k], step, scale) for k in state.factors}
        local = local_factors(full, self.spec, num_experts=state.num_experts)
        held = {k: p.param for k, p in state.factors.items()}
        set_factors(state, {k: held[k] + local[k].to(held[k].dtype) for k in local})

    def local_factors(self) -> dict[str, np.ndarray]:
        return {k: p.param.numpy().copy() for k, p in self._state().factors.items()}

    def update_base(self, tensors: dict[str, np.ndarray]) -> None:
        """Replace local base tensors (full fine-tuning; copy-on-write)."""
        self._state().update_base({k: torch.from_numpy(np.asarray(v).copy()) for k, v in tensors.items()})

    def local_base(self) -> dict[str, np.ndarray]:
        return {k: v.numpy().copy() for k, v in self._state().base.local_tensors().items()}

    # -- factor streaming (sync_service/factor_stream; SyncConfig.mode "factors" | "auto") ------------
    def factor_costs(self) -> tuple[FactorCost, ...]:
        """Per changed tensor, its merged vs factor cost (``TrainerEndpoint.factor_costs``)."""
        return self._endpoint().factor_costs()

    def factor_recipes(self, names: list[str], experts_per_recipe: int, bucket_bytes: int) -> tuple[Recipe, ...]:
        """The recipe blocks of ``names``."""
        return self._endpoint().factor_recipes(names, experts_per_recipe, bucket_bytes)

    def factor_delta(self, version: int) -> tuple[str, ...]:
        """Gather ``version``'s factors (collective) and return this rank's changed recipe blocks."""
        return self._endpoint().factor_delta(version)

    def factor_committed(self, version: int) -> None:
        self._endpoint().factor_committed(version)

    def factor_forget(self) -> None:
        self._endpoint().factor_forget()

    def _endpoint(self) -> TrainerEndpoint:
        if self.endpoint is None:
            raise RuntimeError("TrainerShard used before setup()")
        return self.endpoint

    def _state(self) -> LiveState:
        if self.state is None:
            raise RuntimeError("TrainerShard used before setup()")
        return self.state


TrainerShard = ray.remote(num_cpus=0, max_concurrency=2)(TrainerShardCore)
"""The Ray actor class of a trainer rank (``TrainerShard.remote(base_dir=..., adapter_dir=..., rank=...)``)."""
