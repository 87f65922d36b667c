"""``weightsync demo --trainer fsdp2|ddp|ep|hsdp|fsdp2-tp|fsdp2-ep|tp-ep``: a live training loop synced to the engines,
verified.

Training ranks (``ExampleTrainingRank`` as threaded Ray actors, gloo; ``TRAINERS``: 2 for fsdp2 / ddp / ep,
4 for the 2-D meshes) build the cached demo Qwen3-MoE, add PEFT LoRA on attention + experts, wrap it (FSDP2
``fully_shard`` per layer, DDP, expert parallel, HSDP on a (replicate 2, shard 2) mesh, FSDP2 over TP on a
(shard 2, tp 2) mesh: ``live/example_mesh.py``; FSDP2 × EP on a (dp 2, ep 2) mesh or TP × EP on an
(ep 2, tp 2) mesh, the experts DTensors on the ep axis: ``live/example_ep.py``) and train with AdamW on
an LM loss over a fixed batch (the reported loss falls); after every step ``push(step)``. Each version is
verified on every engine against an independent oracle: PEFT ``merge_and_unload`` in float64 (cast
once) of the adapter gathered from the ranks, with the verdict of ``weightsync sync`` (``verify.verdict``:
weights within fp32 rounding, greedy generations equal up to near-ties). ``--json``: the demo's shape plus
``"trainer": {"kind", "world", "mesh": {axis: size}, "loss": [...]}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from sync_service.entrypoints.sync_cli import (RunConfig, VersionRow, engines_and_sync, local_session, print_row,
                                               run_and_report)
from sync_service.entrypoints.progress import Steps
from sync_service.entrypoints.workdir import run_dir

__all__ = ["TRAINERS", "TrainerKind", "run_trainer_demo", "save_adapter"]


@dataclass(frozen=True)
class TrainerKind:
    """One ``--trainer`` choice: the example rank's ``mode``, its ``mesh`` (axis name → size; the product is the
    number of ranks), the ``setup`` keywords that build it and whether its base needs TP-splittable attention."""

    mode: str
    mesh: dict[str, int]
    setup: dict = field(default_factory=dict)
    tp_base: bool = False

    @property
    def world(self) -> int:
        return math.prod(self.mesh.values())


TRAINERS = {
    "fsdp2": TrainerKind("fsdp2", {"shard": 2}),
    "ddp": TrainerKind("ddp", {"dp": 2}),
    "ep": TrainerKind("ep", {"ep": 2}),
    "hsdp": TrainerKind("fsdp2", {"replicate": 2, "shard": 2}, {"mesh_shape": (2, 2)}),
    "fsdp2-tp": TrainerKind("fsdp2", {"shard": 2, "tp": 2}, {"mesh_shape": (2, 2), "tp": True}, tp_base=True),
    "fsdp2-ep": TrainerKind("ep", {"dp": 2, "ep": 2}, {"mesh_shape": (2, 2)}),
    "tp-ep": TrainerKind("ep", {"ep": 2, "tp": 2}, {"mesh_shape": (2, 2), "tp": True}, tp_base=True),
}
"""``weightsync demo --trainer`` choices."""
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
    trainer = TRAINERS[kind]
    import ray

    from sync_service.live.example import ExampleTrainingRank, lora_config

    tmp = run_dir("live")
    rows: list[VersionRow] = []
    steps = Steps(4 + 2 * cfg.versions)
    with local_session(tmp, steps):
        steps.step(f"starting {trainer.world} training ranks ({kind}: {trainer.mesh}), attaching weightsync")
        actor = ray.remote(num_cpus=0, max_concurrency=2)(ExampleTrainingRank)
        ranks = [actor.remote(k, trainer.world) for k in range(trainer.world)]
        host, port = ray.get(ranks[0].rendezvous.remote(), timeout=cfg.timeout_s)
        handles = ray.get([r.setup.remote(host, port, str(cfg.base), trainer.mode, **trainer.setup) for r in ranks],
                          timeout=cfg.timeout_s)
        engines, names, sync, first = engines_and_sync(cfg, launcher, handles, steps)
        for v in range(first, first + cfg.versions):
            steps.step(f"version {v}: AdamW step on {trainer.world} ranks, push")
            losses.append(sum(ray.get([r.train_step.remote() for r in ranks], timeout=cfg.timeout_s)) / trainer.world)
            m = sync.push(v)
            steps.step(f"version {v}: loss {losses[-1]:.4f} (mean over the ranks, before the step); verify against "
                       "PEFT's float64 merge")
            adapter = _adapter(ray.get([r.adapter_state.remote() for r in ranks], timeout=cfg.timeout_s)[0])
            adapter_dir = save_adapter(adapter, lora_config(), tmp / f"v{v}" / "adapter")
            rows.append(VersionRow.of(v, m, _verify(engines, names, cfg.base, adapter_dir, cfg.timeout_s)))
            print_row(rows[-1])
        sync.close()
    return rows


def _adapter(state: dict) -> dict:
    import torch

    return {k: torch.from_numpy(v.copy()) for k, v in state.items()}


def run_trainer_demo(cfg: RunConfig, extra: dict, *, kind: str, launcher) -> int:
    """Run the live-trainer demo (``kind``: a key of ``TRAINERS``; engines from ``launcher``, a
    ``protocols.endpoints.Launcher``; ``cfg.base``: the base of that kind, ``ensure_tp_base`` for ``tp_base``
    ones); 0 iff every version verified."""
    losses: list[float] = []
    trainer = {"kind": kind, "world": TRAINERS[kind].world, "mesh": dict(TRAINERS[kind].mesh), "loss": losses}
    rc = run_and_report(cfg, lambda c: _run(c, kind, losses, launcher), extra, engines=f"{cfg.engines} engine(s)",
                        json_extra={"trainer": trainer})
    if losses:
        print(f"trainer {kind} ({trainer['world']} ranks, mesh {trainer['mesh']}): loss per version "
              + " -> ".join(f"{loss:.4f}" for loss in losses))
    return rc
