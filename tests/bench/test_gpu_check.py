"""The prepared device check (``scripts/gpu-check.sh``): each check as a ``gpu`` test (skipped without CUDA), and
the whole script on CPU in a subprocess where Ray and vLLM cannot be imported (the GPU machine has neither)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sync_service.bench.gpu_check import CHECKS, CheckConfig, run_check

ROOT = Path(__file__).resolve().parents[2]
NO_RAY = "import sys\nsys.modules['ray'] = None\nsys.modules['vllm'] = None\n"
"""A ``sitecustomize`` that makes ``import ray`` / ``import vllm`` fail in every process of the run (spawned ones too)."""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("number", sorted(CHECKS), ids=[f.__name__.removeprefix("check_") for _, f in sorted(CHECKS.items())])
def test_gpu_check(number, tmp_path):
    result = run_check(number, CheckConfig(device="cuda", size_bytes=1 << 30, workdir=tmp_path))
    assert result.passed, result.line()


def test_gpu_check_script_passes_on_cpu_without_ray_or_vllm(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(NO_RAY)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--device", "cpu"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("check ")]
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert [re.match(r"check (\d) \w+: .+ (PASS|FAIL)$", ln).groups() for ln in lines] == \
        [("1", "PASS"), ("2", "PASS"), ("4", "PASS"), ("3", "PASS")], lines  # the slowest (3) last
    guard = subprocess.run([sys.executable, "-c", "import ray"], env=env, capture_output=True, timeout=60)
    assert guard.returncode != 0  # the guard held: the checks ran without Ray


def test_a_check_past_its_timeout_is_killed_and_the_next_still_runs(tmp_path):
    """A check that does not finish within --check-timeout (check 3 needs two processes and PEFT merges: far more
    than 1 s) is a FAIL line naming the timeout, its process group is gone, and the check after it still runs."""
    done = subprocess.run([sys.executable, "-m", "sync_service.bench.gpu_check", "--device", "cpu", "--checks", "3,4",
                           "--check-timeout", "1"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("check ")]
    assert done.returncode == 1
    assert re.fullmatch(r"check 3 endpoints: timed out after 1 s .*FAIL", lines[0]), lines
    assert lines[1].startswith("check 4 ") and lines[1].endswith("FAIL")  # 4 alone cannot finish in 1 s either
    assert len(lines) == 2


def test_the_checks_flag_names_what_it_takes():
    done = subprocess.run([sys.executable, "-m", "sync_service.bench.gpu_check", "--device", "cpu", "--checks", "5"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--checks='5': give check numbers from [1, 2, 3, 4]" in done.stderr
