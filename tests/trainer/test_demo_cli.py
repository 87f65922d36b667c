"""``weightsync demo --trainer``: the live-trainer demo end to end in a subprocess, and bad combinations
failing in one line before Ray starts."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest


def test_trainer_demo_with_a_vllm_engine_is_refused_in_one_line():
    out = subprocess.run([sys.executable, "-m", "actors.cli", "demo", "--trainer", "fsdp2", "--engine", "vllm"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert lines == ["weightsync demo: error: --trainer fsdp2 verifies transformers engines; drop --engine vllm"], out.stderr


@pytest.mark.cli
def test_fsdp2_tp_trainer_demo_verifies_every_version_and_writes_the_trainer_json(tmp_path):
    """4 ranks on a (shard 2, tp 2) mesh (FSDP2 over ColwiseParallel q/k/v, RowwiseParallel o), 3 AdamW steps, a
    push after each to 2 engines: every version verified on every engine against PEFT's float64 merge (weights and
    greedy tokens); the JSON has the demo's shape plus the trainer and its mesh; the loss falls."""
    path = tmp_path / "demo.json"
    argv = ["demo", "--trainer", "fsdp2-tp", "--cache-dir", str(tmp_path / "cache"), "--json", str(path)]
    out = subprocess.run([sys.executable, "-m", "actors.cli", *argv], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    doc = json.loads(path.read_text())
    assert doc["ok"] is True and doc["transport"] and doc["model"]["family"] == "qwen3_moe"
    trainer = doc["trainer"]
    assert (trainer["kind"], trainer["world"], trainer["mesh"], len(trainer["loss"])) == (
        "fsdp2-tp", 4, {"shard": 2, "tp": 2}, 3)
    assert all(math.isfinite(loss) and loss > 0 for loss in trainer["loss"])
    assert trainer["loss"][2] < trainer["loss"][1] < trainer["loss"][0], f"the model did not learn: {trainer['loss']}"
    assert [v["version"] for v in doc["versions"]] == [0, 1, 2]
    assert [v["full"] for v in doc["versions"]] == [True, False, False]
    assert all(0 < v["bytes"] and v["verified"] for v in doc["versions"])
    for v in doc["versions"]:
        assert len(v["engines"]) == 2
        for e in v["engines"]:
            assert e["weights_equal_peft_merge"] and e["generations_equal"] and e["weight_version"] == v["version"]
            assert 0 <= e["max_abs_diff"] < 1e-4  # fp32 accumulate vs float64, both cast once to fp32
    assert doc["versions"][1]["bytes"] < doc["versions"][0]["bytes"], "a delta sync sent as much as the full one"
