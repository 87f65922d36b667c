"""The test-only fault hook's file (``engines.faults.armed``) read safely: only a regular, small, UTF-8 JSON file of
``{kind: [names]}``; anything else is one ValueError naming ``WEIGHTSYNC_TEST_FAULTS`` and the fix, never a hang,
an unbounded read or a raw decoder error."""

from __future__ import annotations

import os

import pytest

from sync_service.engines import faults


@pytest.fixture
def env(monkeypatch):
    def point(path):
        monkeypatch.setenv(faults.ENV, str(path))
    return point


def test_a_written_fault_file_arms_its_names(tmp_path, env):
    path = tmp_path / "faults.json"
    faults.arm(path, {"corrupt": ["a.weight"], "drop": ["b.weight"]})
    env(path)
    assert faults.armed() == {"a.weight": "corrupt", "b.weight": "drop"}
    env(tmp_path / "absent.json")
    assert faults.armed() == {}


@pytest.mark.parametrize("make", ["fifo", "device", "directory", "binary", "huge", "nested_name", "relative"])
def test_a_path_that_is_no_fault_file_is_refused_in_one_error(tmp_path, env, make):
    path = tmp_path / "faults.json"
    if make == "fifo":
        os.mkfifo(path)  # opening it blocking would wait for a writer forever
    elif make == "device":
        path = "/dev/zero"  # read_text() would read without end
    elif make == "directory":
        path.mkdir()
    elif make == "binary":
        path.write_bytes(b"\xff\xfe\x00")
    elif make == "huge":
        path.write_text('{"corrupt": [' + ",".join(['"x"'] * (faults.MAX_FILE_BYTES // 4 + 1)) + "]}")
    elif make == "relative":  # resolved from each process's own cwd: a server would silently arm nothing
        path = "faults.json"
    else:
        path.write_text('{"corrupt": [["a.weight"]]}')
    env(path)
    with pytest.raises(ValueError, match=f"^{faults.ENV}=.*(unset {faults.ENV}|arm)"):
        faults.armed()
