"""Local runs of the whole product (demo, ``weightsync sync``, end-to-end tests): start trainer
shards and rollout engines as Ray actors, replay training steps on the full adapter, and compute the
reference merge a version must equal.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from protocols.params import full_box

__all__ = ["start_trainers", "start_engines", "start_server_engines", "AdapterReplay", "reference_state", "save_adapter"]


def start_trainers(base_dir: str | Path, adapter_dir: str | Path | None, *, ep: int = 1, tp: int = 1,
                   timeout_s: float = 120.0, actor_options: Mapping | Sequence[Mapping] | None = None,
                   reuse: list | None = None) -> list:
    """Start ``ep·tp`` TrainerShard actors (or reload the ``reuse`` actors, same count), join their
    gloo group, load their shards. Blocks. ``actor_options``: Ray ``.options(...)`` for every shard,
    or a sequence with one mapping per rank (e.g. its placement-group bundle)."""
    import ray

    from actors.trainer import TrainerShard

    world = ep * tp
    adapter = None if adapter_dir is None else str(adapter_dir)
    if reuse is not None and len(reuse) != world:
        raise ValueError(f"reuse: {len(reuse)} actors for ep·tp = {world} ranks")
    opts = _per_actor(actor_options, world)
    shards = reuse or [TrainerShard.options(**opts[r]).remote(base_dir=str(base_dir), adapter_dir=adapter, rank=r, ep=ep,
                                                           tp=tp, gather_timeout_s=timeout_s) for r in range(world)]
    host, port = ray.get(shards[0].rendezvous_address.remote(), timeout=timeout_s)
    settings = [dict(base_dir=str(base_dir), adapter_dir=adapter, rank=r, ep=ep, tp=tp) for r in range(world)]
    ray.get([s.setup.remote(host, port, timeout_s, **(settings[r] if reuse else {})) for r, s in enumerate(shards)],
            timeout=timeout_s + 30)
    return shards


def start_engines(model_dir: str | Path, count: int, *, engine: str = "hf", timeout_s: float = 120.0,
                  actor_options: Mapping | Sequence[Mapping] | None = None, prefix: str = "engine") -> list:
    """Start ``count`` RolloutEngine actors loaded from ``model_dir``. Blocks until they answer.
    ``actor_options``: Ray ``.options(...)`` for every engine, or one mapping per engine."""
    import ray

    from actors.rollout import RolloutEngine

    opts = [_with_engine_env(o, engine) for o in _per_actor(actor_options, count)]
    engines = [RolloutEngine.options(**opts[i]).remote(model_dir=str(model_dir), engine=engine, name=f"{prefix}{i}")
               for i in range(count)]
    ray.get([e.weight_version.remote() for e in engines], timeout=timeout_s)
    return engines


def start_server_engines(urls: Sequence[str], *, api_key: str | None = None, prefix: str = "server",
                         timeout_s: float = 30.0) -> list:
    """One ``actors.vllm_server.VLLMServer`` engine per running vLLM server URL, named ``prefix0``, ...
    Blocks until each answered; raises the server's setup error (e.g. the missing backend flag) as is."""
    from actors.vllm_server import VLLMServer

    return [VLLMServer(url, api_key=api_key, name=f"{prefix}{i}", timeout_s=timeout_s) for i, url in enumerate(urls)]


def _with_engine_env(options: dict, engine: str) -> dict:
    """``options`` with the engine kind's process environment (``engines.vllm.config.VLLM_ENV`` for vLLM)
    under its ``runtime_env`` env_vars; variables the caller sets win."""
    if engine != "vllm":
        return options
    from sync_service.engines.vllm.config import VLLM_ENV

    runtime_env = dict(options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**VLLM_ENV, **runtime_env.get("env_vars", {})}
    return {**options, "runtime_env": runtime_env}


def _per_actor(actor_options: Mapping | Sequence[Mapping] | None, count: int) -> list[dict]:
    """One options dict per actor: a mapping is shared, a sequence must have ``count`` entries."""
    if actor_options is None or isinstance(actor_options, Mapping):
        return [dict(actor_options or {}) for _ in range(count)]
    if len(actor_options) != count:
        raise ValueError(f"actor_options: {len(actor_options)} entries for {count} actors; give one per actor or one mapping")
    return [dict(o) for o in actor_options]


class AdapterReplay:
    """The full PEFT state dict of an adapter after replaying ``train_step``s (the reference side)."""

    def __init__(self, adapter_dir: str | Path) -> None:
        from peft import PeftConfig
        from safetensors.torch import load_file

        self.dir = Path(adapter_dir)
        self.peft_config = PeftConfig.from_pretrained(str(self.dir))
        self.state: dict[str, torch.Tensor] = load_file(str(self.dir / "adapter_model.safetensors"))

    def step(self, step: int, scale: float = 0.02) -> None:
        """Apply the same update as ``TrainerShard.train_step(step, scale)`` on every rank."""
        from sync_service.sharding.training import step_delta

        self.state = {k: v + step_delta(k, tuple(v.shape), step, scale).to(v.dtype) for k, v in self.state.items()}

    def save(self, out_dir: str | Path) -> Path:
        """Write this state as a PEFT adapter directory (safetensors + adapter_config.json)."""
        return save_adapter(self.dir, self.state, out_dir)


def save_adapter(template_dir: str | Path, state: Mapping[str, torch.Tensor], out_dir: str | Path) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text((Path(template_dir) / "adapter_config.json").read_text())
    return out


def reference_state(base_dir: str | Path, peft_config, adapter_state: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Every merged tensor (hf-fused naming) of the full base + ``adapter_state``: the values every
    engine must hold after a sync of that version (``MergedSource`` over the unsharded base)."""
    from sync_service.merge.adapter import adapter_from_state_dict
    from sync_service.merge.base import SafetensorsBase
    from sync_service.merge.source import MergeConfig, MergedSource

    base = SafetensorsBase(base_dir)
    adapter = None if adapter_state is None else adapter_from_state_dict(
        peft_config, dict(adapter_state), base.layout, base.metas(), tied_aliases=base.tied_aliases)
    source = MergedSource(base, adapter, config=MergeConfig())
    out = {}
    for m in source.param_metas():
        buf = torch.empty(m.shape, dtype=source.out_dtype(m.name))
        source.fill(m.name, full_box(m.shape), buf)
        out[m.name] = buf
    return out
