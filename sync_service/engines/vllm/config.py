"""Typed settings of the vLLM rollout engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocols.interfaces import PauseMode

__all__ = ["VLLMEngineConfig", "VLLM_ENV"]

VLLM_ENV: dict[str, str] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core and worker in the engine's own process: updates are plain calls
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # no core pinning (other processes share the cores)
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; VLLMEngineConfig.kv_cache_bytes sizes the cache of our own engines
}
"""The process environment of every vLLM engine weightsync starts (a rollout engine actor, the fresh-engine
oracle's subprocess): set by the entry points that start those processes (``local.start_engines``,
``vllm_oracle.fresh_tokens``), never inside an engine factory."""


@dataclass(kw_only=True, slots=True)
class VLLMEngineConfig:
    """How ``VLLMEngine`` starts vLLM and applies weight versions.

    Process layout is vLLM's: with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set by the entry point) the
    engine core and its single worker run in the calling process and updates are plain calls;
    otherwise updates travel over vLLM's RPC (one message per applied box).
    """

    model_dir: str
    """The checkpoint directory the engine starts from (safetensors + config.json + tokenizer)."""
    dtype: str = "auto"
    """Parameter dtype (``"float32"``, ``"bfloat16"``, ``"auto"`` = the checkpoint's); the table's dtype."""
    max_model_len: int = 128
    """Longest prompt + generation, tokens."""
    kv_cache_bytes: int = 256 << 20
    """KV cache size, bytes (vLLM ``kv_cache_memory_bytes``; on CPU this replaces ``VLLM_CPU_KVCACHE_SPACE``)."""
    block_size: int | None = None
    """KV block size, tokens (CPU attention needs a multiple of 32); ``None`` keeps vLLM's default (128 on CPU).
    Prefix caching reuses whole blocks only."""
    enable_prefix_caching: bool = True
    """vLLM prefix caching; its cache is reset at every commit."""
    enforce_eager: bool = True
    """No torch.compile / graph capture (fast start; the CPU build needs it with small models)."""
    seed: int = 0
    """vLLM's sampling seed."""
    max_logprobs: int = -1
    """Most logprobs a request may ask for (vLLM ``max_logprobs``); -1: the whole vocabulary, so the verification
    can score teacher-forced sequences over it (``VLLMEngine.token_logprobs``). Costs nothing unless asked for."""
    pause_mode: PauseMode = PauseMode.KEEP
    """``KEEP``: generation goes on during ``apply`` (staged in the worker); only finish → commit waits for
    running generations and holds new ones. ``WAIT``: generation is held from ``begin_update`` to commit.
    ``ABORT`` is not offered by the synchronous ``LLM`` API (``ValueError``)."""
    pause_timeout_s: float = 120.0
    """Longest wait for running generations to finish, or for an update to commit, seconds."""
    rpc_timeout_s: float = 300.0
    """Longest ``collective_rpc`` (table discovery, finish with reload), seconds."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Further ``vllm.LLM`` keyword arguments (e.g. ``tensor_parallel_size``)."""

    def __post_init__(self) -> None:
        self.pause_mode = PauseMode(self.pause_mode)
        if self.pause_mode is PauseMode.ABORT:
            raise ValueError("pause_mode=ABORT needs request-level abort, which vLLM's synchronous LLM does not offer; use KEEP or WAIT")
