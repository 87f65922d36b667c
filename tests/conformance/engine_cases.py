"""Engine adapters under the engine conformance suite (``test_engines.py``), one builder per adapter.

Every adapter starts on the same generated checkpoint (a tiny real Qwen3-MoE with tokenizer files,
head_dim 32 so vLLM's CPU attention takes it) and is driven through ``protocols.interfaces.EngineAdapter``
only. A builder returns an ``EngineCase``; to put a new engine under the suite, add one builder to
``CASES`` (with its pytest marks in ``MARKS``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from protocols.params import full_box
from sync_service.merge.base import SafetensorsBase

PROMPT = [3, 14, 15, 9, 2, 6, 5]
NEW_TOKENS = 6


@dataclass
class EngineCase:
    """One engine adapter and what the suite needs to observe it.

    Attributes:
        engine: the adapter (started from the checkpoint: it serves the values ``versions["a"]``).
        versions: two full sets of values in the engine's naming and dtypes, ``"a"`` (the checkpoint)
            and ``"b"`` (perturbed); every name of the table.
        served: what the engine serves now, comparable bitwise (weights where the engine can return
            them, else greedy tokens).
        generate: one generation ``(output, weight_version)`` read together (tokens, or the weights of an
            engine that does not generate); may run on another thread while a commit happens.
    """

    engine: object
    versions: dict[str, dict[str, torch.Tensor]]
    served: Callable[[], object]
    generate: Callable[[], tuple[object, int | None]]
    _numbers: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def next_version(self) -> int:
        return next(self._numbers)

    def push(self, which: str, *, commit: bool = True) -> int:
        """A full sync of ``versions[which]``, each tensor as two boxes along dim 0 where it can be cut."""
        version = self.next_version()
        values = self.versions[which]
        self.engine.begin_update(version, list(values))
        for name, value in values.items():
            for box in halves(value.shape):
                self.engine.apply(name, box, value[tuple(slice(a, b) for a, b in box)])
        self.engine.finish_update()
        if commit:
            self.engine.commit(version)
        return version


def halves(shape: tuple[int, ...]) -> list[tuple[tuple[int, int], ...]]:
    """The full box of ``shape`` cut in two along dim 0 (one box if dim 0 has one row or none)."""
    box = full_box(tuple(shape))
    if not shape or shape[0] < 2:
        return [box]
    cut = shape[0] // 2
    return [((0, cut),) + box[1:], ((cut, shape[0]),) + box[1:]]


def make_checkpoint(root: Path) -> Path:
    """The shared checkpoint: qwen3_moe, 4 experts, H=64 (head_dim 32), fp32, tokenizer included."""
    from sync_service.synthetic import make_base

    return make_base("qwen3_moe", root / "base", dtype="float32", hidden=64, intermediate=32, vocab_size=256,
                     scale=0.1)


def two_versions(checkpoint: Path, engine) -> dict[str, dict[str, torch.Tensor]]:
    """The checkpoint's tensors of the engine's table (hf-fused naming) and a perturbed copy that changes
    greedy outputs."""
    base, table = SafetensorsBase(checkpoint), {m.name for m in engine.param_metas()}
    a = {m.name: base.read(m.name, full_box(m.shape)).contiguous() for m in base.metas() if m.name in table}
    g = torch.Generator().manual_seed(7)
    b = {n: (t.float() + 0.2 * torch.randn(t.shape, generator=g)).to(t.dtype) for n, t in a.items()}
    return {"a": a, "b": b}


def raw(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for n, t in tensors.items()}


@contextmanager
def memory_case(checkpoint: Path, monkeypatch) -> Iterator[EngineCase]:
    from sync_service.engines.memory import MemoryEngine

    base = SafetensorsBase(checkpoint)
    engine = MemoryEngine({m.name: base.read(m.name, full_box(m.shape)) for m in base.metas()})
    versions = two_versions(checkpoint, engine)

    def generate():
        version, tensors = engine.served()
        return raw(tensors), version

    yield EngineCase(engine=engine, versions=versions, served=lambda: raw(engine.state_dict()), generate=generate)


@contextmanager
def transformers_case(checkpoint: Path, monkeypatch) -> Iterator[EngineCase]:
    from sync_service.engines.hf import HFEngine

    engine = HFEngine.from_pretrained(checkpoint)
    versions = two_versions(checkpoint, engine)

    def generate():
        result = engine.generate(PROMPT, NEW_TOKENS)
        return result.tokens, result.weight_version

    yield EngineCase(engine=engine, versions=versions, served=lambda: raw(engine.state_dict()), generate=generate)


@contextmanager
def vllm_case(checkpoint: Path, monkeypatch) -> Iterator[EngineCase]:
    """vLLM in this process (``VLLM_ENV``, set here as an entry point would), in the trainers' naming."""
    from sync_service.engines.vllm.config import VLLM_ENV

    for key, value in VLLM_ENV.items():
        monkeypatch.setenv(key, value)
    from sync_service.engines.vllm.fused import FusedVLLMEngine

    engine = FusedVLLMEngine.from_pretrained(str(checkpoint), max_model_len=64, block_size=32)
    versions = two_versions(checkpoint, engine)

    def generate():
        result = engine.generate(PROMPT, NEW_TOKENS)
        return result.tokens, result.weight_version

    def served():
        g = engine.generate_batch([PROMPT], NEW_TOKENS, logprobs=True)[0]
        return g.tokens, g.logprobs

    try:
        yield EngineCase(engine=engine, versions=versions, served=served, generate=generate)
    finally:
        engine.shutdown()


@contextmanager
def vllm_server_case(checkpoint: Path, monkeypatch) -> Iterator[EngineCase]:
    """A stock vLLM server subprocess on loopback with the weightsync backend, through ``VLLMServerEngine``
    (``server_adapter.ServerAdapter``). ``generate`` asks ``/inference/v1/generate``, which reports the
    weight version of every output token (one version per request, or the case fails)."""
    from sync_service.engines.vllm_server import VLLMServerConfig, VLLMServerEngine
    from sync_service.engines.vllm_server.client import ServerClient
    from sync_service.engines.vllm_server.launch import LocalServer
    from tests.conformance.server_adapter import ServerAdapter

    args = ("--max-model-len", "64", "--block-size", "32", "--enable-scale-out")  # scale-out: the generate route
    with LocalServer.start(checkpoint, dtype="float32", timeout_s=600, extra_args=args) as server:
        engine = ServerAdapter(VLLMServerEngine(VLLMServerConfig(url=server.url, name="server")))
        client = ServerClient(server.url, timeout_s=120)
        body = {"token_ids": PROMPT, "sampling_params": {"temperature": 0.0, "max_tokens": NEW_TOKENS}}

        def generate():
            choice = client.post("/inference/v1/generate", body)["choices"][0]
            labels = {span["version"] for span in choice["weight_versions"]}
            if len(labels) != 1:
                return choice["token_ids"], f"mixed versions {sorted(map(str, labels))}"  # never a committed one
            label = labels.pop()
            return choice["token_ids"], None if label is None else int(label)

        def served():
            (g,) = engine.server.complete([PROMPT], NEW_TOKENS)
            return g.tokens, g.logprobs

        try:
            yield EngineCase(engine=engine, versions=two_versions(checkpoint, engine), served=served, generate=generate)
        finally:
            engine.close()


CASES = {"memory": memory_case, "transformers": transformers_case, "vllm": vllm_case,
         "vllm_server": vllm_server_case}
"""Engine adapter → builder (a context manager ``(checkpoint, monkeypatch) -> EngineCase``)."""
MARKS = {"vllm": ("vllm",), "vllm_server": ("vllm",)}
"""Pytest marks of a case (an engine that needs an optional install)."""
