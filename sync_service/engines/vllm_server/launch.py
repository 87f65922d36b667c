"""``LocalServer``: start a stock vLLM OpenAI server on this machine (demo, tests, bench).

    with LocalServer.start(model_dir, dtype="bfloat16", timeout_s=300) as server:
        engine = VLLMServerEngine(VLLMServerConfig(url=server.url))

The command line is the documented one (docs/vllm.md, "Updating a running vLLM server"; the test
``tests/vllm/test_doc_command.py`` holds them equal): ``VLLM_SERVER_DEV_MODE=1 VLLM_CPU_OMP_THREADS_BIND=nobind
python -m vllm.entrypoints.openai.api_server --model DIR --dtype D --kv-cache-memory-bytes 1G --enforce-eager
--host 127.0.0.1 --port P --weight-transfer-config '{"backend": "weightsync"}'``, ``--max-logprobs -1`` (full-vocabulary
prompt logprobs for the verification's ``policy_kl``), then this module's own flags (``--seed 0``, ...) (the ``vllm`` console script does not run under the ``vllm-cpu`` distribution). ``with_backend=False`` starts it without the backend (to
show the error a user gets). The server runs from a temporary directory, so no folder of the
caller's working directory shadows an installed package; its output goes to ``log_path``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sync_service.engines.vllm.config import VLLM_ENV
from sync_service.engines.vllm_server.client import ServerClient, ServerError
from sync_service.engines.vllm_server.wire import BACKEND
from sync_service.transports.store import free_port

__all__ = ["CPU_ENV", "KV_CACHE", "LocalServer", "server_command"]

CPU_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": VLLM_ENV["VLLM_CPU_OMP_THREADS_BIND"]}
"""Environment of a CPU server: the RL routes and no core pinning (a server keeps vLLM's own process layout)."""
KV_CACHE = "1G"
"""``--kv-cache-memory-bytes`` of a CPU server: without it vLLM's CPU worker reserves 0.92 of the machine's RAM
and refuses to start when less is free (docs/vllm.md "Memory (CPU)")."""


def server_command(model_dir: str | Path, port: int, *, dtype: str, max_model_len: int | None = None,
                   with_backend: bool = True, api_key: str | None = None, extra_args: tuple[str, ...] = ()) -> list[str]:
    """The argv of a vLLM server on ``127.0.0.1:port`` serving ``model_dir`` (``extra_args`` appended)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", dtype,
           "--kv-cache-memory-bytes", KV_CACHE, "--enforce-eager", "--host", "127.0.0.1", "--port", str(port)]
    if with_backend:
        cmd += ["--weight-transfer-config", json.dumps({"backend": BACKEND})]
    cmd += ["--max-logprobs", "-1"]  # full-vocabulary prompt logprobs: the verification's policy_kl
    cmd += ["--seed", "0"]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd + list(extra_args)


@dataclass(slots=True)
class LocalServer:
    """A vLLM server subprocess. ``url``: its base URL; ``log_path``: its stdout + stderr."""

    url: str
    process: subprocess.Popen
    log_path: Path
    scratch: Path | None = None
    """The log directory ``start`` made itself (no ``log_dir`` given): removed by ``stop``."""

    @classmethod
    def start(cls, model_dir: str | Path, *, dtype: str, timeout_s: float = 300.0, with_backend: bool = True,
              api_key: str | None = None, log_dir: str | Path | None = None, env: dict | None = None,
              extra_args: tuple[str, ...] = ()) -> "LocalServer":
        """Start and wait until ``/health`` answers. Blocks up to ``timeout_s``.

        Raises:
            RuntimeError: the server exited or did not answer in time (the log's tail in the message).
        """
        port = free_port()
        scratch = None if log_dir else Path(tempfile.mkdtemp(prefix="wsvllmserver"))
        log_dir = Path(log_dir or scratch)
        log_path = log_dir / f"vllm-server-{port}.log"
        full_env = {**os.environ, **CPU_ENV, **(env or {})}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(server_command(model_dir, port, dtype=dtype, with_backend=with_backend,
                                                   api_key=api_key, extra_args=extra_args),
                                    cwd=log_dir, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        server = cls(url=f"http://127.0.0.1:{port}", process=proc, log_path=log_path, scratch=scratch)
        server.wait_ready(timeout_s, api_key=api_key)
        return server

    def wait_ready(self, timeout_s: float, *, api_key: str | None = None) -> None:
        client = ServerClient(self.url, api_key=api_key, timeout_s=5.0)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.process.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(f"vLLM server exited with {self.process.returncode}:\n{tail}")
            try:
                client.get("/health")
                return
            except ServerError:
                time.sleep(1.0)
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"vLLM server at {self.url} did not answer /health within {timeout_s:.0f} s:\n{tail}")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server's whole process group (engine core and worker included)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; the process group goes with it, and the log
        directory ``start`` made itself. Idempotent."""
        try:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGTERM)
                try:
                    self.process.wait(timeout=timeout_s)
                    return
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=30)
        finally:
            if self.scratch is not None and self.process.poll() is not None:
                shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
