"""The embedded default rollout engine: a transformers causal LM on CPU, updated by staged apply.

Parameter table: the model's ``named_parameters()`` in the transformers v5 in-memory
("hf-fused") naming — e.g. ``model.layers.0.mlp.experts.gate_up_proj`` [E, 2I, H] — plus its
persistent buffers (in ``state_dict``, loaded from the checkpoint: DeepSeek's
``mlp.gate.e_score_correction_bias``), so a full sync carries everything the checkpoint holds; a delta
sends only what the adapter changes, never a buffer. Tied weights (``lm_head.weight`` tied to
``model.embed_tokens.weight``) are reported once, under the name ``named_parameters`` keeps. Loaded from a
block-FP8 checkpoint (``quantization_config`` quant_method "fp8"), each quantized parameter is listed as
``float8_e4m3fn`` plus its scales (float32 or ue8m0) and served as those bytes; the model computes with a
dequantized copy refreshed at every sync (``engines/fp8.py``).

Staged apply: ``begin_update(version, names)`` takes one staging buffer per name being updated;
``apply`` copies received boxes into staging only; ``finish_update`` checks every staged name was
covered completely; ``commit`` swaps the staging storage into the live parameters under the same
lock ``generate`` holds for a whole generation, so a generation sees exactly one weight version.
``abort`` drops staging; the previous version stays served. Swapped-out storage is kept as the next
sync's staging buffer, so steady-state syncs allocate nothing; ``reserve_staging`` (at channel open)
allocates and touches the buffers before the first sync. A parameter that lies in the copy-on-write
mapping of the safetensors file (transformers leaves the tensors it did not convert there) gets a
private copy at load (``privatize_mapped``): as a later staging buffer it would take a copy-on-write
fault per page inside a sync (the first delta at 1x took 63 MB of them, apply 1.1 s instead of 0.3).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from protocols.interfaces import FinishReport
from protocols.params import Box, ParamMeta
from sync_service.dtypes import wire_dtype
from sync_service.engines.fp8 import Fp8Served, load_fp8_model
from sync_service.engines.commit_gate import CommitGate
from sync_service.engines.staging import APPLY_CHUNK_BYTES, Staging, privatize_mapped

__all__ = ["GenerateResult", "HFEngine", "HFEngineConfig", "SampleResult", "load_causal_lm"]


@dataclass(kw_only=True, slots=True)
class HFEngineConfig:
    """Settings of the embedded transformers engine."""

    lock_timeout_s: float = 60.0
    """Longest wait for the weights lock (held by a generation or a commit) before ``TimeoutError``."""


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """Greedy tokens and the committed weight version that produced every one of them.

    Attributes:
        tokens: generated token ids only (prompt excluded), ``len <= max_new_tokens``.
        weight_version: the version served during the whole generation; ``None`` before any sync.
    """

    tokens: list[int]
    weight_version: int | None


@dataclass(frozen=True, slots=True)
class SampleResult:
    """Sampled continuations of one prompt and the committed weight version that produced all of them.

    Attributes:
        tokens: ``num_samples`` lists of generated token ids (prompt excluded), each ``max_new_tokens`` long.
        weight_version: the version served during the whole call; ``None`` before any sync.
    """

    tokens: list[list[int]]
    weight_version: int | None


def load_causal_lm(path: str | Path, *, dtype: torch.dtype | None = None, quantization_config=None) -> torch.nn.Module:
    """Load a transformers causal LM from a local directory of safetensors weights onto CPU, in
    inference mode (``train(False)``). Pickled weights (``pytorch_model.bin``) are never loaded.
    ``quantization_config``: passed to ``from_pretrained`` (a block-FP8 checkpoint: ``FineGrainedFP8Config(dequantize=True)``).

    Raises:
        FileNotFoundError: ``path`` does not exist, or holds no ``*.safetensors`` weights.
    """
    import json

    import transformers

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist; pass a saved checkpoint dir")
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"model directory {str(path)!r} has no *.safetensors weights (pickled .bin weights "
                                f"are never loaded); re-save it with save_pretrained(..., safe_serialization=True)")
    kwargs = {} if dtype is None else {"dtype": dtype}
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    # the class the checkpoint names (a vision-language MoE is no AutoModelForCausalLM), else the causal-LM auto class
    config = path / "config.json"
    archs = (json.loads(config.read_text()).get("architectures") or []) if config.is_file() else []
    cls = next((getattr(transformers, a) for a in archs if hasattr(transformers, a)), transformers.AutoModelForCausalLM)
    return cls.from_pretrained(str(path), use_safetensors=True, **kwargs).train(False)


class HFEngine:
    """EngineAdapter over a transformers ``PreTrainedModel`` (implements ``protocols.EngineAdapter``), on the
    device its parameters are on (``from_pretrained(device=)``): staging buffers are allocated like the served
    tensors (``empty_like``, same device), ``apply`` copies a bucket's host view into them (H2D on a GPU),
    prompts go to that device. CPU runs the same code.

    Thread safety: ``generate`` and ``commit`` may run on different threads (a threaded Ray actor);
    ``begin_update`` / ``apply`` / ``finish_update`` / ``abort`` / ``commit`` of one sync are
    called from one thread at a time.
    """

    apply_chunk_bytes = APPLY_CHUNK_BYTES
    """``protocols.interfaces.ChunkedApply``: ``apply`` copies into staging, so the receiver hashes
    each bucket piece by piece while copying it (one pass over the bucket)."""

    def __init__(self, model: torch.nn.Module, *, config: HFEngineConfig | None = None,
                 fp8: Mapping[str, torch.Tensor] | None = None) -> None:
        """``fp8``: FP8 values and scales in hf-fused naming, served in place of those parameters (``load_fp8_model``)."""
        self._model = model.train(False)  # inference mode (dropout off)
        self._config = config or HFEngineConfig()
        self._params: dict[str, torch.Tensor] = dict(model.named_parameters())
        params = set(self._params)
        self._params.update((n, b) for n, b in model.state_dict(keep_vars=True).items()
                            if n not in params and not any(b is p for p in self._params.values()))
        privatize_mapped(self._params.values())
        self._fp8 = Fp8Served(fp8 or {}, self._params)
        self._metas = tuple(row for n, p in self._params.items() for row in self._fp8.metas(n, p))
        self._held: dict[str, torch.Tensor] = {m.name: self._fp8.tensors.get(m.name, self._params.get(m.name))
                                               for m in self._metas}
        """Table name → the served tensor (a parameter, or FP8 values / scales)."""
        self._dequantized: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._version: int | None = None
        self._staging = Staging(lambda n: torch.empty_like(self._held[n].data), "HFEngine")
        self._finished = False
        self.commit_gate = CommitGate("HFEngine")
        """The engine's version fence, update tokens and pre-commit checks (``engines.commit_gate``)."""

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype | None = None,
                        config: HFEngineConfig | None = None, device: str | torch.device = "cpu") -> "HFEngine":
        """The checkpoint at ``path`` served on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``; loaded on the host,
        then moved). A block-FP8 checkpoint (``quantization_config`` quant_method "fp8") is served as FP8
        (``engines/fp8.py``)."""
        from sync_service.merge.fp8_checkpoint import is_fp8_checkpoint

        device = torch.device(device)
        if is_fp8_checkpoint(path):
            model, fp8 = load_fp8_model(path, lambda p, **kw: load_causal_lm(p, dtype=dtype, **kw))
            return cls(model.to(device), config=config, fp8={n: t.to(device) for n, t in fp8.items()})
        return cls(load_causal_lm(path, dtype=dtype).to(device), config=config)

    # -- table and state -------------------------------------------------------------------
    def param_metas(self) -> Sequence[ParamMeta]:
        return self._metas

    def weight_version(self) -> int | None:
        return self._version

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Detached clones of the served parameters (for verification; allocates)."""
        return self.served()[1]

    def served(self, names: Sequence[str] | None = None) -> tuple[int | None, dict[str, torch.Tensor]]:
        """``(version, clones of the served parameters)`` (``names`` only, when given; unknown ones are
        skipped), read together under the generation lock (no commit in between; allocates)."""
        with self._locked():
            keep = self._held if names is None else {n: self._held[n] for n in names if n in self._held}
            return self._version, {n: p.detach().clone() for n, p in keep.items()}

    # -- update lifecycle ------------------------------------------------------------------
    def begin_update(self, version: int, names: Sequence[str], *, reset_versions: bool = False) -> str:
        """Take staging buffers for ``names`` (``engines.staging.Staging``); returns the update token
        (``CommitGate.begin``: ``commit`` / ``abort`` act with it).

        Raises:
            UpdateInProgressError: an update is already in progress (it commits or aborts first).
            VersionFenceError: ``version`` is at or below the served one without ``reset_versions``.
            KeyError: a name is not in this engine's parameter table.
        """
        unknown = sorted(set(names) - self._held.keys())
        if unknown:
            raise KeyError(f"names not in the engine parameter table: {unknown[:5]} ({len(unknown)} in all)")
        update_id = self.commit_gate.begin_staged(version, lambda: self._staging.begin(version, names), reset_versions=reset_versions)
        self._finished = False
        return update_id

    def reserve_staging(self, names: Sequence[str]) -> int:
        """Allocate and touch the staging buffers of ``names`` now (``Staging.reserve``), so no sync
        pays first-touch page faults; names outside the table are skipped. Returns bytes allocated."""
        return self._staging.reserve([n for n in names if n in self._held])

    @property
    def device(self) -> torch.device:
        """The device the served tensors (and so the staging buffers) live on."""
        return next(iter(self._params.values())).device

    def staging_bytes(self) -> int:
        """Bytes of staging buffers held on ``device`` (spares and a sync being staged)."""
        return self._staging.held_bytes

    def release_staging(self) -> int:
        """Free the staging buffers kept for the next sync (``Staging.release``; when the last channel
        closes). Returns the bytes freed."""
        return self._staging.release()

    def apply(self, name: str, box: Box, data: torch.Tensor) -> None:
        """Copy ``data`` into ``box`` of the staging buffer of ``name`` (never the live parameter).

        Raises:
            RuntimeError: no update in progress.
            KeyError: ``name`` was not announced in ``begin_update``.
            ValueError: ``data`` does not have the box's shape, or the box leaves the tensor.
        """
        self._staging.apply(name, box, data)

    def staged_buffer(self, name: str) -> torch.Tensor:
        """The staging buffer ``apply`` copies ``name``'s boxes into in this sync (the served check reads the boxes
        there as they land, ``engines.served_check``). Raises KeyError: ``name`` is not staged."""
        return self._staging.buffer(name)

    def finish_update(self) -> FinishReport:
        """Check every staged name was covered completely (boxes of one sync are disjoint). Post-load
        processing: the compute copies of staged FP8 tensors are dequantized here (``Fp8Served.dequantized``).

        Raises:
            ValueError: a name received fewer or more elements than it holds.
            RuntimeError: no update in progress, or it was finished already.
        """
        t0 = time.perf_counter()
        if self._staging.version is None or self._finished:
            raise RuntimeError("finish_update needs exactly one begin_update before it")
        self._staging.check_complete()
        self._dequantized = self._fp8.dequantized({n: self._staging.buffer(n) for n in self._staging.names()})
        self.commit_gate.vote(self.abort, self._staging.names(), self._staging.applied(),
                              values=lambda: {n: self._staging.buffer(n) for n in self._staging.names()})
        self._finished = True
        return FinishReport(tensors=len(self._staging.names()), modules=len(self._dequantized),
                            seconds=time.perf_counter() - t0)

    def commit(self, version: int, update_id: str | None = None) -> None:
        """Swap staged buffers into the live parameters under the generation lock.

        ``update_id``: the token ``begin_update`` returned (``None``: the update staged).

        Raises:
            CommitRefused (a RuntimeError): ``update_id`` is not the staged update's (``ForeignCommit``: that
                update is kept, it belongs to another sync); or ``version`` differs from the one begun,
                ``finish_update`` did not run, or it is not above the served version
                (``CommitGate.check_commit``): this update is dropped then (the served version stays, the
                next sync begins cleanly).
        """
        self.commit_gate.admit_commit(version, update_id, finished=self._finished, abort=self.abort)
        with self._locked():
            for name, buffer in self._staging.take().items():
                if name in self._fp8.tensors:  # served FP8 values / scales
                    self._staging.keep_spare(name, self._fp8.tensors[name])
                    self._fp8.tensors[name] = self._held[name] = buffer
                    continue
                param = self._params[name]
                self._staging.keep_spare(name, param.data)
                param.data = buffer
            for name, compute in self._dequantized.items():
                self._fp8.keep_spare(name, self._params[name].data)
                self._params[name].data = compute
            self._version = version
            self.commit_gate.committed(version)
        self._dequantized = {}
        self._finished = False

    def abort(self, update_id: str | None = None) -> bool:
        """Drop the staged update if ``update_id`` is its token (``None``: whatever is staged); the served
        version is untouched. Returns whether an update was dropped; an abort with another update's token
        does nothing. Idempotent."""
        if not self.commit_gate.owns(update_id):
            return False
        self._staging.drop()
        for name, compute in self._dequantized.items():
            self._fp8.keep_spare(name, compute)
        self._dequantized = {}
        self._finished = False
        return self.commit_gate.dropped(update_id)

    def reset_caches(self) -> None:
        """No-op: this engine keeps no KV or prefix cache across ``generate`` calls."""

    # -- serving ---------------------------------------------------------------------------
    def generate(self, prompt_token_ids: Sequence[int], max_new_tokens: int) -> GenerateResult:
        """Greedy decoding of one prompt; blocks commits for its duration.

        Raises:
            ValueError: empty prompt or ``max_new_tokens < 1``.
        """
        if not prompt_token_ids or max_new_tokens < 1:
            raise ValueError(f"need a non-empty prompt and max_new_tokens >= 1, got {len(prompt_token_ids)} / {max_new_tokens}")
        ids = torch.tensor([list(prompt_token_ids)], dtype=torch.long, device=self._model.device)
        with self._locked(), torch.no_grad():
            out = self._model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                pad_token_id=self._pad_token_id(),
            )
            version = self._version
        return GenerateResult(tokens=out[0, ids.shape[1]:].tolist(), weight_version=version)

    def sample(self, prompt_token_ids: Sequence[int], max_new_tokens: int, *, num_samples: int = 1,
               temperature: float = 1.0, seed: int = 0) -> SampleResult:
        """Ancestral sampling of ``num_samples`` continuations: each token drawn from
        softmax(logits / ``temperature``) over the whole vocabulary (no top-k / top-p), with a
        ``torch.Generator`` seeded by ``seed`` (reproducible; the global RNG is untouched). No KV
        cache (short rollouts). Blocks commits for its duration.

        Raises:
            ValueError: empty prompt, ``max_new_tokens < 1``, ``num_samples < 1`` or ``temperature <= 0``.
        """
        if not prompt_token_ids or max_new_tokens < 1 or num_samples < 1 or temperature <= 0:
            raise ValueError(f"sample needs a non-empty prompt, max_new_tokens >= 1, num_samples >= 1 and "
                             f"temperature > 0; got {len(prompt_token_ids)} / {max_new_tokens} / {num_samples} / {temperature}")
        ids = torch.tensor([list(prompt_token_ids)] * num_samples, dtype=torch.long, device=self._model.device)
        gen = torch.Generator(device=self._model.device).manual_seed(seed)
        with self._locked(), torch.no_grad():
            for _ in range(max_new_tokens):
                logits = self._model(input_ids=ids).logits[:, -1].float() / temperature
                ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)], dim=1)
            version = self._version
        return SampleResult(tokens=ids[:, len(prompt_token_ids):].tolist(), weight_version=version)

    def token_logprobs(self, sequences: Sequence[Sequence[int]]) -> tuple[int | None, list[torch.Tensor]]:
        """``(version, per sequence a float32 [len - 1, vocab] tensor)``: log_softmax of the served model's logits
        at every position but the last (teacher-forced next-token log-probabilities, full vocabulary), all under
        one committed version (the generation lock). Raises ``ValueError`` for a sequence shorter than 2 tokens."""
        if any(len(s) < 2 for s in sequences):
            raise ValueError("token_logprobs: every sequence needs >= 2 token ids")
        out = []
        with self._locked(), torch.no_grad():
            for seq in sequences:
                ids = torch.tensor([list(seq)], dtype=torch.long, device=self._model.device)
                logits = self._model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, :-1]
                out.append(torch.log_softmax(logits.float(), dim=-1).cpu())
            version = self._version
        return version, out

    def export_tensors(self) -> dict[str, torch.Tensor]:
        """The served parameters themselves (no copy), for streaming them to a peer engine (a late
        joiner). Read only; they hold the served version until the next ``commit``: the caller must hold off
        syncs while it reads (the coordinator serialises a peer copy with pushes)."""
        return {n: t.data for n, t in self._held.items()}

    # -- internals -------------------------------------------------------------------------
    def _pad_token_id(self) -> int:
        cfg = getattr(self._model, "generation_config", None)
        pad = getattr(cfg, "pad_token_id", None) if cfg is not None else None
        if pad is None:
            pad = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if isinstance(pad, list):
            pad = pad[0]
        return 0 if pad is None else int(pad)

    def _locked(self) -> "_TimedLock":
        return _TimedLock(self._lock, self._config.lock_timeout_s)


class _TimedLock:
    """``with`` over a lock acquired with a timeout."""

    __slots__ = ("_lock", "_timeout_s")

    def __init__(self, lock: threading.Lock, timeout_s: float) -> None:
        self._lock, self._timeout_s = lock, timeout_s

    def __enter__(self) -> None:
        if not self._lock.acquire(timeout=self._timeout_s):
            raise TimeoutError(f"weights lock not acquired within {self._timeout_s} s")

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
