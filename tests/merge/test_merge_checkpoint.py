"""merge_checkpoint / weightsync merge on real tiny checkpoints: legacy keys, VL prefix, shards, errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file

from protocols.params import full_box
from sync_service.entrypoints.cli import main as cli_main
from sync_service.merge.base import SafetensorsBase
from sync_service.merge.errors import MergeError
from sync_service.merge.export import merge_checkpoint

E, I, H = 2, 2, 4
PRE = "base_model.model.model.layers.0.block_sparse_moe.experts"


def _read(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=32, hidden_size=H, intermediate_size=I, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=2, num_local_experts=E, num_experts_per_tok=1)
    d = tmp_path_factory.mktemp("mixtral")
    MixtralForCausalLM(cfg).save_pretrained(d)
    return d


def _legacy_adapter(d: Path, extra: dict | None = None, **config) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    sd = {}
    for e in range(E):
        for w, (out_f, in_f) in {"w1": (I, H), "w3": (I, H), "w2": (H, I)}.items():
            sd[f"{PRE}.{e}.{w}.lora_A.weight"] = torch.randn(1, in_f, generator=g)
            sd[f"{PRE}.{e}.{w}.lora_B.weight"] = torch.randn(out_f, 1, generator=g)
    sd.update(extra or {})
    d.mkdir(parents=True, exist_ok=True)
    LoraConfig(**{"r": 1, "lora_alpha": 2, "target_modules": ["w1", "w2", "w3"], **config}).save_pretrained(str(d))
    save_file(sd, str(d / "adapter_model.safetensors"))
    return sd


def test_merge_legacy_mixtral_keys_all_experts_change(mixtral_dir, tmp_path):
    sd = _legacy_adapter(tmp_path / "ad")
    merge_checkpoint(mixtral_dir, tmp_path / "ad", tmp_path / "out", progress=False)
    base, out = _read(mixtral_dir), _read(tmp_path / "out")
    assert set(out) == set(base)
    experts = [k for k in base if ".experts." in k]
    assert len(experts) == 3 * E
    for k in experts:
        e, w = k.split(".experts.")[1].split(".")[:2]
        a, b = sd[f"{PRE}.{e}.{w}.lora_A.weight"], sd[f"{PRE}.{e}.{w}.lora_B.weight"]
        torch.testing.assert_close(out[k], (base[k].float() + 2.0 * b @ a).to(base[k].dtype))
        assert not torch.equal(out[k], base[k]), k
    for k in set(base) - set(experts):
        assert torch.equal(out[k], base[k]), k


def test_merge_unmatched_adapter_key_errors_and_writes_nothing(mixtral_dir, tmp_path):
    _legacy_adapter(tmp_path / "ad", {f"{PRE}.0.w9.lora_A.weight": torch.ones(1, H), f"{PRE}.0.w9.lora_B.weight": torch.ones(I, 1)})
    with pytest.raises(MergeError, match=r"experts\.0\.w9.*matches no base tensor"):
        merge_checkpoint(mixtral_dir, tmp_path / "ad", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize("case,match", [
    ("lora_bias", "lora_bias"),
    ("shape", r"w1.*do not fit"),
    ("non_lora", "not a LoRA adapter"),
])
def test_merge_bad_adapter_clear_error(mixtral_dir, tmp_path, case, match):
    ad = tmp_path / "ad"
    if case == "lora_bias":
        _legacy_adapter(ad, {f"{PRE}.0.w1.lora_B.bias": torch.zeros(I)})
    elif case == "shape":
        _legacy_adapter(ad, {f"{PRE}.0.w1.lora_A.weight": torch.ones(1, H + 1)})
    else:
        _legacy_adapter(ad)
        cfg = json.loads((ad / "adapter_config.json").read_text())
        (ad / "adapter_config.json").write_text(json.dumps({**cfg, "peft_type": "IA3"}))
    with pytest.raises(MergeError, match=match):
        merge_checkpoint(mixtral_dir, ad, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_type,why", [("llama", "model family llama: no experts module"),
                                             ("not_a_model", "model_type 'not_a_model' is unknown to the installed transformers")])
def test_merge_unsupported_family_one_line(tmp_path, model_type, why):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(MergeError, match=why) as err:
        merge_checkpoint(tmp_path / "base", tmp_path / "ad", tmp_path / "out", progress=False)
    assert "\n" not in str(err.value)


def test_merge_vl_prefix_maps_through_the_same_table(mixtral_dir, tmp_path):
    d = tmp_path / "vl"
    d.mkdir()
    text_config = json.loads((mixtral_dir / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": text_config}))
    base = _read(mixtral_dir)
    save_file({k.replace("model.", "model.language_model.", 1): v for k, v in base.items()}, str(d / "model.safetensors"))
    provider = SafetensorsBase(d)
    names = [m.name for m in provider.metas()]
    fused = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert fused in names and "model.language_model.layers.0.mlp.gate.weight" in names
    gate_up = provider.read(fused, full_box((E, 2 * I, H)))
    assert torch.equal(gate_up[1, :I], base["model.layers.0.block_sparse_moe.experts.1.w1.weight"])
    assert torch.equal(gate_up[1, I:], base["model.layers.0.block_sparse_moe.experts.1.w3.weight"])


def test_merge_cli_shards_index_and_from_pretrained(mixtral_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    _legacy_adapter(tmp_path / "ad")
    rc = cli_main(["merge", "--base", str(mixtral_dir), "--adapter", str(tmp_path / "ad"), "--out", str(tmp_path / "out"),
                   "--dtype", "bfloat16", "--max-shard-size", "300", "--no-progress"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted((tmp_path / "out").glob("model-*-of-*.safetensors"))
    assert summary["shards"] == len(shards) > 1
    assert set(index["weight_map"]) == set(_read(mixtral_dir))
    assert index["metadata"]["total_size"] == summary["bytes"] == sum(t.numel() * 2 for t in _read(tmp_path / "out").values())
    assert all(t.dtype == torch.bfloat16 for t in _read(tmp_path / "out").values())
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert model.dtype == torch.bfloat16
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    assert modes and all(m == 0o666 & ~umask for m in modes.values()), modes  # ordinary files, as the umask says
    rc = cli_main(["merge", "--base", str(mixtral_dir), "--adapter", str(tmp_path / "ad"), "--out", str(tmp_path / "out")])
    assert rc == 2 and "not an empty directory" in capsys.readouterr().err


def test_merge_cli_sizes():
    from sync_service.entrypoints.merge_cli import parse_size

    assert [parse_size(s) for s in ("2GB", "500MB", "1GiB", "1.5KiB", "4096")] == [2 * 10**9, 500 * 10**6, 2**30, 1536, 4096]
    with pytest.raises(Exception, match="not understood"):
        parse_size("2 parsecs")
