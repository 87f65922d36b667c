"""``weightsync sync|demo --engine vllm-server``: the local run with vLLM servers as the engines.

With ``--vllm-url`` (one or more) the run syncs into those running servers (each started with the
weightsync backend, serving ``--base`` in its dtype); without, it starts ``--engines`` local CPU
servers itself (``launch.LocalServer``) and stops them at the end. Verification per version and
server (``verify.verdict.token_verdict``): ``/weight_info`` reports the version, and the server's
greedy ``/v1/completions`` tokens equal, up to near-ties (``verify.tokens``), those of a fresh vLLM
on PEFT's own ``merge_and_unload`` of that version (float64, cast once: ``demo_vllm.peft_versions``,
the vLLM engine kind's oracle, ``verify.vllm_oracle``, run before any server starts). Versions
continue above what a running server serves (``sync_cli.first_version``). Each server's weights are read back
in its worker (the backend's ``served`` command: ``engines.vllm.served``) and judged against the fresh engine's
read back (``demo_vllm.read_back_verdict``); ``--digests FILE`` writes them per version. JSON: the demo's shape
plus ``"engine": "vllm-server"``. ``policy_kl`` per server from its full-vocabulary prompt logprobs over HTTP
(``VLLMServerEngine.token_logprobs``; the servers started here run ``--max-logprobs -1``; ``null`` for a
``--vllm-url`` server started without it, or a vocabulary above ``MAX_LOGPROBS_VOCAB``); ``policy_kl_floor`` beside it.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from sync_service.entrypoints.progress import Steps
from sync_service.verify.hf import MAX_NEW_TOKENS, PROMPTS
from sync_service.entrypoints.sync_cli import (RunConfig, VersionRow, announce_metrics, print_row,
                                   run_and_report)
from sync_service.entrypoints.workdir import run_dir, ray_temp

__all__ = ["execute_server", "run_server"]


def _servers(cfg: RunConfig, stack: contextlib.ExitStack, log_dir: Path) -> list[str]:
    """The URLs to sync into: ``cfg.vllm_urls``, else ``cfg.engines`` local servers started here."""
    if cfg.vllm_urls:
        return list(cfg.vllm_urls)
    from sync_service.engines.vllm.fused import checkpoint_dtype
    from sync_service.engines.vllm_server.launch import LocalServer

    dtype = checkpoint_dtype(cfg.base)
    return [stack.enter_context(LocalServer.start(cfg.base, dtype=dtype, timeout_s=max(600.0, cfg.timeout_s),
                                                  log_dir=log_dir)).url for _ in range(cfg.engines)]


def _verify(engine, name: str, v: int, expected: list, served: list, cfg: RunConfig) -> dict:
    import ray

    from sync_service.engines.vllm.fused import checkpoint_dtype
    from sync_service.entrypoints.demo_vllm import read_back_verdict
    from sync_service.verify.verdict import token_verdict

    got = ray.get(engine.complete.remote([list(p) for p in PROMPTS], MAX_NEW_TOKENS), timeout=cfg.timeout_s)
    version = ray.get(engine.weight_version.remote(), timeout=cfg.timeout_s)
    check = token_verdict(expected, [g["tokens"] for g in got], version, expected_version=v,
                          dtype=checkpoint_dtype(cfg.base), accumulate_dtype=cfg.accumulate_dtype)
    return {"engine": name, **read_back_verdict(check, engine, served, cfg)}


def run_server(cfg: RunConfig, launcher) -> list[VersionRow]:
    """Oracle first, then the servers, Ray, the trainers (actors from ``launcher``, a
    ``protocols.endpoints.Launcher``); push and verify every version."""
    import ray

    from sync_service.api import WeightSync
    from sync_service.entrypoints.demo_vllm import peft_versions
    from sync_service.entrypoints.sync_cli import first_version, start_ray, sync_config
    from sync_service.entrypoints.sync_cli import write_digests
    from sync_service.verify.policy_kl import policy_check
    from sync_service.verify.vllm_oracle import fresh_reference

    if cfg.adapter is None:
        raise ValueError("--engine vllm-server needs --adapter (versions differ by their factors)")
    tmp = run_dir("vsrv")
    rows: list[VersionRow] = []
    steps = Steps(4 + cfg.versions)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        steps.step(f"merging {cfg.versions} version(s) with PEFT and decoding them on fresh vLLM engines (the oracle)")
        work = cfg.work_dir or tmp / "work"
        merged = peft_versions(cfg.base, cfg.adapter, cfg.versions, work)
        fresh = fresh_reference({str(k): d for k, d in merged.items()}, PROMPTS, MAX_NEW_TOKENS,
                                timeout_s=max(600.0, cfg.timeout_s))
        steps.step("vLLM server(s): " + ("connecting" if cfg.vllm_urls else f"starting {cfg.engines} on this machine"))
        urls = _servers(cfg, stack, tmp)
        steps.step("starting a local Ray and the trainer shards")
        start_ray(ray_temp(tmp))
        stack.callback(ray.shutdown)
        stack.callback(steps.close)
        trainers = launcher.start_trainers(cfg.base, cfg.adapter, ep=cfg.ep, tp=cfg.tp, timeout_s=cfg.timeout_s)
        engines = launcher.start_server_engines(urls, api_key=cfg.vllm_api_key)
        steps.step("planning, validating the plan against every server's table")
        sync = WeightSync(trainers=trainers, engines=engines, config=sync_config(cfg))
        announce_metrics(sync)
        first = first_version(sync.engine_versions(), given=cfg.first_version, reset=cfg.reset_versions)  # a running server continues its numbering
        for k in range(cfg.versions):  # training step k (the oracle's version k) is pushed as version first + k
            v = first + k
            steps.step(f"version {v}: training step, push, generate")
            if k:
                ray.get([t.train_step.remote(k) for t in trainers], timeout=cfg.timeout_s)
            m = sync.push(v)
            rows.append(VersionRow.of(v, m, [_verify(e, f"server{i}", v, fresh.decodes[str(k)], fresh.served[str(k)], cfg)
                                             for i, e in enumerate(engines)]))
            floor, kls = policy_check(cfg.base, work / f"v{k}" / "adapter", engines, timeout_s=cfg.timeout_s)
            rows[-1].policy_kl_floor = floor
            for row, kl in zip(rows[-1].engines, kls):
                row["policy_kl"] = kl
            if cfg.digests_path is not None:
                write_digests(cfg.digests_path, v, engines, cfg.timeout_s)
            print_row(rows[-1])
        sync.close()
    return rows


def execute_server(cfg: RunConfig, extra: dict, launcher) -> int:
    """Run, print the table, write ``cfg.json_path``; 0 iff every version verified on every server."""
    where = ", ".join(cfg.vllm_urls) if cfg.vllm_urls else f"{cfg.engines} local vLLM server(s)"
    return run_and_report(cfg, lambda c: run_server(c, launcher), extra, engines=where, json_extra={"engine": "vllm-server"})
