"""The runnable files under examples/ that docs/integrate.md points to run as written (tiny sizes): each is run as
a user runs it, ``python examples/<file>``, in its own process with its own Ray, and checks what the engine
serves itself (a mismatch exits 1)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(400)
def test_fsdp2_loop_pushes_what_the_ranks_hold() -> None:
    """2 FSDP2 ranks, 2 steps: the engine serves version k after push k, and its q_proj equals W + s·B@A of the
    ranks' DTensors (gathered by every rank: ``full_tensor`` is collective)."""
    tmp = tempfile.mkdtemp(prefix="wsex", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    try:
        proc = subprocess.run([sys.executable, "examples/fsdp2_loop.py", "--steps", "2"], cwd=REPO, capture_output=True,
                              text=True, timeout=360, env={**os.environ, "TMPDIR": tmp})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = re.findall(r"^step (\d): .*\((full|delta)\), engine serves version (\d), .* = (\S+): ok$", proc.stdout, re.M)
    assert [(s, kind, v) for s, kind, v, _ in lines] == [("0", "full", "0"), ("1", "delta", "1")], proc.stdout
    assert all(float(diff) == 0.0 for *_, diff in lines), proc.stdout
