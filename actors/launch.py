"""Start the actors of a local or placed run: trainer ranks (``TrainerShard``) and rollout engines
(``RolloutEngine``). ``RayLauncher`` bundles both for code in ``sync_service`` that starts actors
(the CLI's runs, the deployment, the benchmark, the RL loop): it receives one as an argument and
never imports ``actors`` itself (``protocols.endpoints.Launcher``).

    from actors.launch import start_engines, start_trainers
    trainers = start_trainers("base/", "lora/", ep=2)   # rank r holds experts [r·E/2, (r+1)·E/2)
    engines = start_engines("base/", 2)                 # transformers on CPU
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import ray

from actors.rollout import RolloutEngine
from actors.trainer import TrainerShard

__all__ = ["RayLauncher", "start_engines", "start_server_engines", "start_trainers"]


def start_trainers(base_dir: str | Path, adapter_dir: str | Path | None, *, ep: int = 1, tp: int = 1,
                   timeout_s: float = 120.0, actor_options: Mapping | Sequence[Mapping] | None = None,
                   reuse: list | None = None, actor_class=None) -> list:
    """Start ``ep·tp`` trainer actors (or reload the ``reuse`` actors, same count), join their gloo
    group, load their shards. Blocks up to ``timeout_s`` (+ 30 s for the load).

    ``actor_options``: Ray ``.options(...)`` for every shard, or a sequence with one mapping per rank
    (e.g. its placement-group bundle). ``actor_class``: a ``TrainerShardCore`` subclass as a Ray actor
    class (default ``TrainerShard``; e.g. ``actors.policy_trainer.PolicyTrainer``).

    Raises:
        ValueError: ``reuse`` or ``actor_options`` of the wrong length.
    """
    world = ep * tp
    adapter = None if adapter_dir is None else str(adapter_dir)
    if reuse is not None and len(reuse) != world:
        raise ValueError(f"reuse: {len(reuse)} actors for ep·tp = {world} ranks")
    opts = _per_actor(actor_options, world)
    cls = actor_class or TrainerShard
    shards = reuse or [cls.options(**opts[r]).remote(base_dir=str(base_dir), adapter_dir=adapter, rank=r, ep=ep, tp=tp,
                                                     gather_timeout_s=timeout_s) for r in range(world)]
    peers = ray.get([s.node_address.remote() for s in shards[1:]], timeout=timeout_s)
    host, port = ray.get(shards[0].rendezvous_address.remote(peers), timeout=timeout_s)  # reachable by every rank
    settings = [dict(base_dir=str(base_dir), adapter_dir=adapter, rank=r, ep=ep, tp=tp) for r in range(world)]
    ray.get([s.setup.remote(host, port, timeout_s, **(settings[r] if reuse else {})) for r, s in enumerate(shards)],
            timeout=timeout_s + 30)
    return shards


def start_engines(model_dir: str | Path, count: int, *, engine: str = "hf", timeout_s: float = 120.0,
                  actor_options: Mapping | Sequence[Mapping] | None = None, prefix: str = "engine") -> list:
    """Start ``count`` RolloutEngine actors (``engine``: "hf", "memory" or "vllm") loaded from
    ``model_dir``, named ``prefix0``, ``prefix1``, ... Blocks until they answer (``timeout_s``).
    ``actor_options``: Ray ``.options(...)`` for every engine, or one mapping per engine."""
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
        raise ValueError(f"actor_options: {len(actor_options)} entries for {count} actors; "
                         f"give one per actor or one mapping")
    return [dict(o) for o in actor_options]


class RayLauncher:
    """``protocols.endpoints.Launcher`` over this module: Ray actors on the connected cluster."""

    def start_trainers(self, base_dir, adapter_dir, **kw) -> list:
        return start_trainers(base_dir, adapter_dir, **kw)

    def start_engines(self, model_dir, count: int, **kw) -> list:
        return start_engines(model_dir, count, **kw)

    def start_server_engines(self, urls, **kw) -> list:
        return start_server_engines(urls, **kw)

    def start_policy_trainers(self, base_dir, adapter_dir, **kw) -> list:
        """``start_trainers`` of ``PolicyTrainer`` actors (the toy GRPO step, ``sync_service/entrypoints/rl``)."""
        from actors.policy_trainer import PolicyTrainer

        return start_trainers(base_dir, adapter_dir, actor_class=PolicyTrainer, **kw)
