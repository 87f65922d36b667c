"""Every bound of a command is checked before work starts: a value past it ends the command with one
``weightsync <cmd>: error:`` line naming the flag (or config field) and its range, exit 2, nothing
written and Ray never started (docs/operations.md, "Bounds"). And ``weightsync merge`` leaves
``--out`` as it found it when it loses a race for it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from safetensors.torch import load_file

from sync_service.synthetic import make_adapter, make_base
from tests.cli.test_preflight import fails

MAX_ENGINES, MAX_VERSIONS = 64, 1 << 20  # sync_service.defaults, as docs/operations.md states them
CPUS = len(os.sched_getaffinity(0))  # --threads' bound: the CPUs this process may run on


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bounds")
    make_base("qwen3_moe", root / "base")
    make_adapter("qwen3_moe", root / "base", root / "lora", kind="target_parameters")
    return {"base": root / "base", "lora": root / "lora"}


@pytest.mark.parametrize("argv,fragments", [
    (["--engines", "100000"], (f"--engines must be in [1, {MAX_ENGINES}], got 100000",)),
    (["--engines", str(MAX_ENGINES + 1)], ("--engines must be in",)),
    (["--versions", str(2**70)], (f"--versions must be in [1, {MAX_VERSIONS}]",)),
])
def test_sync_refuses_counts_past_their_bound(files, capsys, argv, fragments):
    fails(capsys, ["sync", "--base", str(files["base"]), "--adapter", str(files["lora"]), *argv], *fragments)


def test_demo_and_run_refuse_engine_counts_past_the_bound(files, tmp_path, capsys):
    import yaml

    fails(capsys, ["demo", "--cache-dir", str(tmp_path / "c"), "--engines", "100000"], "--engines must be in [1, 64]")
    assert not (tmp_path / "c").exists(), "the demo generated files before refusing --engines"
    doc = {"model": {"base": str(files["base"]), "adapter": str(files["lora"])}, "trainers": {"ep": 1},
           "engines": {"count": 100000, "placement": "SPREAD"}, "run": {"versions": 1},
           "cluster": {"rollout_group": {"resource_amount": 100000.0}}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(doc))
    fails(capsys, ["run", "--config", str(tmp_path / "run.yaml")], "engines.count must be in [1, 64], got 100000")


@pytest.mark.parametrize("threads", [0, CPUS + 1, 100000])
def test_merge_refuses_threads_past_the_cpus(files, tmp_path, capsys, threads):
    """``--threads 100000`` once wrote the output, printed success, then died of SIGSEGV (exit 139)."""
    out = tmp_path / "out"
    fails(capsys, ["merge", "--base", str(files["base"]), "--adapter", str(files["lora"]), "--out", str(out),
                   "--threads", str(threads)], f"--threads must be in [1, {CPUS}]", f"got {threads}")
    assert not out.exists()


def test_two_merges_into_one_out_one_wins_the_other_leaves_it(files, tmp_path, capsys):
    """Two merges started together into one existing empty ``--out``: one writes it (exit 0), the other
    exits 2 naming ``--out`` (it was an OSError "Directory not empty", exit 1); ``--out`` holds the
    winner's complete output and nothing else, and no temporary sibling is left."""
    from sync_service.entrypoints.cli import main

    out = tmp_path / "out"
    out.mkdir()  # an existing empty --out is accepted
    argv = ["merge", "--base", str(files["base"]), "--adapter", str(files["lora"]), "--out", str(out), "--no-progress"]
    start, codes = threading.Barrier(2), []

    def merge() -> None:
        start.wait(timeout=30)
        codes.append(main(argv))

    workers = [threading.Thread(target=merge) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    err = capsys.readouterr().err
    assert sorted(codes) == [0, 2], err
    line, = [ln for ln in err.splitlines() if ln.startswith("weightsync merge: error: ")]
    assert f"--out {out}" in line, line
    written = sorted(p.name for p in out.iterdir())
    assert {"config.json", "model.safetensors"} <= set(written) and not any(n.startswith(".") for n in written)
    assert load_file(str(out / "model.safetensors"))  # complete: a readable checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "a temporary sibling of --out was left"
    assert main(argv) == 2 and f"--out {out} exists" in capsys.readouterr().err  # a later one: refused
    assert sorted(p.name for p in out.iterdir()) == written


def test_bounds_are_the_documented_ones():
    from sync_service import defaults
    from sync_service.entrypoints.merge_cli import max_threads

    assert (defaults.MAX_ENGINES, defaults.MAX_VERSIONS, max_threads()) == (MAX_ENGINES, MAX_VERSIONS, CPUS)
