"""Every family synced end to end: two TrainerShard actors (EP=2) → WeightSync → a transformers engine actor,
all in one Ray session. Version 0 (full sync) and version 1 (a delta after a training step) must equal PEFT's
``merge_and_unload`` in float64 cast once of their adapters (``assert_matches``: fp32-merge rounding, bf16
within one ulp); the delta must send only the tensors the adapter changes and leave the engine bitwise what
merged mode computes for the whole base (``tests.oracle.our_merge``: a delta equals a full sync). Families
alternate fp32 / bf16 and plain / rsLoRA scaling. deepseek_v3 covers a
persistent buffer (``mlp.gate.e_score_correction_bias``): carried by the full sync, never by a delta.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sync_service.api import SyncConfig, WeightSync
from actors.launch import start_trainers
from sync_service.entrypoints.local import AdapterReplay
from sync_service.synthetic import make_adapter, make_base
from tests.merge.conftest import assert_matches, peft_merged_model
from tests.oracle import our_merge

ray = pytest.importorskip("ray")

CONFIG = SyncConfig(transport="shm", bucket_bytes=16 << 10, timeout_s=120)
FAMILIES = ("qwen3_vl_moe", "llama4", "granitemoe", "glm4_moe", "qwen3_next", "qwen3_5_moe", "deepseek_v2", "dots1",
            "ernie4_5_moe", "hunyuan_v1_moe", "minimax", "phimoe", "jamba", "deepseek_v3")
CASES = [pytest.param(f, ("float32", "bfloat16")[i % 2], bool(i // 2 % 2), id=f"{f}-{('fp32', 'bf16')[i % 2]}"
                      f"{'-rslora' if i // 2 % 2 else ''}") for i, f in enumerate(FAMILIES)]


class EnginePool:
    """One engine actor per family, started ``ahead`` families in advance (an engine process takes most
    of a case's time to import torch + transformers; they start in parallel, bounded for memory)."""

    def __init__(self, files: dict, ahead: int = 4) -> None:
        from actors.rollout import RolloutEngine

        self._start = lambda f: RolloutEngine.remote(model_dir=str(files[f][0]), engine="hf", name=f)
        self._order, self._ahead, self._started = [c.values[0] for c in CASES], ahead, {}
        for family in self._order[:ahead]:
            self._started[family] = self._start(family)

    def take(self, family: str):
        """The family's engine, ready (waits for its start, before the timeout); starts the next ones."""
        engine = self._started.pop(family, None) or self._start(family)
        i = self._order.index(family)
        for nxt in self._order[i + 1:i + 1 + self._ahead]:
            self._started.setdefault(nxt, self._start(nxt))
        ray.get(engine.weight_version.remote(), timeout=300)
        return engine

    def close(self) -> None:
        for engine in self._started.values():
            ray.kill(engine)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family → (base dir, adapter dir), all built before any engine starts."""
    root = tmp_path_factory.mktemp("sync-families")
    out = {}
    for case in CASES:
        family, dtype, rslora = case.values
        base = make_base(family, root / family / "base", dtype=dtype, num_experts=4)
        out[family] = (base, make_adapter(family, base, root / family / "lora", kind="target_parameters", r=2,
                                          lora_alpha=6, use_rslora=rslora, seed=3))
    return out


@pytest.fixture(scope="module")
def engine_pool(ray_local, families):
    pool = EnginePool(families)
    yield pool
    pool.close()


def _engine_state(engine) -> dict[str, np.ndarray]:
    return ray.get(engine.state.remote(), timeout=120)


def _as_torch(state: dict[str, np.ndarray], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Engine arrays (bf16 comes back as fp32, exactly) in the reference's dtypes."""
    return {n: torch.from_numpy(a).to(like[n].dtype) for n, a in state.items()}


def _assert_peft_merge(state: dict[str, np.ndarray], base, adapter, dtype: str) -> None:
    """The engine's ``state`` equals PEFT's ``merge_and_unload`` of ``adapter`` (float64; the float64 tensors
    cast once to ``dtype``, tensors transformers keeps in fp32 left so), within ``assert_matches``."""
    oracle = {n: t.to(getattr(torch, dtype)) if t.dtype == torch.float64 else t
              for n, t in peft_merged_model(base, adapter).state_dict().items()}
    assert_matches(_as_torch(state, oracle), {n: oracle[n] for n in state})


@pytest.mark.parametrize("family,dtype,rslora", CASES)
def test_family_full_then_delta_sync(trainer_pool, engine_pool, families, tmp_path, family, dtype, rslora):
    base, adapter = families[family]
    engine = engine_pool.take(family)
    trainers = start_trainers(base, adapter, ep=2, reuse=trainer_pool)
    sync = WeightSync(trainers=trainers, engines=[engine], config=CONFIG)
    try:
        assert sync.push(0).full
        state = _engine_state(engine)
        _assert_peft_merge(state, base, adapter, dtype)

        replay = AdapterReplay(adapter)
        ray.get([t.train_step.remote(1) for t in trainers], timeout=120)
        replay.step(1)
        delta = sync.push(1)
        assert not delta.full
        before = {n: torch.from_numpy(a) for n, a in state.items()}
        after = _engine_state(engine)
        _assert_peft_merge(after, base, replay.save(tmp_path / "lora-v1"), dtype)
        reference = our_merge(base, replay)  # merged mode over the whole base: the delta equals it bitwise
        assert set(after) == set(reference)
        for name, want in reference.items():
            assert np.array_equal(after[name], want.float().numpy() if want.dtype == torch.bfloat16 else want.numpy()), name
        changed = [n for n in after if not np.array_equal(after[n], before[n].numpy())]
        assert any(".experts." in n for n in changed), changed
        sent = {n: reference[n].numel() * reference[n].element_size() for n in replay_changed(base, reference)}
        assert delta.bytes == sum(sent.values()), (delta.bytes, sent)
        if family == "deepseek_v3":  # the buffer: carried by the full sync, never by the delta
            bias = "model.layers.1.mlp.gate.e_score_correction_bias"
            assert bias in state and bias not in sent and np.array_equal(after[bias], state[bias])
    finally:
        sync.close()
        ray.kill(engine)


CENSUS_ONLY = [("jetmoe", "JetMoeForCausalLM"), ("longcat_flash", "LongcatFlashForCausalLM")]


@pytest.mark.parametrize("model_type,class_name", CENSUS_ONLY)
def test_census_family_syncs_without_expert_parallelism(trainer_pool, tmp_path, model_type, class_name):
    """jetmoe (experts as modules of one 3D weight) and longcat_flash (zero-compute experts in gate_up_proj
    only), as the census builds them, synced by one trainer (EP over them is refused) into a transformers
    engine: equal to PEFT's float64 merge cast once."""
    from actors.rollout import RolloutEngine
    from tests.merge.families_census import census_files

    base, adapter = census_files(model_type, class_name, tmp_path)
    engine = RolloutEngine.remote(model_dir=str(base), engine="hf", name=model_type)
    sync = WeightSync(trainers=start_trainers(base, adapter, ep=1, reuse=trainer_pool[:1]), engines=[engine],
                      config=CONFIG)
    try:
        assert sync.push(0).full
        _assert_peft_merge(_engine_state(engine), base, adapter, "float32")
    finally:
        sync.close()
        ray.kill(engine)


TP_CASES = [("llama4", 1, 2, "bfloat16"), ("gpt_oss", 2, 1, "bfloat16"), ("gpt_oss", 1, 2, "float32")]


@pytest.mark.parametrize("family,ep,tp,dtype", TP_CASES, ids=[f"{f}-ep{e}-tp{t}" for f, e, t, _ in TP_CASES])
def test_in_out_family_ep_tp_sync(trainer_pool, families, tmp_path, family, ep, tp, dtype):
    """Families whose experts are stored in_out (llama4 ``gate_up_proj`` [E, H, 2I]; gpt_oss interleaved, with
    biases) synced through EP or TP trainers: each rank holds the split of the dims where they sit
    (``sharding.rules.EXPERT_TP_RULES``), and the engine equals PEFT's ``merge_and_unload`` (float64, cast once)."""
    from actors.rollout import RolloutEngine
    from protocols.params import ParamMeta
    from sync_service.merge.base import SafetensorsBase
    from sync_service.sharding.rules import ShardSpec, shard_pieces

    if family in families:  # llama4: the matrix's bf16 files
        base, adapter = families[family]
    else:
        base = make_base(family, tmp_path / "base", dtype=dtype, num_experts=4)
        adapter = make_adapter(family, base, tmp_path / "lora", kind="target_parameters", r=2, lora_alpha=6, seed=5)
    checkpoint = SafetensorsBase(base)
    gate_up = next(m for m in checkpoint.metas() if m.name.endswith("experts.gate_up_proj"))
    held = shard_pieces(ParamMeta(gate_up.name, gate_up.dtype, gate_up.shape), ShardSpec(rank=1, ep=ep, tp=tp),
                        checkpoint.layout)
    split, whole = (0, 1) if ep > 1 else (2, 1)  # EP: experts; TP: the 2I dim (dim 2 when in_out), never H
    assert all(p.global_box[split] != (0, gate_up.shape[split]) and p.global_box[whole] == (0, gate_up.shape[whole])
               for p in held), held
    engine = RolloutEngine.remote(model_dir=str(base), engine="hf", name=f"{family}-tp")
    trainers = start_trainers(base, adapter, ep=ep, tp=tp, reuse=trainer_pool)
    sync = WeightSync(trainers=trainers, engines=[engine], config=CONFIG)
    try:
        assert sync.push(0).full
        _assert_peft_merge(_engine_state(engine), base, adapter, dtype)
    finally:
        sync.close()
        ray.kill(engine)


def replay_changed(base, reference: dict[str, torch.Tensor]) -> list[str]:
    """Names whose reference differs from the base (what a delta must send)."""
    from protocols.params import full_box
    from sync_service.merge.base import SafetensorsBase

    provider = SafetensorsBase(base)
    return [n for n, t in reference.items() if not torch.equal(provider.read(n, full_box(tuple(t.shape))), t)]


def cli_families() -> list[str]:
    """One family per distinct derived layout (``golden_layouts.json`` rows without their names: disk form,
    transpose, orientation, gate/up order, per-expert names, renames), deepseek_v3 first (its buffer). A
    ``weightsync sync`` run costs ~25 s of start-up alone (Ray, three actor processes), so the families that
    share a layout row with one of these run through the CLI only in the matrix above."""
    golden = json.loads((Path(__file__).with_name("golden_layouts.json")).read_text())
    kinds: dict[tuple, str] = {}
    for family in sorted(FAMILIES, key=lambda f: f != "deepseek_v3"):
        row = golden[family]
        kinds.setdefault((row["disk"], row["disk_transpose"], row["orientation"], row["gate_up_order"],
                          tuple(row["per_expert_names"]), len(row["disk_renames"])), family)
    return list(kinds.values())


@pytest.mark.cli
@pytest.mark.parametrize("family", cli_families())
def test_cli_syncs_family(families, tmp_path, family):
    """``weightsync sync`` (EP=2, one transformers engine) on the family's checkpoint + LoRA adapter: a full
    then a delta version, each verified by the CLI itself against PEFT's ``merge_and_unload`` (float64, cast
    once), the ``weightsync merge`` output and the PEFT model's greedy tokens; exit 0. For deepseek_v3 the
    engine holds the fp32 ``e_score_correction_bias`` buffer of a bf16 checkpoint."""
    base, adapter = families[family]
    out = tmp_path / "run.json"
    script = Path(sys.executable).with_name("weightsync")
    done = subprocess.run([str(script), "sync", "--base", str(base), "--adapter", str(adapter), "--ep", "2",
                           "--engines", "1", "--versions", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["ep"] == 2 and [v["full"] for v in report["versions"]] == [True, False]
    for version in report["versions"]:
        (engine,) = version["engines"]
        assert engine["weights_equal_reference"] and engine["weights_equal_merge_output"], (family, engine)
        assert engine["generations_equal"] and engine["weight_version"] == version["version"], (family, engine)
