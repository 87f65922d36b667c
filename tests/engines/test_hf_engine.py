"""HFEngine: staged apply, commit, abort, and a generation racing a commit (real transformers model)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from protocols.params import full_box
from sync_service.engines.hf import HFEngine, load_causal_lm

PROMPT = [3, 14, 15, 9, 2, 6]


def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=True, eos_token_id=None, pad_token_id=0, initializer_range=0.5,
    )
    return AutoModelForCausalLM.from_config(cfg).eval()


def push_all(engine: HFEngine, version: int, state: dict[str, torch.Tensor], *, commit: bool = True,
             reset_versions: bool = False) -> None:
    engine.begin_update(version, list(state), reset_versions=reset_versions)
    for name, value in state.items():
        # two boxes along dim 0 where possible, to exercise box offsets
        n0 = value.shape[0]
        cut = n0 // 2 if n0 > 1 else n0
        boxes = [((0, cut),), ((cut, n0),)] if cut < n0 else [((0, n0),)]
        for b in boxes:
            box = b + tuple((0, n) for n in value.shape[1:])
            engine.apply(name, box, value[b[0][0]:b[0][1]])
    engine.finish_update()
    if commit:
        engine.commit(version)


def test_table_reports_tied_weights_once():
    engine = HFEngine(tiny_model(0))
    names = [m.name for m in engine.param_metas()]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(set(names))
    meta = {m.name: m for m in engine.param_metas()}["model.layers.0.mlp.experts.gate_up_proj"]
    assert meta.shape == (4, 16, 16) and meta.dtype == "float32"


def test_commit_installs_applied_values_and_abort_keeps_served():
    engine = HFEngine(tiny_model(0))
    target = {n: p.detach().clone() for n, p in tiny_model(1).named_parameters()}
    before = engine.state_dict()
    push_all(engine, 7, target, commit=False)
    # staged only: served weights unchanged before commit
    for n, v in engine.state_dict().items():
        assert torch.equal(v, before[n]), n
    engine.abort()
    assert engine.weight_version() is None
    for n, v in engine.state_dict().items():
        assert torch.equal(v, before[n]), n
    push_all(engine, 8, target)
    assert engine.weight_version() == 8
    for n, v in engine.state_dict().items():
        assert torch.equal(v, target[n]), n
    # the tied lm_head follows the embedding
    assert torch.equal(engine._model.lm_head.weight, target["model.embed_tokens.weight"])


def test_partial_update_is_rejected_and_unknown_names_refused():
    engine = HFEngine(tiny_model(0))
    with pytest.raises(KeyError, match="not in the engine parameter table"):
        engine.begin_update(1, ["model.no_such.weight"])
    name = "model.layers.0.mlp.experts.down_proj"
    engine.begin_update(1, [name])
    engine.apply(name, ((0, 2), (0, 16), (0, 8)), torch.zeros(2, 16, 8))
    with pytest.raises(ValueError, match="incomplete update 1"):
        engine.finish_update()
    with pytest.raises(ValueError, match="has shape"):
        engine.apply(name, ((2, 4), (0, 16), (0, 8)), torch.zeros(1, 16, 8))
    engine.abort()
    assert not torch.equal(engine.state_dict()[name][:2], torch.zeros(2, 16, 8))


def test_delta_update_touches_only_named_params_and_reuses_storage():
    engine = HFEngine(tiny_model(0))
    before = engine.state_dict()
    name = "model.layers.1.self_attn.q_proj.weight"
    for version in (1, 2, 3):
        push_all(engine, version, {name: before[name] + version})
    after = engine.state_dict()
    assert torch.equal(after[name], before[name] + 3)
    for n in before:
        if n != name:
            assert torch.equal(after[n], before[n]), n


def test_generation_racing_commits_sees_one_version():
    weights = {v: {n: p.detach().clone() for n, p in tiny_model(v).named_parameters()} for v in (1, 2)}
    expected = {}
    for v in (1, 2):
        ref = HFEngine(tiny_model(v))
        expected[v] = ref.generate(PROMPT, 12).tokens
    assert expected[1] != expected[2]
    engine = HFEngine(tiny_model(0))
    push_all(engine, 1, weights[1])
    results = []
    stop = threading.Event()

    def generate_loop():
        while not stop.is_set():
            results.append(engine.generate(PROMPT, 12))

    thread = threading.Thread(target=generate_loop)
    thread.start()
    try:  # at least 6 commits, and on until 3 generations ran alongside them (bounded: no hang)
        deadline, i = time.monotonic() + 120, 0
        while i < 6 or (len(results) < 3 and time.monotonic() < deadline):
            v = 1 + (i % 2 == 0)
            push_all(engine, v, weights[v], reset_versions=True)  # versions 1, 2 label two weight sets: back and forth
            i += 1
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert len(results) >= 3
    assert {r.weight_version for r in results} <= {1, 2}
    for r in results:
        assert r.tokens == expected[r.weight_version], r


def test_load_reads_safetensors_and_never_a_pickled_checkpoint(tmp_path):
    model = tiny_model(5)
    model.save_pretrained(tmp_path / "safe", safe_serialization=True)
    loaded = load_causal_lm(tmp_path / "safe")
    assert not loaded.training
    want = model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())
    model.config.save_pretrained(tmp_path / "pickled")  # the pre-safetensors layout, written here on purpose
    torch.save(model.state_dict(), tmp_path / "pickled" / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights \(pickled \.bin weights are never loaded\)"):
        load_causal_lm(tmp_path / "pickled")


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                            reason="no CUDA device")])])
def test_an_engine_on_a_device_stages_there_and_serves_what_a_host_engine_serves(tmp_path, device):
    """``from_pretrained(device=)``: staging allocated on the served tensors' device, host buckets copied in, the
    same tokens as a host engine after the same update (the GPU case runs where CUDA is, e.g. gpu-check's host)."""
    tiny_model(0).save_pretrained(str(tmp_path / "base"))
    new = {n: p.detach().clone() for n, p in tiny_model(1).named_parameters()}
    host, dev = HFEngine.from_pretrained(tmp_path / "base"), HFEngine.from_pretrained(tmp_path / "base", device=device)
    assert {t.device.type for t in dev.export_tensors().values()} == {device}
    for engine in (host, dev):
        push_all(engine, 1, new)
    assert {n: t.cpu() for n, t in dev.state_dict().items()}.keys() == host.state_dict().keys()
    assert all(torch.equal(t.cpu(), host.state_dict()[n]) for n, t in dev.state_dict().items())
    if device == "cpu":  # a GPU's kernels may round differently: compared on the host only
        assert dev.generate(PROMPT, 6).tokens == host.generate(PROMPT, 6).tokens
    assert dev.sample(PROMPT, 3, num_samples=2, seed=5).weight_version == 1
