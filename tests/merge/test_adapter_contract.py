"""The adapter contract (``sync_service.merge.adapter_contract``): every ``LoraConfig`` field of the
installed PEFT has a row; adapters PEFT merges differently are refused by name before any merge, on
``weightsync merge``, on the ``sync`` preflight (before Ray) and at ``attach_trainer``; PiSSA / OLoRA
adapters saved with PEFT's conversion merge equal to PEFT's own merge.

The adversarial adapters are real PEFT adapters (PiSSA, OLoRA initialised by PEFT on the tiny base), or
a real adapter with one field of its ``adapter_config.json`` changed as a user's file would have it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sync_service.merge.adapter_contract import FIELDS
from sync_service.merge.errors import MergeError
from sync_service.merge.export import merge_checkpoint
from sync_service.synthetic import make_adapter, make_base
from tests.merge.conftest import assert_matches, peft_oracle, read_checkpoint


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("contract")
    make_base("qwen3_moe", root / "base")
    make_adapter("qwen3_moe", root / "base", root / "lora", kind="dense", r=2)
    make_adapter("qwen3_moe", root / "base", root / "dora", kind="dense", r=2, use_dora=True)
    return {"root": root, "base": root / "base", "lora": root / "lora", "dora": root / "dora"}


def test_the_table_names_every_field_of_peft_lora_config():
    from peft import LoraConfig

    fields = {f.name for f in dataclasses.fields(LoraConfig)}
    assert set(FIELDS) == fields, (f"fields PEFT added: {sorted(fields - set(FIELDS))}; "
                                   f"rows PEFT no longer has: {sorted(set(FIELDS) - fields)}")
    assert {row.kind for row in FIELDS.values()} <= {"metadata", "training", "selects", "init", "merged", "refused"}


def _edited(files, name: str, source: str = "lora", **fields) -> Path:
    out = files["root"] / name
    if not out.exists():
        shutil.copytree(files[source], out)
        path = out / "adapter_config.json"
        config = json.loads(path.read_text())
        config.update(fields)
        path.write_text(json.dumps(config))
    return out


def _peft_adapter(files, name: str, init: str, *, convert: bool) -> Path:
    """A real PEFT adapter initialised with ``init`` (which shifts the base), then 'trained' (factors
    moved), saved with or without PEFT's conversion to a plain LoRA."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = files["root"] / name
    if out.exists():
        return out
    model = AutoModelForCausalLM.from_pretrained(str(files["base"]), dtype=torch.float32)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=init)
    peft_model = get_peft_model(model, config)
    initial = files["root"] / f"{name}-initial"
    peft_model.save_pretrained(str(initial))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    kwargs = {"path_initial_model_for_weight_conversion": str(initial)} if convert else {}
    peft_model.save_pretrained(str(out), **kwargs)
    return out


REFUSED = [
    ("alora", {"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens=[5, 6] is not supported: aLoRA"),
    ("replication", {"layer_replication": [[0, 2], [1, 2]]}, "layer_replication=[[0, 2], [1, 2]] is not supported"),
    ("qalora", {"use_qalora": True}, "use_qalora=True is not supported"),
    ("lora-bias", {"lora_bias": True}, "lora_bias=True is not supported"),
    ("loftq", {"init_lora_weights": "loftq"}, "init_lora_weights='loftq' without conversion: PEFT shifts the base"),
    ("corda", {"init_lora_weights": "corda"}, "path_initial_model_for_weight_conversion"),
    ("unknown-key", {"lora_magic": 1}, "key 'lora_magic' is not a field of PEFT"),
]


@pytest.mark.parametrize("name, fields, message", REFUSED, ids=[c[0] for c in REFUSED])
def test_a_field_merged_otherwise_by_peft_is_refused_by_name(files, tmp_path, name, fields, message):
    adapter = _edited(files, name, **fields)
    with pytest.raises(MergeError, match=None) as info:
        merge_checkpoint(files["base"], adapter, tmp_path / "out", progress=False)
    assert message in str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora"])
def test_base_shifting_adapters_without_conversion_are_refused(files, tmp_path, init):
    adapter = _peft_adapter(files, f"{init}-raw", init, convert=False)
    with pytest.raises(MergeError, match=rf"init_lora_weights='{init}' without conversion: PEFT shifts the base "
                                         rf"weights.*path_initial_model_for_weight_conversion"):
        merge_checkpoint(files["base"], adapter, tmp_path / "out", progress=False)


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_converted_pissa_and_olora_merge_as_peft_does(files, tmp_path, init):
    adapter = _peft_adapter(files, f"{init}-converted", init, convert=True)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["init_lora_weights"] is True and config["r"] == 4  # PEFT's conversion: a plain LoRA of rank 2r
    merge_checkpoint(files["base"], adapter, tmp_path / "merged", progress=False)
    oracle = peft_oracle(files["base"], adapter, tmp_path / "oracle")
    base = read_checkpoint(files["base"])
    assert_matches(read_checkpoint(tmp_path / "merged"), oracle, base=base)
    assert not torch.equal(oracle["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])


def test_dora_magnitude_without_use_dora_is_refused(files, tmp_path):
    adapter = _edited(files, "dora-off", source="dora", use_dora=False)
    assert any(k.endswith("lora_magnitude_vector") for k in load_file(adapter / "adapter_model.safetensors"))
    with pytest.raises(MergeError, match="holds a DoRA lora_magnitude_vector but adapter_config use_dora=false"):
        merge_checkpoint(files["base"], adapter, tmp_path / "out", progress=False)


def test_an_adapter_without_tensors_is_refused(files, tmp_path):
    adapter = files["root"] / "empty"
    if not adapter.exists():
        shutil.copytree(files["lora"], adapter)
        save_file({}, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(MergeError, match="holds no tensors, so there is nothing to merge"):
        merge_checkpoint(files["base"], adapter, tmp_path / "out", progress=False)


def test_sync_preflight_refuses_before_ray(files, capsys):
    """The same checks are bad input on ``weightsync sync``: exit 2, one line, Ray never started."""
    from tests.cli.test_preflight import fails

    adapter = _edited(files, "alora", alora_invocation_tokens=[5, 6])
    fails(capsys, ["sync", "--base", str(files["base"]), "--adapter", str(adapter)],
          "alora_invocation_tokens=[5, 6] is not supported")


def test_attach_trainer_refuses_a_live_alora_model(files):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from sync_service.live import build_endpoint

    model = AutoModelForCausalLM.from_pretrained(str(files["base"]), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], alora_invocation_tokens=[5, 6]))
    with pytest.raises(Exception, match="alora_invocation_tokens=\\[5, 6\\] is not supported"):
        build_endpoint(peft_model, group=None, rank=0, world=1)


def test_docs_reliability_lists_the_table():
    text = (Path(__file__).parents[2] / "docs" / "reliability.md").read_text()
    for name, row in FIELDS.items():
        assert f"| `{name}` | {row.kind} |" in text, f"docs/reliability.md's contract table lacks {name} ({row.kind})"
