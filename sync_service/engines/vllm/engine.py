"""``VLLMEngine``: a vLLM ``LLM`` as a weightsync rollout engine (implements ``EngineAdapter``).

Parameter table: the checkpoint tensors the engine was started from, in the ``hf`` naming (the keys
``save_pretrained`` writes: per-expert ``mlp.experts.N.gate_proj.weight``, separate ``q/k/v_proj``),
with the engine's dtype — exactly what vLLM's own ``load_weights`` consumes, so received tensors go
through vLLM's loaders (stacking, expert mapping, TP sharding) unchanged. Names the model ignores
are left out.

One sync: ``begin_update`` → ``apply`` × n copy into staging inside the worker (served weights
untouched) → ``finish_update`` reloads every vLLM module a received tensor feeds, with its post-load
processing, once → ``commit`` makes the version current and resets the prefix cache. The served
weights change only inside ``finish_update``; from there to ``commit`` / ``abort`` generation is
held (``ServeGate``), so every generation result carries the one version that produced it.
See ``docs/vllm.md``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protocols.interfaces import FinishReport, PauseMode
from protocols.params import Box, ParamMeta, box_numel
from sync_service.dtypes import wire_dtype
from sync_service.engines.hf import GenerateResult
from sync_service.engines.commit_gate import CommitGate
from sync_service.engines.staging import check_box
from sync_service.engines.vllm.config import VLLMEngineConfig
from sync_service.engines.vllm.families import check_family
from sync_service.engines.vllm.gate import ServeGate
from sync_service.engines.vllm.worker import WORKER_EXTENSION, tensor_payload

__all__ = ["VLLMEngine", "VLLMGeneration"]


@dataclass(frozen=True, slots=True)
class VLLMGeneration:
    """One prompt's greedy continuation.

    Attributes:
        tokens: generated token ids (prompt excluded).
        logprobs: log-probability of each generated token (natural log), same length as ``tokens``.
        num_cached_tokens: prompt tokens served from the prefix cache.
        weight_version: the committed version that produced every token; ``None`` before any sync.
    """

    tokens: list[int]
    logprobs: list[float]
    num_cached_tokens: int
    weight_version: int | None


class VLLMEngine:
    """``EngineAdapter`` over ``vllm.LLM`` (see the module docstring).

    Thread safety: generations may run on other threads than the update calls (a threaded Ray
    actor); they are serialised among themselves. The calls of one sync come from one thread.

    Raises (constructor):
        ImportError: vLLM is not installed (``scripts/setup-vllm.sh``).
        ValueError: a model family vLLM cannot serve (``families.check_family``), or the model's loader
            rejects a checkpoint tensor.
    """

    def __init__(self, config: VLLMEngineConfig) -> None:
        from vllm import LLM

        check_family(config.model_dir)  # a family vLLM cannot serve is refused before vLLM starts
        self._config = config
        kwargs = dict(config.engine_kwargs)
        if config.block_size is not None:
            kwargs["block_size"] = config.block_size
        self._llm = LLM(
            model=str(config.model_dir),
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            kv_cache_memory_bytes=config.kv_cache_bytes,
            enable_prefix_caching=config.enable_prefix_caching,
            enforce_eager=config.enforce_eager,
            seed=config.seed,
            max_logprobs=config.max_logprobs,
            worker_extension_cls=WORKER_EXTENSION,
            **kwargs,
        )
        self._in_process = type(self._llm.llm_engine.engine_core).__name__ == "InprocClient"
        # vLLM's CPU attention builds its metadata for the OpenMP thread count of the thread that runs
        # the step and checks it again in the kernel; a thread whose OpenMP count differs from torch's
        # (any thread but the one that set it) fails that check. Every thread that drives an in-process
        # engine adopts the count vLLM was started with. vLLM replaces ``torch.set_num_threads`` with a
        # no-op in its worker, so the builtin is called.
        self._threads = torch.get_num_threads()
        self._thread_ready = threading.local()
        table = self._rpc("ws_init")
        self._metas = tuple(ParamMeta(name, dtype, tuple(shape)) for name, dtype, shape in table)
        self._by_name = {m.name: m for m in self._metas}
        self._applied: dict[str, int] = {}  # elements received per announced name (checked here, so
        # errors keep their types whichever process layout vLLM runs in)
        self._gate = ServeGate(config.pause_timeout_s)
        self._version: int | None = None
        self._pending: int | None = None
        self._finished = False
        self.commit_gate = CommitGate("VLLMEngine")
        """The engine's version fence, update tokens and pre-commit checks (``engines.commit_gate``); the
        checks run here, after the worker reloaded the touched modules (``extra["rpc"]``: ``collective_rpc``
        into the worker, for a check that reads what the worker will serve)."""

    @classmethod
    def from_pretrained(cls, model_dir: str, **config: object) -> "VLLMEngine":
        return cls(VLLMEngineConfig(model_dir=str(model_dir), **config))

    # -- table and state -------------------------------------------------------------------
    def param_metas(self) -> Sequence[ParamMeta]:
        return self._metas

    def weight_version(self) -> int | None:
        return self._version

    def served_digests(self, names: Sequence[str] | None = None, values: bool = False) -> tuple[int | None, list[list]]:
        """``(version, rows)``: the committed version and, per tensor the worker serves, ``[name, dtype, shape,
        xxh3_64, source, bytes | None]`` (``served.served_rows``), read between generations while no update is
        being made live (the serve gate), so all of one version.

        Raises:
            KeyError: a name not served here. TimeoutError: an update held the gate past ``pause_timeout_s``.
        """
        with self._gate.serving():
            version = self._version
            rows = self._rpc("ws_served", None if names is None else list(names), values)
        return version, rows

    def record_applied(self, on: bool) -> None:
        """The served check (``engines.served_check``): the worker records what each apply hands it."""
        self._rpc("ws_record_applied", bool(on))

    # -- update lifecycle ------------------------------------------------------------------
    def begin_update(self, version: int, names: Sequence[str], *, reset_versions: bool = False) -> str:
        """Stage buffers for ``names`` in the worker; with ``PauseMode.WAIT`` also hold generation. Returns the
        update token (``CommitGate.begin``).

        Raises:
            UpdateInProgressError: an update is already in progress. VersionFenceError: ``version`` is not above
                the served one (without ``reset_versions``).
            KeyError: a name is not in the table (nothing staged).
            TimeoutError: ``WAIT`` and running generations did not finish in time.
        """
        unknown = sorted(set(names) - self._by_name.keys())
        if unknown:
            raise KeyError(
                f"names not in the vLLM engine's parameter table (hf naming): {unknown[:5]} ({len(unknown)} in all); "
                "send tensors under the keys save_pretrained writes"
            )
        update_id = self.commit_gate.begin(version, reset_versions=reset_versions)
        try:
            self._rpc("ws_begin", version, list(names))
        except BaseException:
            self.commit_gate.dropped(update_id)
            raise
        self._pending, self._finished = version, False
        self._applied = dict.fromkeys(names, 0)
        if self._config.pause_mode is PauseMode.WAIT:
            try:
                self._gate.close()
            except BaseException:
                self.abort(update_id)
                raise
        return update_id

    def apply(self, name: str, box: Box, data: torch.Tensor) -> None:
        """Copy ``data`` into ``box`` of ``name`` in the worker's staging (served weights untouched).

        In process the worker reads ``data`` directly; across processes it travels as raw bytes with
        its dtype and shape (vLLM's RPC does not carry tensors intact).

        Raises:
            KeyError: ``name`` not announced; ValueError: wrong box, shape or dtype.
        """
        if self._pending is None:
            raise RuntimeError(f"apply({name!r}) without begin_update")
        if name not in self._applied:
            raise KeyError(f"{name!r} was not announced in begin_update({self._pending})")
        meta = self._by_name[name]
        shape = meta.shape
        if wire_dtype(data.dtype) != meta.dtype:
            raise ValueError(f"data for {name!r} is {data.dtype}, the engine holds {meta.dtype}; cast on the trainer side")
        check_box(name, box, shape, data)
        self._rpc("ws_apply", name, box, data if self._in_process else tensor_payload(data))
        self._applied[name] += box_numel(box)

    def finish_update(self) -> FinishReport:
        """Hold generation, then reload and post-process every vLLM module the update touched.

        Returns the worker's counts (modules reloaded, tensors staged, seconds).

        Raises:
            ValueError: a tensor was not covered completely (the update is aborted).
            TimeoutError: running generations did not finish in time (served weights untouched).
        """
        if self._pending is None or self._finished:
            raise RuntimeError("finish_update needs exactly one begin_update before it")
        bad = {n: (a, math.prod(self._by_name[n].shape)) for n, a in self._applied.items() if a != math.prod(self._by_name[n].shape)}
        if bad:
            self.abort(self.commit_gate.staged_id)
            detail = ", ".join(f"{n}: {a}/{t}" for n, (a, t) in list(bad.items())[:5])
            raise ValueError(f"incomplete update, elements applied/expected: {detail} ({len(bad)} tensors); update aborted")
        self._gate.close()
        try:
            stats = self._rpc("ws_finish")
        except BaseException:
            self.abort(self.commit_gate.staged_id)
            raise
        self.commit_gate.vote(self.abort, list(self._applied), self._applied, extra={"rpc": self._rpc})
        self._finished = True
        return FinishReport(**stats)

    def commit(self, version: int, update_id: str | None = None) -> None:
        """Make ``version`` current, drop prefix caches computed under the old one, reopen generation.

        Raises:
            CommitRefused (a RuntimeError), as ``CommitGate.admit_commit``: another update's token (nothing
                changes); or ``version`` is not the finished update in progress or not above the served one:
                that update is dropped then (``abort``: the served version stays, the next sync begins cleanly).
        """
        self.commit_gate.admit_commit(version, update_id, finished=self._finished, abort=self.abort)
        self._rpc("ws_commit", version)
        self._reset_prefix_cache()
        self._version, self._pending, self._finished = version, None, False
        self.commit_gate.committed(version)
        self._gate.open()

    def abort(self, update_id: str | None = None) -> bool:
        """Drop the update whose token is ``update_id`` (``None``: whatever is staged); if ``finish_update``
        already rewrote modules, reload the served version. Another update's token does nothing. Returns
        whether an update was dropped. Idempotent."""
        if not self.commit_gate.owns(update_id):
            return False
        try:
            if self._rpc("ws_abort"):
                self._reset_prefix_cache()
        finally:
            self._pending, self._finished = None, False
            self.commit_gate.dropped(update_id)
            self._gate.open()
        return True

    def reset_caches(self) -> None:
        """Drop vLLM's prefix cache (KV blocks computed under an older version). ``commit`` already does.

        Outside an update, running generations finish first and new ones wait (vLLM resets only when
        idle). Raises ``TimeoutError`` if they do not finish within ``pause_timeout_s``.
        """
        if self._pending is not None:  # the update owns the gate
            self._reset_prefix_cache()
            return
        self._gate.close()
        try:
            self._reset_prefix_cache()
        finally:
            self._gate.open()

    # -- serving ---------------------------------------------------------------------------
    def generate_batch(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, logprobs: bool = True
    ) -> list[VLLMGeneration]:
        """Greedy decoding of token-id prompts in one vLLM batch; one weight version for all of them.

        Raises:
            ValueError: an empty prompt or ``max_new_tokens < 1``.
            TimeoutError: an update held generation longer than ``pause_timeout_s``.
        """
        from vllm import SamplingParams

        if not prompts or any(len(p) == 0 for p in prompts) or max_new_tokens < 1:
            raise ValueError(f"need non-empty prompts and max_new_tokens >= 1, got {len(prompts)} prompts / {max_new_tokens}")
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, logprobs=0 if logprobs else None)
        with self._gate.serving():
            self._adopt_threads()
            version = self._version
            outs = self._llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [_generation(o, version) for o in outs]

    def token_logprobs(self, sequences: Sequence[Sequence[int]]) -> tuple[int | None, list[torch.Tensor]]:
        """``(version, per sequence a float32 [len - 1, vocab] tensor)``: vLLM's prompt logprobs over the full
        vocabulary (``logprobs.prompt_logprobs``; needs ``VLLMEngineConfig.max_logprobs=-1``), one version for all.

        Raises:
            ValueError: a sequence shorter than 2 tokens, or an engine started with fewer logprobs than the vocabulary.
        """
        from sync_service.engines.vllm.logprobs import prompt_logprobs

        with self._gate.serving():
            self._adopt_threads()
            version = self._version
            out = prompt_logprobs(self._llm, sequences)
        return version, out

    def generate(self, prompt_token_ids: Sequence[int], max_new_tokens: int) -> GenerateResult:
        """Greedy tokens of one prompt (the ``HFEngine.generate`` signature)."""
        g = self.generate_batch([prompt_token_ids], max_new_tokens, logprobs=False)[0]
        return GenerateResult(tokens=g.tokens, weight_version=g.weight_version)

    def shutdown(self) -> None:
        """Stop vLLM's engine core (frees its memory; the object is unusable afterwards)."""
        self._llm.llm_engine.engine_core.shutdown()

    # -- internals -------------------------------------------------------------------------
    def _reset_prefix_cache(self) -> None:
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache (requests still running)")

    def _adopt_threads(self) -> None:
        if self._in_process and not getattr(self._thread_ready, "done", False):
            torch._C.set_num_threads(self._threads)
            self._thread_ready.done = True

    def _rpc(self, method: str, *args: object) -> object:
        self._adopt_threads()
        results = self._llm.collective_rpc(method, timeout=self._config.rpc_timeout_s, args=args)
        return results[0]


def _generation(out: object, version: int | None) -> VLLMGeneration:
    completion = out.outputs[0]
    tokens = list(completion.token_ids)
    logprobs = [lp[t].logprob for t, lp in zip(tokens, completion.logprobs)] if completion.logprobs else []
    return VLLMGeneration(
        tokens=tokens, logprobs=logprobs, num_cached_tokens=int(out.num_cached_tokens or 0), weight_version=version
    )
