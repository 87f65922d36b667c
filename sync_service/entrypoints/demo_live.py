"""``weightsync demo --trainer fsdp2|ddp|ep``: a live training loop synced to the engines, verified.

Two training ranks (``ExampleTrainingRank`` as threaded Ray actors, gloo) build the cached demo
Qwen3-MoE, add PEFT LoRA on attention + experts, wrap it (FSDP2 ``fully_shard`` per layer, DDP, or
expert parallel) and train with AdamW on an LM loss over a fixed batch (the reported loss falls); after
every step ``push(step)``. Each version is
verified on every engine against an independent oracle: PEFT ``merge_and_unload`` in float64 (cast
once) of the adapter gathered from the ranks, with the verdict of ``weightsync sync`` (``verify.verdict``:
weights within fp32 rounding, greedy generations equal up to near-ties). ``--json``: the demo's shape plus
``"trainer": {"kind", "world", "loss": [...]}``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sync_service.entrypoints.sync_cli import (RunConfig, VersionRow, first_version, print_row, run_and_report, start_ray,
                                               sync_config)
from sync_service.entrypoints.progress import Steps
from sync_service.entrypoints.workdir import run_dir, ray_temp

__all__ = ["run_trainer_demo", "save_adapter"]

WORLD = 2
PROMPTS = ([5, 9, 14, 3], [7, 7, 21])
NEW_TOKENS = 8


def save_adapter(adapter: dict, peft_config, out_dir: Path) -> Path:
    """Write ``adapter`` (PEFT keys → torch tensors, e.g. gathered from the ranks) with ``peft_config``
    as a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``); returns it."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    peft_config.save_pretrained(str(out_dir))
    save_file({k: v.contiguous() for k, v in adapter.items()}, str(out_dir / "adapter_model.safetensors"))
    return out_dir


def _verify(engines, names, base: Path, adapter_dir: Path, timeout_s: float) -> list[dict]:
    """Every engine against PEFT's float64 merge of the ranks' adapter (``verify.verdict``, the verdict of
    ``weightsync sync``); ``weights_equal_peft_merge`` repeats ``weights_equal_reference``."""
    import ray

    from sync_service.verify.hf import reference
    from sync_service.verify.verdict import verdict

    ref = reference(base, adapter_dir, tp=1, prompts=PROMPTS, max_new_tokens=NEW_TOKENS)
    out = []
    for name, engine in zip(names, engines):
        state = ray.get(engine.state.remote(), timeout=timeout_s)
        gens = [ray.get(engine.generate.remote(list(p), NEW_TOKENS), timeout=timeout_s) for p in PROMPTS]
        row = verdict(ref, state, [g[0] for g in gens], gens[0][1])
        out.append({"engine": name, **row, "weights_equal_peft_merge": row["weights_equal_reference"]})
    return out


def _run(cfg: RunConfig, kind: str, losses: list, launcher) -> list[VersionRow]:
    import ray

    from sync_service.api import WeightSync
    from sync_service.live.example import ExampleTrainingRank, lora_config

    tmp = run_dir("live")
    rows: list[VersionRow] = []
    steps = Steps(4 + 2 * cfg.versions)
    try:
        steps.step("starting a local Ray (2 CPUs)")
        start_ray(ray_temp(tmp))
        steps.step(f"starting {WORLD} training ranks ({kind}), attaching weightsync")
        actor = ray.remote(num_cpus=0, max_concurrency=2)(ExampleTrainingRank)
        ranks = [actor.remote(k, WORLD) for k in range(WORLD)]
        host, port = ray.get(ranks[0].rendezvous.remote(), timeout=cfg.timeout_s)
        handles = ray.get([r.setup.remote(host, port, str(cfg.base), kind) for r in ranks], timeout=cfg.timeout_s)
        steps.step(f"starting {cfg.engines} engine(s)")
        engines = launcher.start_engines(cfg.base, cfg.engines, timeout_s=cfg.timeout_s)
        names = ray.get([e.engine_name.remote() for e in engines], timeout=cfg.timeout_s)
        steps.step("planning, validating the plan against every engine")
        sync = WeightSync(trainers=handles, engines=engines, config=sync_config(cfg))
        first = first_version(sync.engine_versions(), given=cfg.first_version, reset=cfg.reset_versions)
        for v in range(first, first + cfg.versions):
            steps.step(f"version {v}: AdamW step on {WORLD} ranks, push")
            losses.append(sum(ray.get([r.train_step.remote() for r in ranks], timeout=cfg.timeout_s)) / WORLD)
            m = sync.push(v)
            steps.step(f"version {v}: verify against PEFT's float64 merge")
            adapter = _adapter(ray.get([r.adapter_state.remote() for r in ranks], timeout=cfg.timeout_s)[0])
            adapter_dir = save_adapter(adapter, lora_config(), tmp / f"v{v}" / "adapter")
            rows.append(VersionRow.of(v, m, _verify(engines, names, cfg.base, adapter_dir, cfg.timeout_s)))
            print_row(rows[-1])
        sync.close()
    finally:
        steps.close()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _adapter(state: dict) -> dict:
    import torch

    return {k: torch.from_numpy(v.copy()) for k, v in state.items()}


def run_trainer_demo(cfg: RunConfig, extra: dict, *, kind: str, launcher) -> int:
    """Run the live-trainer demo (``kind``: ``"fsdp2"``, ``"ddp"`` or ``"ep"``; engines from ``launcher``,
    a ``protocols.endpoints.Launcher``); 0 iff every version verified."""
    losses: list[float] = []
    trainer = {"kind": kind, "world": WORLD, "loss": losses}
    return run_and_report(cfg, lambda c: _run(c, kind, losses, launcher), extra, engines=f"{cfg.engines} engine(s)",
                          json_extra={"trainer": trainer})
