"""The prepared device check (``scripts/gpu-check.sh``): each check as a ``gpu`` test (skipped without CUDA), and
the whole script on CPU in a subprocess where Ray and vLLM cannot be imported (the GPU machine has neither)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
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
    t = time.monotonic()
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--device", "cpu"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("check ")]
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert [re.match(r"check (\d) \w+: .+ (PASS|FAIL)$", ln).groups() for ln in lines] == \
        [("1", "PASS"), ("2", "PASS"), ("3", "PASS"), ("4", "PASS")], lines
    assert time.monotonic() - t < 180.0  # < 2 min on an idle machine; slack for a loaded 2-core one
    guard = subprocess.run([sys.executable, "-c", "import ray"], env=env, capture_output=True, timeout=60)
    assert guard.returncode != 0  # the guard held: the checks ran without Ray
