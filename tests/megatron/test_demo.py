"""``weightsync demo --trainer megatron | megatron-pp`` end to end in a subprocess (its own Ray, 4 Megatron-Core ranks,
2 HF engines): 3 AdamW steps over Megatron's own forward / backward, a push after each, every version verified on
every engine against Megatron's own forward of the unmerged LoRA model at the trainer's parallelism; the JSON's
values asserted. And the one-line error where the Megatron stack is not importable."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

MESHES = {"megatron": {"tp": 2, "ep": 2, "etp": 2, "pp": 1, "dp": 2},
          "megatron-pp": {"tp": 2, "ep": 2, "etp": 1, "pp": 2, "dp": 1}}
BOUND = 1e-5  # fp32 next-token log-probabilities (measured 1.6e-6 - 2.6e-6, 2026-12-05)


@pytest.mark.cli
@pytest.mark.parametrize("kind", sorted(MESHES))
def test_megatron_demo_verifies_every_version_against_megatrons_forward(kind, tmp_path):
    path = tmp_path / "demo.json"
    argv = ["demo", "--trainer", kind, "--cache-dir", str(tmp_path / "cache"), "--json", str(path)]
    out = subprocess.run([sys.executable, "-m", "actors.cli", *argv], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    doc = json.loads(path.read_text())
    assert doc["ok"] is True and doc["model"]["family"] == "qwen3_moe"
    trainer, verify = doc["trainer"], doc["verify"]
    assert (trainer["kind"], trainer["world"], trainer["mesh"], len(trainer["loss"])) == ("megatron", 4, MESHES[kind], 3)
    assert all(math.isfinite(loss) and loss > 0 for loss in trainer["loss"])
    assert trainer["loss"][2] < trainer["loss"][1] < trainer["loss"][0], f"the model did not learn: {trainer['loss']}"
    assert verify["oracle"] == "megatron-forward" and verify["logprob_bound"] == BOUND
    # the oracle tells versions apart: a stale engine would be off by far more than the bound
    assert len(verify["oracle_moved"]) == 2 and min(verify["oracle_moved"]) > 1000 * BOUND, verify["oracle_moved"]
    assert [v["version"] for v in doc["versions"]] == [0, 1, 2]
    assert [v["full"] for v in doc["versions"]] == [True, False, False]
    assert doc["versions"][1]["bytes"] < doc["versions"][0]["bytes"], "a delta sync sent as much as the full one"
    for v in doc["versions"]:
        assert v["verified"] and len(v["engines"]) == 2
        for e in v["engines"]:
            assert e["verified"] and e["oracle"] == "megatron-forward" and e["weight_version"] == v["version"]
            assert 0 <= e["logprob_max_abs_diff"] <= BOUND and e["greedy_tokens_equal"] is True, e


def test_without_the_megatron_stack_one_line_naming_the_set_up_step(tmp_path):
    """Megatron hidden from the interpreter (as after a set-up with WEIGHTSYNC_MEGATRON=0): exit 2, one line, before
    Ray starts."""
    code = ("import sys; sys.modules['megatron'] = None; from actors.cli import main; "
            f"sys.exit(main(['demo', '--trainer', 'megatron', '--cache-dir', {str(tmp_path / 'c')!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("weightsync demo: error: --trainer megatron needs Megatron-Core")
    assert "scripts/setup-megatron.sh" in lines[0]
