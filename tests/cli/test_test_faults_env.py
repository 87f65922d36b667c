"""The ``weightsync`` commands never run with the engines' test-only fault hook armed: ``$WEIGHTSYNC_TEST_FAULTS``
left exported from a test session is dropped from the command's environment (which every local Ray worker, engine
and vLLM server it starts inherits) with one line on stderr."""

from __future__ import annotations

import os

from sync_service.engines import faults
from sync_service.entrypoints.cli import main


def test_a_command_drops_the_fault_hooks_variable_before_it_starts_anything(tmp_path, monkeypatch, capsys):
    path = tmp_path / "faults.json"
    faults.arm(path, {"drop": ["model.norm.weight"]})
    monkeypatch.setenv(faults.ENV, str(path))
    code = main(["merge", "--no-progress", "--base", str(tmp_path / "absent"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2  # the command itself ran (and refused its input)
    assert faults.ENV not in os.environ and faults.armed() == {}
    assert f"weightsync merge: ignoring ${faults.ENV}" in err.splitlines()[0], err


def test_without_the_variable_nothing_is_said(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(faults.ENV, raising=False)
    main(["merge", "--no-progress", "--base", str(tmp_path / "absent"), "--out", str(tmp_path / "out")])
    assert faults.ENV not in capsys.readouterr().err
