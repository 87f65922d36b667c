"""``weightsync bench`` on bad input and on SIGTERM: a cache directory that cannot be made is refused in one
line naming the flag (nothing generated); a SIGTERM'd bench cleans up like Ctrl-C: its temp and scratch
directories are gone, exit 130 (was: killed at once, both left behind)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sync_service.entrypoints.cli import EXIT_BAD_INPUT, EXIT_INTERRUPTED, main

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300.0
"""Bound for the bench to make its directories (imports done) on a loaded machine."""


def test_cache_dir_that_cannot_be_made_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    for cache, why in (("/proc/weightsync-bench", "No such file or directory"),
                       (str(tmp_path / "afile" / "sub"), "Not a directory")):
        assert main(["bench", "--quick", "--sizes", "1", "--cache-dir", cache]) == EXIT_BAD_INPUT
        err = capsys.readouterr().err.strip()
        assert err == (f"weightsync bench: error: --cache-dir {cache}: cannot create or write a directory there "
                       f"({why}); give a writable directory"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def _wait_for(predicate, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not predicate():
        assert proc.poll() is None, f"the bench exited ({proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, f"no {what} within {START_TIMEOUT_S} s"
        time.sleep(0.05)


def test_sigterm_cleans_up_like_ctrl_c(tmp_path):
    temp, cache = Path(tempfile.mkdtemp(prefix="w", dir="/tmp")), tmp_path / "cache"  # short: Ray's socket paths
    proc = subprocess.Popen([sys.executable, "-m", "actors.cli", "bench", "--quick", "--sizes", "1", "--cache-dir",
                             str(cache), "--timeout", "300"], cwd=REPO, env={**os.environ, "TMPDIR": str(temp)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # at once: the bench is generating its model, Ray not started yet (whose handler exits 15, cleaning up too)
        _wait_for(lambda: any(temp.glob("wsrun-*/b*")) and any(cache.glob("disk-*")), "its directories", proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
        left = sorted(p.name for p in temp.iterdir())
        shutil.rmtree(temp, ignore_errors=True)
    assert proc.returncode == EXIT_INTERRUPTED and "weightsync bench: interrupted" in err, (proc.returncode, err[-2000:])
    assert left == [] and list(cache.glob("disk-*")) == [], left
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, timeout=30).stdout
    assert str(temp) not in ps, "Ray processes of the bench survived it"
