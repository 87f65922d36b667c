"""``weightsync demo --trainer``: bad combinations fail in one line before Ray starts."""

from __future__ import annotations

import subprocess
import sys


def test_trainer_demo_with_a_vllm_engine_is_refused_in_one_line():
    out = subprocess.run([sys.executable, "-m", "actors.cli", "demo", "--trainer", "fsdp2", "--engine", "vllm"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert lines == ["weightsync demo: error: --trainer fsdp2 verifies transformers engines; drop --engine vllm"], out.stderr
