"""``weightsync demo --engine vllm``: the demo's sync through one vLLM rollout engine.

Same run and ``--json`` shape as the default demo (``sync_service.entrypoints.sync_cli``), with one engine kind
changed: 2 trainer shards (EP=2 by default) → one ``RolloutEngine(engine="vllm")`` (vLLM in the
actor's process, ``FusedVLLMEngine``). Verification per version (``verify.verdict.token_verdict``): the engine's greedy tokens equal, up to
near-ties (``verify.tokens``; none accepted with ``--accumulate-dtype float64``), those of a fresh vLLM
started on PEFT's own ``merge_and_unload`` of that version (float64, cast
once, saved with ``save_pretrained``: ``verify.peft_oracle``; ``verify.vllm_oracle``, run
in a subprocess before the engine under test starts, so one vLLM engine runs at a time). Weights
are not read back from vLLM (its post-load layout is not the checkpoint's): the weight fields of
the JSON rows are ``null``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sync_service.entrypoints.progress import Steps
from sync_service.verify.hf import MAX_NEW_TOKENS, PROMPTS
from sync_service.entrypoints.sync_cli import (RunConfig, VersionRow, announce_metrics, print_row,
                                   run_and_report)
from sync_service.entrypoints.workdir import run_dir, ray_temp

__all__ = ["execute_vllm", "peft_versions"]


def peft_versions(base: Path, adapter: Path, versions: int, work: Path) -> dict[int, Path]:
    """PEFT's ``merge_and_unload`` of each version's adapter (float64, cast once; ``verify.peft_oracle``)
    saved as a checkpoint, factors stepped as the trainers do: the independent oracle's checkpoints."""
    from sync_service.entrypoints.local import AdapterReplay
    from sync_service.verify.peft_oracle import save_peft_merged

    replay, out = AdapterReplay(adapter), {}
    for v in range(versions):
        if v:
            replay.step(v)
        out[v] = save_peft_merged(base, replay.save(work / f"v{v}" / "adapter"), work / f"v{v}" / "peft_merged")
    return out


def run_vllm(cfg: RunConfig, launcher) -> list[VersionRow]:
    """Oracle first, then Ray + trainers + one vLLM engine (``launcher``: ``protocols.endpoints.Launcher``);
    push and verify every version."""
    import ray

    from sync_service.api import WeightSync
    from sync_service.engines.vllm.fused import checkpoint_dtype
    from sync_service.entrypoints.sync_cli import first_version, start_ray, sync_config
    from sync_service.verify.verdict import token_verdict
    from sync_service.verify.vllm_oracle import fresh_decodes

    if cfg.adapter is None:
        raise ValueError("the vLLM demo needs an adapter (versions differ by their factors)")
    tmp = run_dir("vllm")
    rows: list[VersionRow] = []
    steps = Steps(3 + cfg.versions)
    try:
        steps.step(f"merging {cfg.versions} version(s) with PEFT and decoding them on fresh vLLM engines (the oracle)")
        merged = peft_versions(cfg.base, cfg.adapter, cfg.versions, cfg.work_dir or tmp / "work")
        expected = fresh_decodes({str(k): d for k, d in merged.items()}, PROMPTS, MAX_NEW_TOKENS,
                                 timeout_s=max(600.0, cfg.timeout_s))
        steps.step("starting a local Ray, the trainer shards and the vLLM engine")
        start_ray(ray_temp(tmp))
        trainers = launcher.start_trainers(cfg.base, cfg.adapter, ep=cfg.ep, tp=cfg.tp, timeout_s=cfg.timeout_s)
        engines = launcher.start_engines(cfg.base, 1, engine="vllm", timeout_s=max(300.0, cfg.timeout_s),
                                         prefix="vllm")
        steps.step("planning, validating the plan against the engine")
        sync = WeightSync(trainers=trainers, engines=engines, config=sync_config(cfg))
        announce_metrics(sync)
        first = first_version(sync.engine_versions(), given=cfg.first_version, reset=cfg.reset_versions)
        for k in range(cfg.versions):  # training step k (the oracle's version k) is pushed as version first + k
            v = first + k
            steps.step(f"version {v}: training step, push, generate")
            if k:
                ray.get([t.train_step.remote(k) for t in trainers], timeout=cfg.timeout_s)
            m = sync.push(v)
            gens = [ray.get(engines[0].generate.remote(list(p), MAX_NEW_TOKENS), timeout=cfg.timeout_s) for p in PROMPTS]
            version = gens[0][1] if all(g[1] == gens[0][1] for g in gens) else None
            rows.append(VersionRow.of(v, m, [{"engine": "vllm0", **token_verdict(
                expected[str(k)], [g[0] for g in gens], version, expected_version=v,
                dtype=checkpoint_dtype(cfg.base), accumulate_dtype=cfg.accumulate_dtype)}]))
            print_row(rows[-1])
        sync.close()
    finally:
        steps.close()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def execute_vllm(cfg: RunConfig, extra: dict, launcher) -> int:
    """Run, print the table, write ``cfg.json_path`` like ``sync_cli.execute``; 0 iff every version verified."""
    return run_and_report(cfg, lambda c: run_vllm(c, launcher), extra, engines="1 vLLM engine", json_extra={"engine": "vllm"})
