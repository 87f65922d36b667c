"""``weightsync merge`` on bad input: exit code 2, one ``weightsync merge: error:`` line naming the
file / field and the fix, no traceback, nothing written. Inputs are real files from
``sync_service.synthetic`` then damaged one way each."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sync_service.entrypoints.cli import main
from sync_service.synthetic import make_adapter, make_base


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("bad_input")
    base, adapter = root / "base", root / "adapter"
    make_base("qwen3_moe", base)
    make_adapter("qwen3_moe", base, adapter, kind="target_parameters")
    return base, adapter


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _merge_fails(capsys, base: Path, adapter: Path, out: Path, *fragments: str, extra: tuple[str, ...] = ()) -> str:
    before = set(os.listdir(out.parent)) if out.parent.is_dir() else set()
    try:
        rc = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--no-progress", *extra])
    except SystemExit as exc:  # argparse: a usage block, then the one error line
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith(("usage: ", " "))]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("weightsync merge: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not out.exists()
    after = set(os.listdir(out.parent)) if out.parent.is_dir() else set()
    assert after == before, f"merge wrote {after - before}"
    return lines[0]


_CORRUPT = {
    "truncated": lambda b: b[: len(b) // 2],
    "random": lambda b: bytes(range(256)) * 16,
    "empty": lambda b: b"",
    "huge_header": lambda b: struct.pack("<Q", 1 << 62) + b"{}",
}


@pytest.mark.parametrize("which", ["adapter", "base"])
@pytest.mark.parametrize("how", sorted(_CORRUPT))
def test_corrupt_safetensors(good, tmp_path, capsys, which, how):
    _break_file_and_merge(good, tmp_path, capsys, which, ("model.safetensors", "adapter_model.safetensors"),
                          _CORRUPT[how], "not a valid safetensors file")


_BAD_JSON = {"not_json": b"{not json", "list": b"[1, 2]", "not_utf8": b"\xff\xfe\x00garbage"}


@pytest.mark.parametrize("which", ["adapter", "base"])
@pytest.mark.parametrize("how", sorted(_BAD_JSON))
def test_bad_json(good, tmp_path, capsys, which, how):
    _break_file_and_merge(good, tmp_path, capsys, which, ("config.json", "adapter_config.json"), lambda _: _BAD_JSON[how])


def _break_file_and_merge(good, tmp_path, capsys, which: str, names: tuple[str, str], rewrite, *expect: str) -> None:
    """Copy the base or adapter dir, rewrite its file ``names[which == "adapter"]``, and check the merge
    fails naming that file (and ``expect``)."""
    base, adapter = good
    d = _copy(base if which == "base" else adapter, tmp_path / which)
    path = d / names[which == "adapter"]
    path.write_bytes(rewrite(path.read_bytes()))
    args = (d, adapter) if which == "base" else (base, d)
    _merge_fails(capsys, *args, tmp_path / "out", str(path), *expect)


_BAD_FIELDS = [
    ({"r": 0}, "r must be a positive int, got 0"),
    ({"r": -2}, "r must be a positive int, got -2"),
    ({"r": 2.5}, "r must be a positive int, got 2.5"),
    ({"r": "two"}, "r must be a positive int, got 'two'"),
    ({"r": True}, "r must be a positive int, got True"),
    ({"lora_alpha": None}, "lora_alpha must be a finite number, got None"),
    ({"lora_alpha": "8"}, "lora_alpha must be a finite number, got '8'"),
    ({"lora_alpha": float("nan")}, "lora_alpha must be a finite number, got nan"),
    ({"rank_pattern": {"q_proj": "x"}}, "rank_pattern['q_proj'] must be a positive int"),
    ({"rank_pattern": [1]}, "rank_pattern must be an object"),
    ({"alpha_pattern": {"q_proj": float("inf")}}, "alpha_pattern['q_proj'] must be a finite number"),
    ({"target_parameters": "mlp.experts.gate_up_proj"}, "target_parameters must be a list of strings"),
    ({"use_rslora": "yes"}, "use_rslora must be true or false"),
    ({"use_dora": 1}, "use_dora must be true or false"),
]


@pytest.mark.parametrize("change,message", _BAD_FIELDS, ids=[next(iter(c)) + "=" + repr(next(iter(c.values()))) for c, _ in _BAD_FIELDS])
def test_bad_adapter_config_fields(good, tmp_path, capsys, change, message):
    base, adapter = good
    d = _copy(adapter, tmp_path / "adapter")
    path = d / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    _merge_fails(capsys, base, d, tmp_path / "out", str(path), message)


def _edit_adapter(adapter: Path, d: Path, fn) -> Path:
    _copy(adapter, d)
    sd = load_file(str(d / "adapter_model.safetensors"))
    save_file(fn(sd), str(d / "adapter_model.safetensors"))
    return d


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
EXPERT_B = "base_model.model.model.layers.1.mlp.experts.lora_B.weight"


@pytest.mark.parametrize("key", [Q_A, EXPERT_B])
def test_non_finite_factor(good, tmp_path, capsys, key):
    base, adapter = good

    def poison(sd):
        sd[key] = sd[key].clone()
        sd[key][0, 0] = float("nan")
        return sd

    d = _edit_adapter(adapter, tmp_path / "adapter", poison)
    _merge_fails(capsys, base, d, tmp_path / "out", key.removeprefix("base_model.model."), "NaN or Inf")


@pytest.mark.parametrize("bad", ["int", "empty_rank", "scalar"])
def test_malformed_factor(good, tmp_path, capsys, bad):
    base, adapter = good
    make = {"int": lambda t: t.to(torch.int64), "empty_rank": lambda t: torch.zeros(0, t.shape[1]), "scalar": lambda t: torch.tensor(1.0)}

    def edit(sd):
        sd[Q_A] = make[bad](sd[Q_A])
        return sd

    d = _edit_adapter(adapter, tmp_path / "adapter", edit)
    _merge_fails(capsys, base, d, tmp_path / "out", "q_proj")


def test_dora_without_magnitudes(good, tmp_path, capsys):
    base, adapter = good
    d = _copy(adapter, tmp_path / "adapter")
    path = d / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "use_dora": True}))
    _merge_fails(capsys, base, d, tmp_path / "out", "use_dora=true but no lora_magnitude_vector")


def test_lora_on_integer_base_tensor(good, tmp_path, capsys):
    base, adapter = good
    d = _copy(base, tmp_path / "base")
    sd = load_file(str(d / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight"
    sd[key] = sd[key].to(torch.int32)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    _merge_fails(capsys, d, adapter, tmp_path / "out", key, "int32", "floating-point")


@pytest.mark.parametrize("size", ["1", "2", "4000"])
def test_staging_size_below_minimum(good, tmp_path, capsys, size):
    base, adapter = good
    _merge_fails(capsys, base, adapter, tmp_path / "out", "--staging-size", "minimum", extra=("--staging-size", size))


def test_out_under_a_file(good, tmp_path, capsys):
    base, adapter = good
    (tmp_path / "afile").write_text("x")
    _merge_fails(capsys, base, adapter, tmp_path / "afile" / "sub" / "out", "afile is a file")


def test_good_input_still_merges(good, tmp_path, capsys):
    base, adapter = good
    rc = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "out"),
               "--no-progress", "--staging-size", "4KiB"])
    assert rc == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["changed"] == 32  # on disk: 2 × (4 attention + 4 experts × 3)


def test_dcp_inputs_refused_in_one_line(capsys, good, tmp_path):
    """torch.distributed.checkpoint directories: a ``.metadata`` pickle naming anything but DCP's records is
    refused unread (its payload never runs); a real DCP without config.json, or whose keys are not the model
    of its config.json, is refused naming the fix."""
    import torch.distributed.checkpoint as dcp

    base, _ = good
    hostile, marker = tmp_path / "hostile", tmp_path / "ran"
    hostile.mkdir()
    (hostile / ".metadata").write_bytes(f"cposix\nsystem\n(Vtouch {marker}\ntR.".encode())  # os.system(...)
    _merge_fails(capsys, hostile, hostile, tmp_path / "o1", "not a torch.distributed.checkpoint metadata file",
                 "refused global posix.system")
    assert not marker.exists()

    foreign = tmp_path / "foreign"
    dcp.save({"model.w": torch.zeros(2, 3)}, checkpoint_id=str(foreign), no_dist=True)
    _merge_fails(capsys, foreign, foreign, tmp_path / "o2", "without config.json", "save_pretrained")
    shutil.copy2(base / "config.json", foreign / "config.json")
    _merge_fails(capsys, foreign, good[1], tmp_path / "o3", "is not the", "unexpected ['model.w']")


def test_dcp_shapes_not_its_config_refused_in_one_line(capsys, good, tmp_path):
    """A DCP of the model's own keys whose shapes are not its config.json's (a config of another size saved
    beside it): one line naming the key, both shapes and the fix; nothing written."""
    import torch.distributed.checkpoint as dcp
    import transformers

    base, _ = good
    state = dict(transformers.AutoModelForCausalLM.from_pretrained(str(base)).state_dict())
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][:-1].clone()
    ckpt = tmp_path / "ckpt"
    dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
    shutil.copy2(base / "config.json", ckpt / "config.json")
    capsys.readouterr()  # from_pretrained's own progress bar above
    _merge_fails(capsys, ckpt, ckpt, tmp_path / "out", "shapes are not those of its config.json",
                 "model.embed_tokens.weight", "torch.Size([63, 16])", "model.config.save_pretrained")


@pytest.mark.parametrize("change,fragments", [
    ({"lora_alpha": 1e300}, ("adapter module model.layers.0.", "scaling lora_alpha / r = 1e+300 / 2 = 5e+299 overflows "
                                                               "float32", "fix lora_alpha / alpha_pattern")),
    ({"alpha_pattern": {"q_proj": -1e39}}, ("adapter module model.layers.0.self_attn.q_proj", "= -5e+38 overflows")),
    ({"lora_alpha": 1e39, "use_rslora": True}, ("lora_alpha / sqrt(r) = 1e+39 / sqrt(2)",)),
    ({"lora_alpha": 10**400}, ("adapter_config.json: lora_alpha must be a finite number",)),
], ids=["lora_alpha", "alpha_pattern", "rslora", "int_past_float"])
def test_scaling_that_overflows_is_named(good, tmp_path, capsys, change, fragments):
    """A scaling past float32 (the merge's addmm_ scalar) failed in 'value cannot be converted to type float
    without overflow', naming neither the field nor the tensor."""
    base, adapter = good
    d = _copy(adapter, tmp_path / "adapter")
    path = d / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    _merge_fails(capsys, base, d, tmp_path / "out", *fragments)


@pytest.mark.parametrize("out", ["/proc/weightsync-out", "/proc/weightsync-out/sub"])
def test_out_under_an_unwritable_parent_names_out(good, capsys, out):
    """``os.access`` allows root to write /proc; the merge named its internal temp path ('/proc/.foo.tmp-…')."""
    base, adapter = good
    rc = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", out, "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"weightsync merge: error: --out {out}: cannot create a directory in /proc"), err
    assert ".tmp-" not in err and "choose an --out under a writable directory" in err, err


def test_ensure_weight_tying_on_a_tied_embedding_is_named(tmp_path, capsys):
    """PEFT's ensure_weight_tying=true wraps lm_head too when embed_tokens (tied to it) is targeted; the merge
    refused it as 'the config does not describe these weights' instead of naming the flag."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = make_base("qwen3_moe", tmp_path / "tied", num_layers=1, tie_word_embeddings=True)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base)),
                           LoraConfig(r=2, target_modules=["embed_tokens"], ensure_weight_tying=True))
    model.save_pretrained(str(tmp_path / "adapter"))
    capsys.readouterr()  # transformers' load bars
    _merge_fails(capsys, base, tmp_path / "adapter", tmp_path / "out",
                 "adapter_config ensure_weight_tying=true on tied tensor lm_head.weight",
                 "save the adapter with ensure_weight_tying=false")
