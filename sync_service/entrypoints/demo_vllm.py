"""``weightsync demo --engine vllm``: the demo's sync through one vLLM rollout engine.

Same run and ``--json`` shape as the default demo (``sync_service.entrypoints.sync_cli``), with one engine kind
changed: 2 trainer shards (EP=2 by default) → one ``RolloutEngine(engine="vllm")`` (vLLM in the
actor's process, ``FusedVLLMEngine``). Verification per version (``verify.verdict.token_verdict``): the engine's greedy tokens equal, up to
near-ties (``verify.tokens``; none accepted with ``--accumulate-dtype float64``), those of a fresh vLLM
started on PEFT's own ``merge_and_unload`` of that version (float64, cast
once, saved with ``save_pretrained``: ``verify.peft_oracle``; ``verify.vllm_oracle``, run
in a subprocess before the engine under test starts, so one vLLM engine runs at a time), and its weights,
read back in its worker (``engines.vllm.served``: vLLM's tensors after post-load processing, checkpoint copies
where it keeps one opaque), equal that fresh engine's read back (``verify.served``: bitwise with float64
accumulation, else within the merge's rounding). Each engine row carries ``policy_kl`` and each version
``policy_kl_floor`` (``verify.policy_kl``); ``--digests FILE`` writes the read back per version.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sync_service.entrypoints.progress import Steps
from sync_service.verify.hf import MAX_NEW_TOKENS, PROMPTS
from sync_service.entrypoints.sync_cli import (RunConfig, VersionRow, announce_metrics, print_row,
                                   run_and_report)
from sync_service.entrypoints.workdir import run_dir, ray_temp

__all__ = ["execute_vllm", "peft_versions", "read_back_verdict"]


def read_back_verdict(check: dict, engine, fresh_rows: list, cfg: RunConfig) -> dict:
    """``check`` (``verdict.token_verdict``) with the weight fields of the engine's read back against a fresh vLLM
    engine's on the oracle checkpoint (``verify.served.served_verdict``); verified only if both hold."""
    import ray

    from sync_service.verify.served import served_verdict

    served = ray.get(engine.served_weights.remote(None, True), timeout=cfg.timeout_s)
    weights = served_verdict(served, fresh_rows, accumulate_dtype=cfg.accumulate_dtype)
    return {**check, **weights, "verified": bool(check["verified"] and weights["weights_equal_reference"])}


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
    from sync_service.entrypoints.sync_cli import write_digests
    from sync_service.verify.policy_kl import policy_check
    from sync_service.verify.verdict import token_verdict
    from sync_service.verify.vllm_oracle import fresh_reference

    if cfg.adapter is None:
        raise ValueError("the vLLM demo needs an adapter (versions differ by their factors)")
    tmp = run_dir("vllm")
    rows: list[VersionRow] = []
    steps = Steps(3 + cfg.versions)
    try:
        steps.step(f"merging {cfg.versions} version(s) with PEFT and decoding them on fresh vLLM engines (the oracle)")
        work = cfg.work_dir or tmp / "work"
        merged = peft_versions(cfg.base, cfg.adapter, cfg.versions, work)
        fresh = fresh_reference({str(k): d for k, d in merged.items()}, PROMPTS, MAX_NEW_TOKENS,
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
            check = token_verdict(fresh.decodes[str(k)], [g[0] for g in gens], version, expected_version=v,
                                  dtype=checkpoint_dtype(cfg.base), accumulate_dtype=cfg.accumulate_dtype)
            rows.append(VersionRow.of(v, m, [{"engine": "vllm0", **read_back_verdict(
                check, engines[0], fresh.served[str(k)], cfg)}]))
            rows[-1].policy_kl_floor, (rows[-1].engines[0]["policy_kl"],) = policy_check(
                cfg.base, work / f"v{k}" / "adapter", engines, timeout_s=cfg.timeout_s)
            if cfg.digests_path is not None:
                write_digests(cfg.digests_path, v, engines, cfg.timeout_s)
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
