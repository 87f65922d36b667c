"""``RolloutEngine``: a Ray actor hosting one rollout engine (an ``EngineAdapter``) — receive side.

Implements ``protocols.endpoints.RolloutEndpoint`` (the calls the coordinator makes; requests and
reports are the frozen dataclasses declared there). Threaded (``max_concurrency=4``): ``generate``
keeps serving the committed version while ``receive`` stages the next one; ``commit`` swaps it in
between two generations (see ``engines/hf.py``). One channel per owner (coordinator or late join):
a second coordinator on the same engines never closes the first one's channel.
"""

from __future__ import annotations

import numpy as np
import ray
import torch

from protocols.endpoints import ExportReport, ExportRequest, FactorStateReport, OpenChannel, ReceiveReport
from protocols.params import ParamMeta
from protocols.readback import ServedWeights
from protocols.wire import SyncPlan
from protocols.wire_check import decode

# engine kind -> factory(model_dir, device) of an EngineAdapter
ENGINES = {
    "hf": lambda model_dir, device: _hf(model_dir, device),
    "memory": lambda model_dir, device: _memory(model_dir),
    "vllm": lambda model_dir, device: _vllm(model_dir),
}

ENGINE_DEVICES = {"hf": ("cpu", "cuda"), "memory": ("cpu",), "vllm": ("cpu", "cuda")}
"""Engine kind → the device types it serves on. ``hf`` stages on its own device; the memory engine holds host
tensors; vLLM takes the device from its worker's parameters (``device`` only chooses nothing there)."""


def engine_device(device: str, engine: str, gpu_ids) -> str:
    """The device an engine serves on: ``device`` as given (``"cpu"``, ``"cuda"``, ``"cuda:N"``), or for ``"auto"``
    ``"cuda"`` when the actor was given a GPU (``gpu_ids``: ``ray.get_gpu_ids()``) and the engine serves on CUDA,
    else ``"cpu"``.

    Raises:
        ValueError: a device the engine kind does not serve on or torch cannot parse (``"cpu:abc"``), or CUDA asked
            without a visible CUDA device or with an index past the visible ones.
    """
    kinds = ENGINE_DEVICES[engine]
    if device == "auto":
        return "cuda" if gpu_ids and "cuda" in kinds and torch.cuda.is_available() else "cpu"
    parsed = _parse_device(device)
    if parsed is None or parsed.type not in kinds:
        raise ValueError(f"RolloutEngine device={device!r}: engine {engine!r} serves on {kinds} ('auto': cuda when "
                         f"the actor has a GPU)")
    visible = torch.cuda.device_count() if parsed.type == "cuda" and torch.cuda.is_available() else 0
    if parsed.type == "cuda" and not visible:
        raise ValueError(f"RolloutEngine device={device!r} but this actor sees no CUDA device; give the actor a GPU "
                         f"(num_gpus=1) or use device='cpu'")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= visible:
        raise ValueError(f"RolloutEngine device={device!r} but this actor sees {visible} CUDA device(s) (cuda:0 .. "
                         f"cuda:{visible - 1}: Ray numbers an actor's GPUs from 0); use device='cuda' or 'auto'")
    return device


def _parse_device(device) -> torch.device | None:
    """``device`` as a ``torch.device`` when it is a string torch parses, else ``None``."""
    if not isinstance(device, str):
        return None
    try:
        return torch.device(device)
    except RuntimeError:
        return None


def _hf(model_dir: str, device: str):
    from sync_service.engines.hf import HFEngine

    return HFEngine.from_pretrained(model_dir, device=device)


def _vllm(model_dir: str):
    """vLLM in this process, presented in the trainers' hf-fused naming (docs/vllm.md). The actor's
    runtime_env carries ``engines.vllm.config.VLLM_ENV`` (``local.start_engines`` sets it)."""
    from sync_service.engines.vllm.fused import FusedVLLMEngine

    return FusedVLLMEngine.from_pretrained(model_dir)


def _memory(model_dir: str):
    from sync_service.engines.memory import MemoryEngine
    from sync_service.merge.base import SafetensorsBase
    from sync_service.merge.fp8_checkpoint import is_fp8_checkpoint
    from protocols.params import full_box

    if is_fp8_checkpoint(model_dir):  # FP8 values + scales in hf-fused naming (sync_service.fp8)
        return MemoryEngine.from_fp8_checkpoint(model_dir)
    base = SafetensorsBase(model_dir)
    return MemoryEngine({m.name: base.read(m.name, full_box(m.shape)).clone() for m in base.metas()})


class RolloutEngineCore:
    """One rollout engine, started from the checkpoint in ``model_dir`` (usually the base). The plain
    class behind the ``RolloutEngine`` actor. ``device``: where it serves and stages (``engine_device``;
    ``"auto"``: ``"cuda"`` when the actor has a GPU, else ``"cpu"``)."""

    def __init__(self, *, model_dir: str, engine: str = "hf", name: str = "engine", device: str = "auto") -> None:
        torch.set_num_threads(1)
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; use one of {sorted(ENGINES)}")
        self.name = name
        self.device = engine_device(device, engine, ray.get_gpu_ids() if ray.is_initialized() else [])
        """The device the engine serves and stages on."""
        self.engine = ENGINES[engine](model_dir, self.device)
        self._channels: dict[str, tuple] = {}  # owner -> (TransportReceiver, BucketReceiver, FactorEngine | None)
        self._factor_engine = None  # sync_service.factor_stream.FactorEngine over self.engine, for factor plans
        self._staged: dict[str, str] = {}  # owner -> the update token its last receive staged

    def engine_name(self) -> str:
        return self.name

    def staging_bytes(self) -> int:
        """Bytes of staging buffers the engine holds on ``device`` (0 for an engine that keeps none)."""
        held = getattr(self.engine, "staging_bytes", None)
        return 0 if held is None else held()

    def param_metas(self) -> tuple[ParamMeta, ...]:
        """The engine's own parameter table (whole tensors)."""
        return tuple(self.engine.param_metas())

    def weight_version(self) -> int | None:
        return self.engine.weight_version()

    def open_transport(self, request: OpenChannel) -> None:
        """Open the receiver side of ``request.owner``'s channel for its plan. Blocks until the senders
        connected. A bucket without a valid mac under ``request.secret`` is refused, nothing applied."""
        from sync_service.streaming.receiver import BucketReceiver
        from sync_service.transports import TransportSpec, open_receiver

        self._close_channels(request.owner)  # a reopen keeps the staging buffers
        plan = decode(request.plan)
        if not isinstance(plan, SyncPlan):
            raise ValueError(f"open_transport: plan decodes to {type(plan).__name__}, not a SyncPlan")
        transport = open_receiver(TransportSpec.from_bytes(request.spec), receiver=request.index)
        updater = self._updater_for(plan)
        factors = None if updater is self.engine else updater
        from sync_service.engines.served_check import install  # in front of the engine; its gate runs it

        served = install(self.engine, getattr(request, "check_served", "off"), self.name, request.owner)
        if factors is not None:  # factor plans: the check sits between the receiver's merge and the engine
            factors.inner = served
        updater = served if factors is None else updater
        receiver = BucketReceiver(updater, plan, receiver=request.index, secret=request.secret)
        self._channels[request.owner] = (transport, receiver, factors)
        reserve = getattr(self.engine, "reserve_staging", None)  # staging touched now, not inside the first sync
        if reserve is not None:
            reserve(list(dict.fromkeys(e.recipe.target if e.recipe is not None else e.name for e in plan.entries)))

    def _updater_for(self, plan: SyncPlan):
        """The engine itself, or for a factor plan the ``FactorEngine`` over it (kept across channel
        reopens of the same plan, so its resident pristine copies survive membership changes)."""
        if not any(e.recipe is not None for e in plan.entries):
            if self._factor_engine is not None:
                self._factor_engine.close()
            self._factor_engine = None
            return self.engine
        from sync_service.factor_stream.receiver import FactorEngine

        if self._factor_engine is None or self._factor_engine.plan != plan:
            if self._factor_engine is not None:
                self._factor_engine.close()
            self._factor_engine = FactorEngine(self.engine, plan)
        return self._factor_engine

    def factor_state(self) -> FactorStateReport:
        """Factor streaming state (``ready``: a factor delta can apply; ``resident_bytes``: pristine
        copies + factors held)."""
        fe = self._factor_engine
        if fe is None:
            return FactorStateReport(ready=False, resident_bytes=0, merge_s=0.0)
        return FactorStateReport(ready=fe.factor_ready(), resident_bytes=fe.resident_bytes(), merge_s=fe.merge_s)

    def close_transport(self, owner: str | None = None) -> None:
        """Close ``owner``'s channel (``None``: every channel). Idempotent. When no channel is left (the
        ``WeightSync`` closed, or this engine left it) the engine's staging buffers are freed: a model-size
        copy otherwise kept for a sync that may never come (the next channel open reserves them again)."""
        self._close_channels(owner)
        release = getattr(self.engine, "release_staging", None)
        if not self._channels and release is not None:
            release()

    def _close_channels(self, owner: str | None) -> None:
        """Close channels; an update a closed channel staged and never committed is aborted (its owner is
        gone or starts over), so it cannot hold off another owner's syncs."""
        for key in list(self._channels) if owner is None else [owner]:
            token = self._staged.pop(key, None)
            if token:
                self._updater(key).abort(token)
            entry = self._channels.pop(key, None)
            if entry is not None:
                entry[0].close()
                from sync_service.engines.served_check import install

                install(self.engine, "off", self.name, key)  # that owner's served check goes with its channel

    def receive(self, owner: str, timeout_s: float, reset_versions: bool = False) -> ReceiveReport:
        """Receive one whole sync over ``owner``'s channel: staged, verified, acked, not committed. The report
        carries the engine's update token (``commit`` / ``abort`` act with it) and the served check's findings
        (``served_findings``; ``None`` when off). ``reset_versions``: the
        engine takes a version at or below the one it serves (``engines.commit_gate``)."""
        if owner not in self._channels:
            raise RuntimeError(f"{self.name}: receive before open_transport (channel {owner!r})")
        transport, receiver, factors = self._channels[owner]
        s = receiver.receive_sync(transport, timeout_s=timeout_s, commit=False, reset_versions=reset_versions)
        self._staged[owner] = s.update_id
        from sync_service.engines.served_check import findings

        return ReceiveReport(engine=self.name, version=s.version, buckets=s.buckets, entries=s.entries,
                             payload_bytes=s.payload_bytes, wait_s=s.wait_s, verify_s=s.verify_s, apply_s=s.apply_s,
                             finish_s=s.finish_s, total_s=s.total_s, rx_merge_s=factors.merge_s if factors else 0.0,
                             update_id=s.update_id, served_findings=findings(self.engine, owner))

    def commit(self, owner: str, version: int, update_id: str | None = None) -> None:
        """Serve the version staged by ``owner``'s last receive (``update_id``: its token, from the
        ``ReceiveReport``), atomically; caches are reset.

        Raises:
            RuntimeError: ``owner`` staged no update here; or the engine refused (``CommitRefused``): the
                token is not the staged update's (that update, another sync's, is kept), or ``version`` is not
                this finished update's or not above the served version — this update is aborted then, so the
                next sync begins cleanly and the engine keeps serving its last committed version.
        """
        token = update_id or self._staged.get(owner)
        if not token:
            raise RuntimeError(f"{self.name}: commit({version}) from channel {owner!r}, which staged no update here; "
                               f"version {self.engine.weight_version()} stays served")
        updater = self._updater(owner)
        try:
            updater.commit(version, token)
        except Exception:
            updater.abort(token)  # only this owner's update (engines drop a refused update themselves)
            raise
        finally:
            if self._staged.get(owner) == token:
                del self._staged[owner]
        self.engine.reset_caches()

    def abort(self, owner: str, update_id: str | None = None) -> None:
        """Drop the update ``owner``'s channel staged (``update_id``: that token only); another owner's
        update is never touched; the previous version stays served. Idempotent."""
        token = update_id or self._staged.get(owner)
        if self._staged.get(owner) == token:
            self._staged.pop(owner, None)
        if token:
            self._updater(owner).abort(token)

    def _updater(self, owner: str):
        entry = self._channels.get(owner)
        if entry is None:
            return self._factor_engine or self.engine
        return entry[2] or self.engine

    def generate(self, prompt_token_ids: list[int], max_new_tokens: int) -> tuple[list[int], int | None]:
        """Greedy tokens and the weight version that produced them (hf engine)."""
        r = self.engine.generate(prompt_token_ids, max_new_tokens)
        return r.tokens, r.weight_version

    def generate_logprobs(self, prompt_token_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float], int | None]:
        """Greedy tokens, the natural-log probability of each, and the weight version that produced them
        (engines with ``generate_batch``: vLLM).

        Raises:
            TypeError: this engine reports no logprobs (the transformers engine: use ``generate``).
        """
        batch = getattr(self.engine, "generate_batch", None)
        if batch is None:
            raise TypeError(f"{self.name}: engine {type(self.engine).__name__} reports no logprobs; use generate")
        g = batch([prompt_token_ids], max_new_tokens, logprobs=True)[0]
        return g.tokens, g.logprobs, g.weight_version

    def token_logprobs(self, sequences: list[list[int]]) -> tuple[list[np.ndarray], int | None]:
        """Per sequence a float32 ``[len - 1, vocab]`` array of the served model's teacher-forced next-token
        log-probabilities over the full vocabulary, and the version that produced them (HF and vLLM engines).

        Raises:
            TypeError: this engine reports no logprobs.
        """
        score = getattr(self.engine, "token_logprobs", None)
        if score is None:
            raise TypeError(f"{self.name}: engine {type(self.engine).__name__} reports no logprobs")
        version, out = score(sequences)
        return [t.numpy() for t in out], version

    def sample(self, prompt_token_ids: list[int], max_new_tokens: int, num_samples: int, temperature: float,
               seed: int) -> tuple[list[list[int]], int | None]:
        """``num_samples`` sampled continuations (see ``HFEngine.sample``) and the weight version that
        produced them all."""
        r = self.engine.sample(prompt_token_ids, max_new_tokens, num_samples=num_samples, temperature=temperature,
                               seed=seed)
        return r.tokens, r.weight_version

    def served_weights(self, names: list[str] | None = None, values: bool = False) -> ServedWeights:
        """Per-tensor xxh3_64 digests (and with ``values`` the bytes) of the served version, computed here
        over the bytes served (``protocols.readback``; one consistent version, copied under the commit lock).

        Raises:
            KeyError: a name this engine does not serve. RuntimeError: the engine cannot read its weights
            back. vLLM reports its own names, and checkpoint copies where it keeps a tensor opaque
            (``engines.vllm.served``; ``TensorDigest.source``).
        """
        from sync_service.engines.readback import served_from_rows, served_weights

        digests = getattr(self.engine, "served_digests", None)  # computed where the weights live (vLLM's worker)
        if digests is not None:
            return served_from_rows(self.name, *digests(names, values))
        served = getattr(self.engine, "served", None)
        if served is None:
            raise RuntimeError(f"{self.name}: engine {type(self.engine).__name__} cannot read back its served "
                               f"weights (served_weights needs the transformers or memory engine)")
        version, tensors = served(names)
        return served_weights(self.name, version, tensors, names, values)

    def can_export(self) -> bool:
        """Whether this engine can stream its served weights to a peer (``send_weights``)."""
        return callable(getattr(self.engine, "export_tensors", None))

    def send_weights(self, request: ExportRequest) -> ExportReport:
        """Stream the served weights of ``request.version`` to a late-joining engine over a channel of
        its own (this engine is sender 0 of the plan); blocks until the joiner acked. Generation goes on
        meanwhile; the caller holds off syncs to this engine until it returns.

        Raises:
            RuntimeError: this engine does not serve ``request.version`` or cannot export its weights.
        """
        from sync_service.streaming.pool import BucketPool
        from sync_service.streaming.sender import Sender
        from sync_service.streaming.tensor_source import TensorSource
        from sync_service.transports import TransportSpec, open_sender

        version = request.version
        if not self.can_export() or self.engine.weight_version() != version:
            raise RuntimeError(f"{self.name}: cannot send version {version} (serves {self.engine.weight_version()}, "
                               f"export supported: {self.can_export()})")
        plan = decode(request.plan)
        if not isinstance(plan, SyncPlan):
            raise ValueError(f"send_weights: plan decodes to {type(plan).__name__}, not a SyncPlan")
        transport = open_sender(TransportSpec.from_bytes(request.spec), sender=0)
        try:
            sender = Sender(transport, BucketPool(bucket_bytes=plan.bucket_bytes, num_buffers=2), sender=0,
                            secret=request.secret)
            stats = sender.send_sync(request.session, version, TensorSource(self.engine.export_tensors()), plan,
                                     timeout_s=request.timeout_s)
        finally:
            transport.close()
        return ExportReport(payload_bytes=stats.payload_bytes, buckets=stats.buckets, seconds=stats.total_s)

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


RolloutEngine = ray.remote(num_cpus=0, max_concurrency=4)(RolloutEngineCore)
"""The Ray actor class of a rollout engine (``RolloutEngine.remote(model_dir=..., engine="hf", name=...)``)."""


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    exact = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e8m0fnu)  # no numpy dtype; each exact in fp32
    return (t.float() if t.dtype in exact else t).numpy().copy()
