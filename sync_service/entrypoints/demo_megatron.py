"""``weightsync demo --trainer megatron|megatron-pp``: a Megatron-Core LoRA training loop synced to the engines, each
version verified against Megatron's own forward.

Four Megatron-Core ranks (``entrypoints/megatron_rank.py``: threaded Ray actors in one gloo group, on CPU with the
CPU launcher's patches, ``megatron_cpu.py``) build the demo's TP base (``synthetic.demo_files.ensure_tp_base``: a
Qwen3-MoE, E=8, H=64, 2 layers, 2 key/value heads; converted by Megatron-Bridge, Bridge LoRA on ``linear_qkv`` /
``linear_proj`` / ``linear_fc1`` / ``linear_fc2``) at the kind's mesh (``MEGATRON_TRAINERS``), attach weightsync in
place (``sync_service.megatron.attach.attach_megatron``) and train with AdamW on the adapters over an LM loss through
Megatron's own forward and backward (``entrypoints/megatron_train.py``: Megatron's pipeline schedule, gradients
reduced over the data-parallel and expert-data-parallel groups); after every step ``push(v)``.

The oracle (``verify.oracle`` ``"megatron-forward"``): Megatron's own forward of the unmerged LoRA model at the
trainer's parallelism (``megatron_logits``: TP / EP / expert-TP inside, the pipeline stages by send / recv) on
``ORACLE_TOKENS``, against each engine's teacher-forced next-token log-probabilities of the same sequences after
the push: fp32, ``max |log p_engine - log_softmax(logits_megatron)| <= LOGPROB_BOUND`` and the greedy (argmax) token
at every position equal, and the engine reports version v. ``--json``: the demo's shape plus ``"trainer": {"kind":
"megatron", "world": 4, "mesh": {...}, "loss": [...]}`` (the loss before each step, mean over the data-parallel
ranks) and ``"verify": {"oracle": "megatron-forward", "logprob_bound": ..., "tokens": ..., "oracle_moved": [...]}``
(``oracle_moved``: max |Δ log p| of Megatron's forward from one version to the next, what a stale engine would be
off by).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

from sync_service.entrypoints.progress import Steps
from sync_service.entrypoints.sync_cli import (RunConfig, VersionRow, engines_and_sync, local_session, print_row,
                                               run_and_report)
from sync_service.entrypoints.workdir import run_dir

__all__ = ["LOGPROB_BOUND", "MEGATRON_TRAINERS", "MegatronKind", "ORACLE_TOKENS", "megatron_missing",
           "run_megatron_demo"]


@dataclass(frozen=True)
class MegatronKind:
    """One Megatron ``--trainer`` choice: Megatron's sizes (dense layers tp × pp × dp = the world; experts
    ep × etp × expert-dp = world / pp)."""

    tp: int
    ep: int
    etp: int
    pp: int
    dp: int

    @property
    def mesh(self) -> dict[str, int]:
        return {"tp": self.tp, "ep": self.ep, "etp": self.etp, "pp": self.pp, "dp": self.dp}

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


MEGATRON_TRAINERS = {
    "megatron": MegatronKind(tp=2, ep=2, etp=2, pp=1, dp=2),
    "megatron-pp": MegatronKind(tp=2, ep=2, etp=1, pp=2, dp=1),
}
"""``weightsync demo --trainer`` choices on Megatron-Core (4 ranks each)."""
LOGPROB_BOUND = 1e-5
"""fp32 next-token log-probabilities, Megatron's forward vs the engine's: two implementations of one function
(measured 1.6e-6 - 1.9e-6 on the demo model, 2026-12-05)."""
ORACLE_TOKENS = ([3, 17, 42, 5, 9, 60, 1, 33, 12, 7, 50, 21], [100, 2, 77, 77, 8, 121, 64, 30, 5, 96, 11, 40])
"""The oracle's sequences (token ids of the demo vocabulary, 128)."""
LEARNING_RATE = 3e-2


def megatron_missing() -> str | None:
    """The one-line reason the Megatron demo cannot run here (the stack not installed), else ``None``."""
    missing = [m for m in ("megatron.core", "megatron.bridge") if importlib.util.find_spec(m.split(".")[0]) is None
               or importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (f"--trainer megatron needs Megatron-Core and Megatron-Bridge ({', '.join(missing)} not installed): run "
            "bash scripts/setup-megatron.sh (a step of scripts/setup.sh unless WEIGHTSYNC_MEGATRON=0)")


def _make_trainer(rank, lr: float) -> None:
    """Inside a ``MegatronRank`` actor: its ``AdapterTrainer`` (collective: every rank at once)."""
    from sync_service.entrypoints.megatron_train import AdapterTrainer

    rank.trainer = AdapterTrainer(rank.model, lr=lr)


def _train_step(rank) -> float:
    """Inside a ``MegatronRank`` actor: one AdamW step; the loss before it (collective)."""
    return rank.trainer.step()


def _megatron_logprobs(ranks, timeout_s: float):
    """Megatron's forward of ``ORACLE_TOKENS`` on every rank (the last stage's answer) as float64 next-token
    log-probabilities [b, s-1, V]."""
    import ray
    import torch

    out = [x for x in ray.get([r.logits.remote([list(t) for t in ORACLE_TOKENS]) for r in ranks], timeout=timeout_s)
           if x is not None]
    logits = torch.from_numpy(out[0].copy()).double()
    return torch.log_softmax(logits, -1)[:, :-1]


def _verify(ranks, engines, names, version: int, timeout_s: float, oracles: list) -> list[dict]:
    """Each engine's teacher-forced log-probabilities and greedy tokens against Megatron's forward (the oracle;
    appended to ``oracles``)."""
    import ray
    import torch

    want = _megatron_logprobs(ranks, timeout_s)
    oracles.append(want)
    rows = []
    for name, engine in zip(names, engines):
        lps, served = ray.get(engine.token_logprobs.remote([list(t) for t in ORACLE_TOKENS]), timeout=timeout_s)
        got = torch.stack([torch.from_numpy(lp.copy()).double() for lp in lps])
        if got.shape != want.shape:
            raise ValueError(f"{name}: log-probabilities {tuple(got.shape)}, Megatron's {tuple(want.shape)}")
        diff = (got - want).abs().max().item()
        tokens_equal = torch.equal(got.argmax(-1), want.argmax(-1))
        ok = diff <= LOGPROB_BOUND and tokens_equal and served == version
        rows.append({"engine": name, "verified": bool(ok), "oracle": "megatron-forward",
                     "logprob_max_abs_diff": diff, "logprob_bound": LOGPROB_BOUND, "greedy_tokens_equal": tokens_equal,
                     "weight_version": served, "weights_equal_merge_output": None})
    return rows


def _run(cfg: RunConfig, kind: str, losses: list, moved: list, launcher) -> list[VersionRow]:
    import ray

    from sync_service.entrypoints.megatron_rank import start_megatron_ranks

    trainer = MEGATRON_TRAINERS[kind]
    tmp = run_dir("megatron")
    rows: list[VersionRow] = []
    oracles: list = []
    steps = Steps(5 + 2 * cfg.versions)
    with local_session(tmp, steps):
        steps.step(f"starting {trainer.world} Megatron-Core ranks ({kind}: {trainer.mesh}), converting the base with "
                   "Megatron-Bridge, Bridge LoRA")
        ranks, mesh = start_megatron_ranks(str(cfg.base), world=trainer.world, tp=trainer.tp, ep=trainer.ep,
                                           etp=trainer.etp, pp=trainer.pp, seed=0, timeout_s=cfg.timeout_s)
        if mesh != trainer.mesh:
            raise RuntimeError(f"Megatron's parallel state is {mesh}, the demo asked for {trainer.mesh}")
        ray.get([r.__ray_call__.remote(_make_trainer, LEARNING_RATE) for r in ranks], timeout=cfg.timeout_s)
        steps.step("attaching weightsync to every rank (attach_megatron)")
        handles = ray.get([r.attach.remote() for r in ranks], timeout=cfg.timeout_s)
        engines, names, sync, first = engines_and_sync(cfg, launcher, handles, steps)
        for v in range(first, first + cfg.versions):
            steps.step(f"version {v}: AdamW step on {trainer.world} Megatron ranks, push")
            loss = ray.get([r.__ray_call__.remote(_train_step) for r in ranks], timeout=cfg.timeout_s)[0]
            losses.append(loss)
            m = sync.push(v)
            steps.step(f"version {v}: loss {loss:.4f} (before the step); verify against Megatron's own forward")
            rows.append(VersionRow.of(v, m, _verify(ranks, engines, names, v, cfg.timeout_s, oracles)))
            if len(oracles) > 1:
                moved.append((oracles[-1] - oracles[-2]).abs().max().item())
            print_row(rows[-1])
        sync.close()
    return rows


def run_megatron_demo(cfg: RunConfig, extra: dict, *, kind: str, launcher) -> int:
    """Run the Megatron demo (``kind``: a key of ``MEGATRON_TRAINERS``; ``cfg.base``: ``ensure_tp_base``'s
    checkpoint; engines from ``launcher``, a ``protocols.endpoints.Launcher``); 0 iff every version verified and
    the loss fell."""
    losses: list[float] = []
    moved: list[float] = []
    trainer = {"kind": "megatron", "world": MEGATRON_TRAINERS[kind].world, "mesh": MEGATRON_TRAINERS[kind].mesh,
               "loss": losses}
    verify = {"oracle": "megatron-forward", "logprob_bound": LOGPROB_BOUND, "tokens": [list(t) for t in ORACLE_TOKENS],
              "oracle_moved": moved}
    rc = run_and_report(cfg, lambda c: _run(c, kind, losses, moved, launcher), extra, engines=f"{cfg.engines} engine(s)",
                        json_extra={"trainer": trainer, "verify": verify})
    if losses:
        print(f"trainer {kind} (Megatron-Core, {trainer['world']} ranks, mesh {trainer['mesh']}): loss per version "
              + " -> ".join(f"{loss:.4f}" for loss in losses))
    if rc == 0 and len(losses) >= 2 and not (losses[-1] < losses[0] and all(map(math.isfinite, losses))):
        print("the loss did not fall")
        return 1
    return rc
