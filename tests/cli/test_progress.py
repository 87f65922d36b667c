"""Progress bars on a real terminal, nothing elsewhere: ``weightsync merge`` and ``weightsync sync`` run in
a subprocess with stderr on a pseudo-terminal (``os.openpty``, unsized: 0 × 0, as ``script`` from a
non-terminal gives it) and with stderr on a pipe; the commands' ``Steps`` (sync, demo, run, bench) on the
same kind of terminal in this process (no Ray start: the steps are the command's, the bar is one class).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sync_service.synthetic import make_adapter, make_base

pytestmark = pytest.mark.cli
TIMEOUT_S = 300
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("progress")
    base = make_base("qwen3_moe", root / "base", num_experts=4, num_layers=1)
    return {"base": base, "lora": make_adapter("qwen3_moe", base, root / "lora", kind="target_parameters", r=2),
            "root": root}


def weightsync(argv: list[str], *, terminal: bool) -> tuple[int, str, str]:
    """``python -m actors.cli ARGV`` with stderr on a fresh pseudo-terminal (``terminal``) or a pipe;
    (exit status, stdout, stderr as the terminal or the pipe got it)."""
    env = {**os.environ, "TERM": "xterm"}
    env.pop("COLUMNS", None)
    master, slave = os.openpty() if terminal else (None, None)
    proc = subprocess.Popen([sys.executable, "-m", "actors.cli", *argv], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=slave if terminal else subprocess.PIPE, env=env)
    if not terminal:
        out, err = proc.communicate(timeout=TIMEOUT_S)
        return proc.returncode, out.decode(), err.decode()
    os.close(slave)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
        reader.join(30)
    finally:
        os.close(master)
    return proc.returncode, out.decode(), ANSI.sub("", b"".join(chunks).decode(errors="replace"))


def test_merge_draws_its_bar_on_a_terminal_only(files, tmp_path):
    argv = ["merge", "--base", str(files["base"]), "--adapter", str(files["lora"]), "--out"]
    rc, out, term = weightsync([*argv, str(tmp_path / "tty")], terminal=True)
    tensors = json.loads(out)["tensors"]
    assert rc == 0 and f"merge: 100%" in term and f"{tensors}/{tensors}" in term, term
    assert "reading the base and the adapter" in term, term  # the seconds before the merge's own bar
    rc, out, err = weightsync([*argv, str(tmp_path / "pipe")], terminal=False)
    assert rc == 0 and json.loads(out)["tensors"] == tensors
    assert "it/s" not in err and "\r" not in err, err  # no bar off a terminal: one line, once all is checked
    assert re.fullmatch(rf"weightsync merge: read and checked the base and the adapter; merging into "
                        rf"{re.escape(str(tmp_path / 'pipe'))} \(\d+\.\d s in\)\n", err), err


def test_steps_draw_every_step_on_an_unsized_terminal_only(monkeypatch):
    """The bar of ``sync`` / ``demo`` / ``run`` / ``bench`` (``Steps``) on an unsized terminal, and on a pipe."""
    import io

    from sync_service.entrypoints.progress import Steps

    names = ("starting a local Ray (2 CPUs)", "planning, validating the plan", "version 0: verify")
    master, slave = os.openpty()
    with os.fdopen(slave, "w") as tty:
        monkeypatch.setattr(sys, "stderr", tty)
        with Steps(len(names)) as steps:
            for name in names:
                steps.step(name)
    term = []
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:
            break
        if not chunk:
            break
        term.append(chunk.decode())
    os.close(master)
    term = "".join(term)
    for i, name in enumerate(names):
        assert f"{i}/{len(names)} {name}" in term, f"step {i} not drawn: {term!r}"
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    with Steps(len(names), command="weightsync sync") as steps:
        for name in names:
            steps.step(name)
    lines = pipe.getvalue().splitlines()  # off a terminal: one log line per step, no bar
    assert [re.sub(r" \(\d+\.\d s in\)$", "", ln) for ln in lines] == [
        f"weightsync sync: step {i + 1}/{len(names)}: {name}" for i, name in enumerate(names)], lines
    assert "\r" not in pipe.getvalue()
    pipe.truncate(0)
    with Steps(len(names), enabled=False) as steps:  # --no-progress: nothing
        steps.step(names[0])
    assert pipe.getvalue() == ""


def test_a_long_step_ticks_its_elapsed_time_on_a_terminal(monkeypatch):
    """Ray's start or an engine's model load is one step of tens of seconds: the bar redraws while it runs."""
    import select
    import time

    from sync_service.entrypoints import progress

    monkeypatch.setattr(progress, "TICK_S", 0.05)
    master, slave = os.openpty()
    tty = os.fdopen(slave, "w")
    monkeypatch.setattr(sys, "stderr", tty)
    seen = b""
    with progress.Steps(2) as steps:
        steps.step("starting a local Ray (2 CPUs)")
        deadline = time.monotonic() + 60
        while seen.count(b"starting a local Ray") < 3:  # the first draw, then redraws with no step taken
            assert time.monotonic() < deadline, f"no redraw while the step ran: {seen!r}"
            if select.select([master], [], [], 1.0)[0]:
                seen += os.read(master, 1 << 16)
    tty.close()
    os.close(master)
