"""``RolloutEngine``: a Ray actor hosting one rollout engine (an ``EngineAdapter``) — receive side.

Threaded (``max_concurrency=4``): ``generate`` keeps serving the committed version while ``receive``
stages the next one; ``commit`` swaps it in between two generations (see ``engines/hf.py``).
Arguments and results are plain values (lists, ints, numpy arrays, msgpack bytes).
"""

from __future__ import annotations

import numpy as np
import ray
import torch

from actors.trainer import meta_to_list
from protocols.wire import SyncPlan
from protocols.wire_check import decode

# engine kind -> factory(model_dir) of an EngineAdapter
ENGINES = {
    "hf": lambda model_dir: _hf(model_dir),
    "memory": lambda model_dir: _memory(model_dir),
    "vllm": lambda model_dir: _vllm(model_dir),
}


def _hf(model_dir: str):
    from sync_service.engines.hf import HFEngine

    return HFEngine.from_pretrained(model_dir)


def _vllm(model_dir: str):
    """vLLM in this process, presented in the trainers' hf-fused naming (docs/vllm.md). The actor's
    runtime_env carries ``engines.vllm.config.VLLM_ENV`` (``local.start_engines`` sets it)."""
    from sync_service.engines.vllm.fused import FusedVLLMEngine

    return FusedVLLMEngine.from_pretrained(model_dir)


def _memory(model_dir: str):
    from sync_service.engines.memory import MemoryEngine
    from sync_service.merge.base import SafetensorsBase
    from protocols.params import full_box

    base = SafetensorsBase(model_dir)
    return MemoryEngine({m.name: base.read(m.name, full_box(m.shape)).clone() for m in base.metas()})


@ray.remote(num_cpus=0, max_concurrency=4)
class RolloutEngine:
    """One rollout engine, started from the checkpoint in ``model_dir`` (usually the base)."""

    def __init__(self, *, model_dir: str, engine: str = "hf", name: str = "engine") -> None:
        torch.set_num_threads(1)
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; use one of {sorted(ENGINES)}")
        self.name = name
        self.engine = ENGINES[engine](model_dir)
        self._receiver = None
        self._transport = None
        self._factor_engine = None  # sync_service.factor_stream.FactorEngine over self.engine, for factor plans

    def engine_name(self) -> str:
        return self.name

    def param_metas(self) -> list[list]:
        """The engine's own parameter table, as ``[name, dtype, shape, None]`` lists."""
        return [meta_to_list(m) for m in self.engine.param_metas()]

    def weight_version(self) -> int | None:
        return self.engine.weight_version()

    def open_transport(self, spec_bytes: bytes, plan_bytes: bytes, receiver: int, *, secret: bytes | None = None) -> None:
        """Open the receiver side of a channel for the combined plan. Blocks until peers connect.
        ``secret``: the session's HMAC key; a bucket without a valid mac is refused, nothing applied."""
        from sync_service.streaming.receiver import BucketReceiver
        from sync_service.transports import TransportSpec, open_receiver

        self.close_transport()
        plan = decode(plan_bytes)
        if not isinstance(plan, SyncPlan):
            raise ValueError(f"open_transport: plan_bytes decode to {type(plan).__name__}, not a SyncPlan")
        self._transport = open_receiver(TransportSpec.from_bytes(spec_bytes), receiver=receiver)
        self._receiver = BucketReceiver(self._updater_for(plan), plan, receiver=receiver, secret=secret)

    def _updater_for(self, plan: SyncPlan):
        """The engine itself, or for a factor plan the ``FactorEngine`` over it (kept across channel
        reopens of the same plan, so its resident pristine copies survive membership changes)."""
        if not any(e.recipe is not None for e in plan.entries):
            self._factor_engine = None
            return self.engine
        from sync_service.factor_stream.receiver import FactorEngine

        if self._factor_engine is None or self._factor_engine.plan != plan:
            self._factor_engine = FactorEngine(self.engine, plan)
        return self._factor_engine

    def factor_state(self) -> dict:
        """``{"ready": bool, "resident_bytes": int, "merge_s": float}`` of factor streaming
        (ready: a factor delta can apply; resident_bytes: pristine copies + factors held)."""
        fe = self._factor_engine
        if fe is None:
            return {"ready": False, "resident_bytes": 0, "merge_s": 0.0}
        return {"ready": fe.factor_ready(), "resident_bytes": fe.resident_bytes(), "merge_s": fe.merge_s}

    def close_transport(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport, self._receiver = None, None

    def receive(self, timeout_s: float) -> dict:
        """Receive one whole sync (staged, acked, not committed); returns its stats (seconds, bytes)."""
        if self._receiver is None:
            raise RuntimeError("receive before open_transport")
        s = self._receiver.receive_sync(self._transport, timeout_s=timeout_s, commit=False)
        return {"engine": self.name, "version": s.version, "buckets": s.buckets, "entries": s.entries,
                "payload_bytes": s.payload_bytes, "wait_s": s.wait_s, "verify_s": s.verify_s,
                "apply_s": s.apply_s, "finish_s": s.finish_s, "total_s": s.total_s}

    def commit(self, version: int) -> None:
        (self._factor_engine or self.engine).commit(version)
        self.engine.reset_caches()

    def abort(self) -> None:
        (self._factor_engine or self.engine).abort()

    def generate(self, prompt_token_ids: list[int], max_new_tokens: int) -> tuple[list[int], int | None]:
        """Greedy tokens and the weight version that produced them (hf engine)."""
        r = self.engine.generate(prompt_token_ids, max_new_tokens)
        return r.tokens, r.weight_version

    def sample(self, prompt_token_ids: list[int], max_new_tokens: int, num_samples: int, temperature: float,
               seed: int) -> tuple[list[list[int]], int | None]:
        """``num_samples`` sampled continuations (see ``HFEngine.sample``) and the weight version that
        produced them all."""
        r = self.engine.sample(prompt_token_ids, max_new_tokens, num_samples=num_samples, temperature=temperature,
                               seed=seed)
        return r.tokens, r.weight_version

    def can_export(self) -> bool:
        """Whether this engine can stream its served weights to a peer (``send_weights``)."""
        return callable(getattr(self.engine, "export_tensors", None))

    def send_weights(self, spec_bytes: bytes, plan_bytes: bytes, session: str, version: int, timeout_s: float, *,
                     secret: bytes | None = None) -> dict:
        """Stream the served weights of ``version`` to a late-joining engine over a channel of its own
        (this engine is sender 0 of ``plan``); blocks until the joiner acked. Generation goes on meanwhile;
        the caller holds off syncs to this engine until it returns. Returns ``payload_bytes``, ``buckets``,
        ``seconds``.

        Raises:
            RuntimeError: this engine does not serve ``version`` or cannot export its weights.
        """
        from sync_service.streaming.pool import BucketPool
        from sync_service.streaming.sender import Sender
        from sync_service.streaming.tensor_source import TensorSource
        from sync_service.transports import TransportSpec, open_sender

        if not self.can_export() or self.engine.weight_version() != version:
            raise RuntimeError(f"{self.name}: cannot send version {version} (serves {self.engine.weight_version()}, "
                               f"export supported: {self.can_export()})")
        plan = decode(plan_bytes)
        if not isinstance(plan, SyncPlan):
            raise ValueError(f"send_weights: plan_bytes decode to {type(plan).__name__}, not a SyncPlan")
        transport = open_sender(TransportSpec.from_bytes(spec_bytes), sender=0)
        try:
            sender = Sender(transport, BucketPool(bucket_bytes=plan.bucket_bytes, num_buffers=2), sender=0, secret=secret)
            stats = sender.send_sync(session, version, TensorSource(self.engine.export_tensors()), plan, timeout_s=timeout_s)
        finally:
            transport.close()
        return {"payload_bytes": stats.payload_bytes, "buckets": stats.buckets, "seconds": stats.total_s}

    def state(self, names: list[str] | None = None) -> dict[str, np.ndarray]:
        """Served parameter values (copies) as fp32-or-native numpy arrays, for verification."""
        sd = self.engine.state_dict()
        return {n: _np(t) for n, t in sd.items() if names is None or n in names}

    def mismatches(self, checkpoint_dir: str) -> list[str]:
        """Names whose served values differ (bitwise) from a checkpoint read through the merge core's
        ``SafetensorsBase`` (any on-disk naming → hf-fused), plus names missing on either side."""
        from protocols.params import full_box
        from sync_service.merge.base import SafetensorsBase

        ref = SafetensorsBase(checkpoint_dir)
        ref_names = {m.name: m for m in ref.metas()}
        sd = self.engine.state_dict()
        bad = sorted(set(sd) ^ set(ref_names))
        for name, t in sd.items():
            if name in ref_names and not torch.equal(ref.read(name, full_box(tuple(t.shape))), t):
                bad.append(name)
        return bad


def _np(t: torch.Tensor) -> np.ndarray:
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()
