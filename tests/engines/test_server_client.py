"""The vLLM-server engine's wire and HTTP client, without vLLM: init body, command authentication,
and the errors a user sees for a wrong URL, a server without the RL routes or a wrong API key
(a real stdlib HTTP server on loopback plays the server)."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from sync_service.engines.vllm_server.client import (
    ServerClient, ServerRequestError, ServerSetupError, ServerUnreachableError,
)
from sync_service.engines.vllm_server.engine import VLLMServerConfig, VLLMServerEngine
from sync_service.transports.store import free_port
from sync_service.engines.vllm_server.wire import InitInfo, command_body, verify_command

SECRET = b"k" * 32


def test_init_info_round_trip_and_secret_not_in_repr() -> None:
    info = InitInfo.make(b"spec-bytes", b"plan-bytes", 3, SECRET)
    back = InitInfo(**json.loads(json.dumps(info.to_json())))
    assert back.decoded() == (b"spec-bytes", b"plan-bytes", 3, SECRET)
    assert info.secret not in repr(info) and "secret" not in repr(info)
    with pytest.raises(ValueError, match="receiver"):
        InitInfo(spec="", plan="", receiver=-1).decoded()
    with pytest.raises(ValueError, match="not base64"):
        InitInfo(spec="@@", plan="", receiver=0).decoded()


def test_commands_need_the_session_secret_and_a_fresh_nonce() -> None:
    body = command_body(SECRET, "abort", 7)
    assert verify_command(SECRET, "abort", body, 6) == 7
    with pytest.raises(PermissionError, match="already used"):
        verify_command(SECRET, "abort", body, 7)
    with pytest.raises(PermissionError, match="mac"):
        verify_command(b"x" * 32, "abort", body, 0)
    with pytest.raises(PermissionError, match="mac"):
        verify_command(SECRET, "status", body, 0)  # a mac binds its op
    with pytest.raises(PermissionError, match="no authenticated session"):
        verify_command(None, "abort", body, 0)


def test_unreachable_url_fails_within_the_timeout() -> None:
    client = ServerClient(f"http://127.0.0.1:{free_port()}", timeout_s=5.0)
    t0 = time.monotonic()
    with pytest.raises(ServerUnreachableError, match="unreachable"):
        client.get("/health")
    assert time.monotonic() - t0 < 5.0 + 5.0
    with pytest.raises(ValueError, match="http://"):
        ServerClient("127.0.0.1:8000")


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        if self.headers.get("Authorization") != "Bearer right":
            self._answer(401, {"error": "Unauthorized"})
        elif self.path.startswith("/weight_info"):
            self._answer(404, {"detail": "Not Found"})
        elif self.path.startswith("/server_info"):
            self._answer(200, [1, 2])  # JSON, but not vLLM's object
        elif self.path.startswith("/html"):
            self._answer(200, None, raw=b"<html>some other web app</html>")
        else:
            self._answer(500, {"error": {"message": "boom in the worker"}})

    def _answer(self, status: int, body: object, raw: bytes | None = None) -> None:
        raw = json.dumps(body).encode() if raw is None else raw
        self.send_response(status)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def http_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_errors_name_the_fix(http_server: str) -> None:
    with pytest.raises(ServerSetupError, match="--api-key"):
        ServerClient(http_server, api_key="wrong", timeout_s=10).get("/weight_info")
    good = ServerClient(http_server, api_key="right", timeout_s=10)
    with pytest.raises(ServerSetupError, match="VLLM_SERVER_DEV_MODE=1"):
        good.get("/weight_info")
    with pytest.raises(ServerRequestError, match="boom in the worker"):
        good.get("/other")
    assert "right" not in repr(good)


def test_keep_pause_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="KEEP"):
        VLLMServerConfig(url="http://127.0.0.1:1", pause_mode="keep")
    assert "key" not in repr(VLLMServerConfig(url="http://127.0.0.1:1", api_key="key"))


def test_a_url_that_is_not_a_vllm_server_is_named(http_server: str) -> None:
    """An answer that is not JSON, or JSON that is not vLLM's object, is a ServerError naming the URL
    (``weightsync sync --vllm-url`` prints it in one line), never a decode or attribute error."""
    good = ServerClient(http_server, api_key="right", timeout_s=10)
    with pytest.raises(ServerRequestError, match=r"GET /html: the answer is not JSON .*vLLM server"):
        good.get("/html")
    with pytest.raises(ServerSetupError, match=r"/server_info answered list, not an object"):
        VLLMServerEngine(VLLMServerConfig(url=http_server, api_key="right", timeout_s=10))


@pytest.mark.parametrize("urls, engines, message", [
    (["http://127.0.0.1:1", "http://127.0.0.1:1"], None, "--vllm-url http://127.0.0.1:1 given twice"),
    (["http://127.0.0.1:1"], 2, "--engines 2 != 1 --vllm-url server(s)"),
])
def test_repeated_url_or_contradicting_engines_refused_unconnected(urls, engines, message, capsys) -> None:
    """Refused before any server is contacted (port 1: a connection would say 'unreachable' instead)."""
    import argparse

    from sync_service.entrypoints.preflight_vllm_server import check_servers

    args = argparse.Namespace(command="sync", engine="vllm-server", vllm_urls=urls, engines=engines,
                              vllm_api_key=None, timeout=5.0)
    with pytest.raises(SystemExit) as info:
        check_servers(args)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("weightsync sync: error: ") and message in err, err


def test_url_credentials_refused_and_never_echoed(capsys) -> None:
    """A ``user:password@`` URL is refused before any connection, the password in no message."""
    import argparse

    from sync_service.entrypoints.preflight_vllm_server import check_servers

    with pytest.raises(ValueError, match="carries credentials") as info:
        ServerClient("http://alice:hunter2@127.0.0.1:1")
    assert "hunter2" not in str(info.value) and "***@127.0.0.1:1" in str(info.value)
    args = argparse.Namespace(command="sync", engine="vllm-server", vllm_urls=["http://alice:hunter2@127.0.0.1:1"],
                              engines=None, vllm_api_key=None, timeout=5.0)
    with pytest.raises(SystemExit) as exit_info:
        check_servers(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "carries credentials" in err and "hunter2" not in err, err


LOGITS = [[0.0, 1.0, 2.0, 3.0], [3.0, -1.0, 0.5, 0.0]]  # next-token logits after positions 0 and 1 of [2, 0, 1]


class _LogprobHandler(_Handler):
    """A server answering what ``token_logprobs`` asks: the table (vocab 4), the version, and prompt logprobs over
    the whole vocabulary — or, on a server whose path says ``limited``, vLLM's refusal of a too-large request."""

    def do_GET(self) -> None:  # noqa: N802
        from sync_service.engines.vllm_server.wire import BACKEND

        if self.path.startswith("/server_info"):
            self._answer(200, {"vllm_config": {"weight_transfer_config": {"backend": BACKEND}, "model_config": {"model": "m"}}})
        else:
            self._answer(200, {"weight_version": "3"})

    def do_POST(self) -> None:  # noqa: N802
        import torch

        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path.startswith("/collective_rpc"):
            self._answer(200, {"results": [[["lm_head.weight", "float32", [4, 8]]]]})
        elif self.server.limited:
            self._answer(400, {"error": {"message": "Requested prompt logprobs of 4, which is greater than max allowed: "
                                                    "20"}})
        else:
            assert body["prompt_logprobs"] == -1 and body["prompt"] == [2, 0, 1], body
            rows = [None] + [{str(i): {"logprob": float(v), "rank": 1, "decoded_token": "x"}
                              for i, v in enumerate(torch.log_softmax(torch.tensor(row), -1).tolist())} for row in LOGITS]
            self._answer(200, {"choices": [{"index": 0, "prompt_logprobs": rows}]})


@pytest.mark.parametrize("limited", [False, True])
def test_token_logprobs_over_http(limited: bool, capsys) -> None:
    """The server's full-vocabulary prompt logprobs (``/v1/completions``, ``prompt_logprobs: -1``) become one
    ``[len - 1, vocab]`` log-softmax matrix per sequence with the version served; a server started without
    ``--max-logprobs -1`` (vLLM refuses the request) reads as an engine with no logprobs (``TypeError``, which
    ``policy_check`` reports as ``policy_kl: null``), naming the flag; ``policy_check`` says so once on stderr."""
    import torch

    from sync_service.verify.policy_kl import warn_logprobs_refused

    from actors.vllm_server import VLLMServerActorCore

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _LogprobHandler)
    server.limited = limited
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        actor = VLLMServerActorCore(VLLMServerConfig(url=f"http://127.0.0.1:{server.server_address[1]}", timeout_s=10))
        if limited:
            with pytest.raises(TypeError, match=r"greater than max allowed: 20.*start it with --max-logprobs -1") as err:
                actor.token_logprobs([[2, 0, 1]])
            capsys.readouterr()
            assert warn_logprobs_refused(err.value) and not warn_logprobs_refused(err.value)  # once per server
            (line,) = capsys.readouterr().err.splitlines()
            assert f"the vLLM server at {actor.engine.config.url} refuses" in line and "--max-logprobs -1" in line
            assert not warn_logprobs_refused(TypeError("engine reports no logprobs"))  # other engines: silent
            return
        (got,), version = actor.token_logprobs([[2, 0, 1]])
        assert version == 3 and got.shape == (2, 4)
        assert torch.allclose(torch.from_numpy(got), torch.log_softmax(torch.tensor(LOGITS), -1), atol=1e-6)
    finally:
        server.shutdown()
        server.server_close()
