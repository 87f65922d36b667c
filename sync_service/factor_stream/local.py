"""Merged or factor streaming in one process, without Ray: trainer ranks as sender threads over a real
shm channel, one ``MemoryEngine`` receiver (wrapped in a ``FactorEngine`` in factor modes). The engine starts
from the base, or from ``engine`` tensors (a block-FP8 checkpoint's: ``MemoryEngine.from_fp8_checkpoint``); its
table decides the dtypes sent, as a coordinator's does (``coordinator.planning.engine_dtypes``).

The same parts as a Ray deployment (``ShardedBase`` shards, ``MergedSource``, ``Sender``,
``BucketReceiver``, shm transport); used by the tests' equality matrix and ``factor_streaming_row``.

    sync = LocalSync(base_tensors, layout, peft_config, config=LocalSyncConfig(ep=2, policy=FactorPolicy(mode="factors")))
    stats = sync.push(0, peft_state)     # full sync: pristine bases + every recipe + merged rest
    stats = sync.push(1, peft_state_2)   # delta: only the changed recipe blocks
    sync.engine_state()                  # what the engine serves
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from protocols.wire import SyncPlan
from sync_service.coordinator.planning import build_sync_plan, engine_dtypes
from sync_service.engines.memory import MemoryEngine
from sync_service.factor_stream.choose import FactorChoice, FactorPolicy, choose
from sync_service.factor_stream.plan import (adapter_recipes, build_factor_plan, engine_merged_bytes, factor_targets,
                                             recipe_names_of, target_costs, validate_factor_plan)
from sync_service.factor_stream.receiver import FactorEngine, FactorReceiverConfig
from sync_service.factor_stream.recipes import factor_wire_dtype
from sync_service.fp8 import table_blocks
from sync_service.factor_stream.source import FactorLedger, FactorSource
from sync_service.merge.adapter import adapter_from_state_dict
from sync_service.merge.source import MergeConfig, MergedSource
from sync_service.sharding.base import shard_tensors
from sync_service.sharding.rules import ShardSpec
from sync_service.streaming import BucketPool, BucketReceiver, Sender
from sync_service.transports import TransportSpec, open_receiver, open_sender

__all__ = ["LocalSync", "LocalSyncConfig", "PushStats"]


@dataclass(kw_only=True, slots=True)
class LocalSyncConfig:
    """Settings of an in-process sync."""

    ep: int = 1
    """Expert-parallel trainer ranks."""
    tp: int = 1
    """Tensor-parallel trainer ranks (world = ep · tp sender threads)."""
    policy: FactorPolicy = field(default_factory=FactorPolicy)
    """Merged, factors or auto (``FactorPolicy``)."""
    bucket_bytes: int = 1 << 20
    """Bucket payload size, bytes (multiple of 64)."""
    staging_bytes: int = 64 << 20
    """Merge scratch budget on trainers and receiver, bytes."""
    accumulate_dtype: str = "float32"
    """The merge's accumulation dtype on trainers and receiver (``MergeConfig.accumulate_dtype``)."""
    pristine_device: str = "cpu"
    """Where the receiver keeps pristine copies (``FactorReceiverConfig.pristine_device``)."""
    timeout_s: float = 60.0
    """Bound of every send / receive, seconds."""


@dataclass(frozen=True, slots=True)
class PushStats:
    """One push: payload bytes moved, wall seconds, whether full, receiver merge seconds."""

    version: int
    full: bool
    bytes: int
    seconds: float
    merge_s: float


class LocalSync:
    """Trainer ranks over ``base`` (hf-fused tensors, whole) → one engine started from ``base``."""

    def __init__(self, base: Mapping[str, torch.Tensor], layout, peft_config, *, config: LocalSyncConfig,
                 engine: Mapping[str, torch.Tensor] | None = None) -> None:
        self.config, self.layout, self.peft_config = config, layout, peft_config
        self.world = config.ep * config.tp
        self.shards = [shard_tensors(base, ShardSpec(rank=r, ep=config.ep, tp=config.tp), layout=layout)
                       for r in range(self.world)]
        self.memory = MemoryEngine({n: t.clone() for n, t in (base if engine is None else engine).items()})
        self.engine = self.memory
        self.plan: SyncPlan | None = None
        self.choice: FactorChoice | None = None
        self.ledgers = [FactorLedger() for _ in range(self.world)]
        self._full_done = False
        self._txs: list = []
        self._rx = None

    @property
    def factor_mode(self) -> bool:
        return self.config.policy.mode != "merged"

    def _sources(self, state: Mapping[str, torch.Tensor]) -> list[MergedSource]:
        """Each rank's ``MergedSource`` of ``state``, set from the plan once it exists (the engine's dtypes and
        FP8 blocks, as ``live.endpoint`` sets them per send)."""
        sent = {} if self.plan is None else {e.name: e.dtype for e in self.plan.entries if e.recipe is None}
        out = []
        for shard in self.shards:
            adapter = adapter_from_state_dict(self.peft_config, dict(state), shard.layout, shard.metas(),
                                              tied_aliases=shard.tied_aliases)
            config = MergeConfig(staging_bytes=self.config.staging_bytes, accumulate_dtype=self.config.accumulate_dtype,
                                 out_dtypes=sent, fp8_blocks=table_blocks(e for e in self.plan.entries if e.recipe is None)
                                 if self.plan is not None else None)
            out.append(MergedSource(shard, adapter, config=config, owned=shard.owned(), layout=shard.layout))
        return out

    def _setup(self, sources: list[MergedSource], state: Mapping[str, torch.Tensor]) -> None:
        owned, _ = engine_dtypes([s.param_metas() for s in sources], {"local": self.memory.param_metas()})
        cap = self.config.bucket_bytes
        if not self.factor_mode:
            self.plan = build_sync_plan(owned, bucket_bytes=cap)
        else:
            metas = self.shards[0].metas()
            self.choice = choose(engine_merged_bytes(target_costs(sources[0].adapter, metas, {}), owned), self.config.policy)
            recipes = adapter_recipes(sources[0].adapter, metas, sorted(self.choice.factors),
                                      experts_per_recipe=self.config.policy.experts_per_recipe, bucket_bytes=cap,
                                      wire_dtype=factor_wire_dtype(state.values()))
            self.plan = build_factor_plan(owned, recipes, bucket_bytes=cap)
            validate_factor_plan(self.plan, self.memory.param_metas(), engine="local")
            self.engine = FactorEngine(self.memory, self.plan, config=FactorReceiverConfig(
                pristine_device=self.config.pristine_device, staging_bytes=self.config.staging_bytes,
                accumulate_dtype=self.config.accumulate_dtype))
        spec = TransportSpec(kind="shm", name="f" + uuid.uuid4().hex[:10], bucket_bytes=cap, num_senders=self.world,
                             connect_timeout_s=self.config.timeout_s, op_timeout_s=self.config.timeout_s)
        self._txs = [open_sender(spec, r) for r in range(self.world)]
        self._rx = open_receiver(spec, 0)

    def push(self, version: int, state: Mapping[str, torch.Tensor], *, full: bool | None = None) -> PushStats:
        """Stream ``version`` (the full PEFT state dict ``state``) and commit it. Blocks.

        ``full``: force a full (True) or delta (False) sync; default: full the first time.

        Raises:
            RuntimeError: the receiver or a sender failed (the engine keeps its previous version).
        """
        sources = self._sources(state)
        if self.plan is None:
            self._setup(sources, state)
            sources = self._sources(state)  # now with the plan's dtypes
        full = not self._full_done if full is None else full
        names = None if full else self._delta_names(version, sources)
        if full and self.factor_mode:  # record the digests of this version's blocks (all of them move)
            for rank, src in enumerate(sources):
                self.ledgers[rank].forget()
                self.ledgers[rank].changed(version, FactorSource(src, self.plan), recipe_names_of(self.plan, rank))
        wrapped = [FactorSource(s, self.plan) if self.factor_mode else s for s in sources]
        t0 = time.perf_counter()
        payload = self._run(version, wrapped, names)
        self.engine.commit(version)
        for ledger in self.ledgers:
            ledger.commit(version)
        self._full_done = True
        return PushStats(version=version, full=full, bytes=payload, seconds=time.perf_counter() - t0,
                         merge_s=getattr(self.engine, "merge_s", 0.0))

    def _delta_names(self, version: int, sources: list[MergedSource]) -> frozenset[str]:
        changed = sources[0].changed_names()
        if not self.factor_mode:
            return changed
        names = set(changed - factor_targets(self.plan))
        for rank, src in enumerate(sources):
            names.update(self.ledgers[rank].changed(version, FactorSource(src, self.plan), recipe_names_of(self.plan, rank)))
        return frozenset(names)

    def _run(self, version: int, sources: list, names: frozenset[str] | None) -> int:
        results: dict[str, object] = {}
        session = f"local-v{version}-{uuid.uuid4().hex[:6]}"
        timeout = self.config.timeout_s

        def receive() -> None:
            try:
                results["rx"] = BucketReceiver(self.engine, self.plan).receive_sync(self._rx, timeout_s=timeout)
            except BaseException as exc:
                results["rx_error"] = exc

        def send(rank: int) -> None:
            try:
                sender = Sender(self._txs[rank], BucketPool(bucket_bytes=self.plan.bucket_bytes), sender=rank)
                results[f"tx{rank}"] = sender.send_sync(session, version, sources[rank], self.plan, names=names,
                                                        timeout_s=timeout)
            except BaseException as exc:
                results[f"tx_error{rank}"] = exc

        threads = [threading.Thread(target=receive)] + [threading.Thread(target=send, args=(r,)) for r in range(self.world)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout + 30)
        errors = {k: v for k, v in results.items() if "error" in k}
        if errors or any(th.is_alive() for th in threads):
            raise RuntimeError(f"push({version}) failed: {errors or 'timed out'}")
        return results["rx"].payload_bytes

    def engine_state(self) -> dict[str, torch.Tensor]:
        """The tensors the engine serves (clones)."""
        return {n: t.clone() for n, t in self.memory.state_dict().items()}

    def close(self) -> None:
        for tx in self._txs:
            tx.close()
        if self._rx is not None:
            self._rx.close()
