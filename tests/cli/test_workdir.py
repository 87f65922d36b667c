"""The commands' temporary directories live under one per-run directory per process, and a later
run removes those whose owner is gone: a driver killed by SIGKILL once left its temp directories
(57 MB) in the system temp directory for good."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from sync_service.entrypoints import workdir

CHILD = """
import sys, time
from sync_service.entrypoints.workdir import run_dir
d = run_dir("wsync", root=sys.argv[1])
(d / "model.safetensors").write_bytes(b"x" * 4096)
print(d, flush=True)
time.sleep(60)
"""


def test_sigkilled_owner_swept_live_and_foreign_kept(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        left = Path(child.stdout.readline().strip())
        assert (left / "model.safetensors").is_file()
        assert workdir.sweep_stale(tmp_path) == [], "swept while its owner runs"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    mine = workdir.run_dir("wsrun", root=tmp_path)
    assert mine.parent.name.startswith(f"{workdir.RUN_PREFIX}{workdir._b36(os.getpid())}-")
    assert not left.parent.exists(), "the killed driver's per-run directory survived the next run"
    start = int(re.fullmatch(r"wsrun-[0-9a-z]+-([0-9a-z]+)", mine.parent.name).group(1), 36)
    recycled = tmp_path / f"{workdir.RUN_PREFIX}{workdir._b36(os.getpid())}-{workdir._b36(start - 1000)}"  # this pid, another start
    recycled.mkdir()
    (recycled / workdir.MARKER).touch()
    other = tmp_path / "wsrun-notes"  # not a per-run directory name
    other.mkdir()
    unmarked = tmp_path / f"{workdir.RUN_PREFIX}1-1"  # the name of a gone owner, but no marker: not ours
    unmarked.mkdir()
    assert workdir.sweep_stale(tmp_path) == [recycled]
    assert mine.is_dir() and other.is_dir() and unmarked.is_dir()


def test_ray_socket_paths_under_a_run_dir_fit_af_unix():
    """Ray's plasma socket lives at <_temp_dir>/session_<date>_<pid>/sockets/plasma_store; an AF_UNIX path
    holds at most 107 bytes (a longer per-run name once failed every ``weightsync sync`` at Ray's start)."""
    ray_dir = workdir.ray_temp(workdir.run_dir("vsrv"))
    try:
        socket = ray_dir / "session_2026-12-03_15-32-14_417624_32768" / "sockets" / "plasma_store"
        assert len(str(socket)) <= 107, socket
    finally:
        import shutil
        shutil.rmtree(ray_dir.parent)


def test_commands_make_temp_dirs_only_through_workdir():
    """Every ``mkdtemp`` of the commands (sync, run, demos, RL demo, bench) is a ``run_dir``."""
    root = Path(workdir.__file__).parents[1]
    users = [p for pkg in ("entrypoints", "bench") for p in (root / pkg).rglob("*.py")
             if "mkdtemp(" in p.read_text() and p.name != "workdir.py"]
    assert [str(p.relative_to(root)) for p in users] == ["bench/run.py"]  # its disk row's dir under --cache-dir
    assert "mkdtemp(prefix=\"wsb\")" not in users[0].read_text()


def test_a_temp_dir_too_long_for_rays_sockets_is_refused_naming_tmpdir(tmp_path, monkeypatch):
    import tempfile

    import pytest

    short = workdir.ray_temp(Path("/tmp/wsrun-69n-mx9uuqby/sync480hnc2k"))  # the default's length fits
    assert short.name == "r"
    monkeypatch.setattr(workdir, "pid_max", lambda: 32768)
    assert workdir.socket_budget() == (62, 34, 11)
    monkeypatch.setattr(tempfile, "tempdir", "/tmp/" + "x" * 6)  # 11 bytes: fits
    workdir.check_temp_dir()
    monkeypatch.setattr(tempfile, "tempdir", "/tmp/" + "x" * 7)
    with pytest.raises(ValueError, match=r"TMPDIR /tmp/x{7} \(12 bytes\) is too long .* Ray's names take 62 and "
                                         r"weightsync's run directory 34 at this machine's pid_max 32768; set TMPDIR "
                                         r"to a directory of at most 11 bytes, e\.g\. /tmp"):
        workdir.ray_temp(Path("/tmp/" + "x" * 7) / "wsrun-69n-mx9uuqby" / "sync480hnc2k")
    monkeypatch.setattr(workdir, "pid_max", lambda: 1 << 22)
    assert workdir.socket_budget() == (64, 36, 7)


def test_the_readme_states_the_tmpdir_bound_the_code_computes(monkeypatch):
    """The README said ~12 bytes while an 11-byte TMPDIR was refused as 'at most 9'."""
    import re

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    stated = re.search(r"a `TMPDIR` longer than (\d+) bytes \(where\s+`/proc/sys/kernel/pid_max` is (\d+); (\d+) bytes "
                       r"where it is (\d+)\)", readme)
    assert stated, "the README no longer states the TMPDIR bound"
    for room, pids in ((stated.group(1), stated.group(2)), (stated.group(3), stated.group(4))):
        monkeypatch.setattr(workdir, "pid_max", lambda pids=pids: int(pids))
        assert workdir.socket_budget()[2] == int(room), (room, pids)
