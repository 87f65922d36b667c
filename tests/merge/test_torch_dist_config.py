"""``weightsync merge --base <torch_dist> --hf-config DIR`` refuses an ``--hf-config`` that is not the model the
checkpoint was converted from, in one line, before anything is written: another attention geometry whose
``linear_qkv`` rows happen to split (4 heads / 2 key-value heads and 6 / 1 both make 8 head_dims), a config-only
directory of another size (layers, experts, vocabulary), a config.json that is not JSON or lacks the geometry.

The checkpoint is written here with ``dcp.save`` in Megatron-Core's ``torch_dist`` key layout (global keys stacked
per layer, experts on dim 1, ``linear_qkv`` per query group, ``linear_fc1`` = [gate; up], a Bridge LoRA on
``linear_qkv``; ``metadata.json`` naming the backend), from a tiny Qwen3-MoE: no Megatron stack needed."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from sync_service.entrypoints.cli import main
from sync_service.synthetic.base import make_base

HEADS, GROUPS, HEAD_DIM, HIDDEN, LAYERS, EXPERTS, DIM = 4, 2, 8, 32, 2, 4, 4


def _qkv(q, k, v):
    per = HEADS // GROUPS
    return torch.cat([q.reshape(GROUPS, per, HEAD_DIM, -1), k.reshape(GROUPS, 1, HEAD_DIM, -1),
                      v.reshape(GROUPS, 1, HEAD_DIM, -1)], dim=1).reshape((HEADS + 2 * GROUPS) * HEAD_DIM, -1)


def _torch_dist(hf, out, adapters_only=False):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    w = load_file(str(hf / "model.safetensors"))
    layer = lambda i: f"model.layers.{i}."  # noqa: E731
    per_layer = {
        "self_attention.linear_qkv.weight": lambda p: _qkv(w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"],
                                                           w[p + "self_attn.v_proj.weight"]),
        "self_attention.linear_qkv.layer_norm_weight": lambda p: w[p + "input_layernorm.weight"],
        "self_attention.linear_proj.weight": lambda p: w[p + "self_attn.o_proj.weight"],
        "self_attention.q_layernorm.weight": lambda p: w[p + "self_attn.q_norm.weight"],
        "self_attention.k_layernorm.weight": lambda p: w[p + "self_attn.k_norm.weight"],
        "pre_mlp_layernorm.weight": lambda p: w[p + "post_attention_layernorm.weight"],
        "mlp.router.weight": lambda p: w[p + "mlp.gate.weight"],
    }
    state = {f"decoder.layers.{k}": torch.stack([f(layer(i)) for i in range(LAYERS)]) for k, f in per_layer.items()}
    for key, leaves in {"linear_fc1.weight": ("gate_proj", "up_proj"), "linear_fc2.weight": ("down_proj",)}.items():
        state[f"decoder.layers.mlp.experts.experts.{key}"] = torch.stack([torch.stack([
            torch.cat([w[f"{layer(i)}mlp.experts.{e}.{leaf}.weight"] for leaf in leaves]) for e in range(EXPERTS)])
            for i in range(LAYERS)])
    state.update({"embedding.word_embeddings.weight": w["model.embed_tokens.weight"],
                  "decoder.final_layernorm.weight": w["model.norm.weight"], "output_layer.weight": w["lm_head.weight"]})
    rows = (HEADS + 2 * GROUPS) * HEAD_DIM
    gen = torch.Generator().manual_seed(0)
    state["decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight"] = torch.randn(LAYERS, DIM, HIDDEN, generator=gen)
    state["decoder.layers.self_attention.linear_qkv.adapter.linear_out.weight"] = torch.randn(LAYERS, rows, DIM, generator=gen)
    if adapters_only:  # a Megatron-Bridge PEFT checkpoint: the HF model directory is the base
        state = {k: v for k, v in state.items() if ".adapter." in k}
    dcp.save({k: v.contiguous() for k, v in state.items()}, checkpoint_id=str(out), no_dist=True)
    (out / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("torch_dist")
    hf = make_base("qwen3_moe", root / "hf", hidden=HIDDEN, num_layers=LAYERS, num_experts=EXPERTS,
                   config_overrides={"num_attention_heads": HEADS, "num_key_value_heads": GROUPS, "head_dim": HEAD_DIM})
    return hf, _torch_dist(hf, root / "ck"), _torch_dist(hf, root / "ck_adapters", adapters_only=True)


def _config_dir(tmp_path, hf, name, text=None, **changes):
    out = tmp_path / name
    out.mkdir()
    config = json.loads((hf / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(text if text is not None else json.dumps(config))
    return out


def _merge(capsys, ckpt_dir, hf_config, out):
    code = main(["merge", "--no-progress", "--base", str(ckpt_dir), "--hf-config", str(hf_config), "--lora-alpha", "8",
                 "--out", str(out)])
    return code, capsys.readouterr().err.strip()


def test_the_right_config_merges_with_or_without_its_weights(ckpt, tmp_path, capsys):
    hf, ck, _ = ckpt
    assert _merge(capsys, ck, hf, tmp_path / "m")[0] == 0
    assert _merge(capsys, ck, _config_dir(tmp_path, hf, "cfg"), tmp_path / "m2")[0] == 0


@pytest.mark.parametrize("name,changes,text,reason", [
    ("geometry", {"num_attention_heads": 6, "num_key_value_heads": 1}, None, "linear_proj.weight is"),
    ("layers", {"num_hidden_layers": 3}, None, "missing \\['model.layers.2"),
    ("experts", {"num_local_experts": EXPERTS * 2, "num_experts": EXPERTS * 2}, None, "other shapes .*experts"),
    ("vocab", {"vocab_size": 128}, None, "other shapes .*(lm_head|embed_tokens)"),
    ("not_json", {}, "{oops", "not an HF model config .*JSONDecodeError"),
    ("no_heads", {}, '{"model_type": "qwen3_moe", "hidden_size": 32}', "not an HF model config .*KeyError"),
])
def test_another_models_config_is_refused_in_one_line(ckpt, tmp_path, capsys, name, changes, text, reason):
    hf, ck, _ = ckpt
    code, err = _merge(capsys, ck, _config_dir(tmp_path, hf, name, text, **changes), tmp_path / "out")
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("weightsync merge: error:") and "--hf-config" in err, err
    import re
    assert re.search(reason, err), err
    assert not (tmp_path / "out").exists()
    shutil.rmtree(tmp_path / name)


def test_an_adapter_only_checkpoint_against_a_config_whose_qkv_rows_differ(ckpt, tmp_path, capsys):
    """A Bridge PEFT checkpoint (adapters only) over an HF directory of 8 heads: linear_out's qkv rows do not split
    (was a ValueError from the layout table, not a merge error naming --hf-config)."""
    hf, _, ck = ckpt
    assert _merge(capsys, ck, hf, tmp_path / "ok")[0] == 0
    other = tmp_path / "other"
    shutil.copytree(hf, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(config, num_attention_heads=8)))
    code, err = _merge(capsys, ck, other, tmp_path / "out")
    assert code == 2 and len(err.splitlines()) == 1 and "--hf-config" in err and "linear_qkv" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag,run_config,named", [
    ("nan", None, "--lora-alpha nan"), ("inf", None, "--lora-alpha inf"),
    (None, "peft:\n  alpha: abc\n", "run_config.yaml: peft.alpha 'abc'"),
    (None, "peft:\n  alpha: .nan\n", "run_config.yaml: peft.alpha nan"),
])
def test_an_alpha_that_is_no_finite_number_is_named(ckpt, tmp_path, capsys, flag, run_config, named):
    """A NaN / inf --lora-alpha was refused naming a temporary adapter_config.json the user never wrote; a run
    config's non-numeric alpha raised float()'s bare ValueError."""
    hf, ck, _ = ckpt
    if run_config is not None:
        shutil.copytree(ck, tmp_path / "ck")
        (tmp_path / "ck" / "run_config.yaml").write_text(run_config)
        ck = tmp_path / "ck"
    argv = ["merge", "--no-progress", "--base", str(ck), "--hf-config", str(hf), "--out", str(tmp_path / "out")]
    code = main(argv + (["--lora-alpha", flag] if flag else []))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and named in err and "adapter_config" not in err, err
    assert not (tmp_path / "out").exists()
