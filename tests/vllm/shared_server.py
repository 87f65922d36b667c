"""The vLLM server the tests share (``tests/vllm/conftest.py``'s ``vllm_server`` fixture): one weightsync-backed server.

A server start costs about a minute on a loaded 2-core machine (three processes import vLLM), so the
tests that need "a stock vLLM server with the weightsync backend" share one (``vllm_server``):

    def test_mine(vllm_server, ray_local):
        from actors.vllm_server import VLLMServer
        engine = VLLMServer(vllm_server.url, name="server0")
        first = vllm_server.next_version()      # versions continue across tests: push first, first + 1, ...
        trainers = start_trainers(vllm_server.base, my_adapter, ep=2)   # the checkpoint it was started on
        ...

What it serves: ``SERVER_DTYPE`` (float32) ``SharedServer.base`` (a synthetic Qwen3-MoE: H=64, I=32, E=4,
2 layers, vocab 128) with ``SERVER_ARGS``. Started on the first test that asks for it, stopped after
the last test of the session that asks for it (not held idle through the rest of the suite).

Between tests: every test gets an idle server — not paused, no weight-transfer channel open, no sync
received and uncommitted, prefix cache empty; a server a test left otherwise (a failed test), killed
or dead is replaced by a fresh one on ``base`` (``starts`` lists every start). Not reset: the served weights and version. A
test sees whatever the tests before it committed, so it pushes versions from ``next_version()`` on,
makes its first push a full one (a new ``WeightSync``'s first push is), and compares served outputs
only after its own pushes (or reads ``complete`` first and compares with that). A test that kills the
server (a fault test) calls ``restart()`` for its replacement, which the later tests then share.

Faults in the server's apply path: every start runs with ``WEIGHTSYNC_TEST_FAULTS`` naming ``fault_file`` (the
test-only hook of ``sync_service/engines/faults.py``, which the server's worker inherits); no fault is armed while
that file is absent. A test arms one with ``arm_fault({"corrupt": [name]})`` and disarms it with
``arm_fault(None)`` (``clean`` disarms between tests).
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

SERVER_DTYPE = "float32"
SERVER_ARGS = ("--max-model-len", "128", "--block-size", "32",
               "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens: the prefix cache is visible
               "--enable-scale-out")  # mounts /inference/v1/generate, which reports weight versions per token
"""Flags of the shared server (and of any fresh server a test compares it with: same numerics)."""
START_TIMEOUT_S = 600.0
"""Bound of one server start: a loaded 2-core machine starts one in 30-150 s."""


def shared_base(root: Path) -> Path:
    """The shared server's checkpoint (float32 Qwen3-MoE, H=64, I=32, E=4, vocab 128) under ``root``."""
    from sync_service.synthetic import make_base

    return Path(make_base("qwen3_moe", root / "base", dtype=SERVER_DTYPE, hidden=64, intermediate=32, num_experts=4,
                          vocab_size=128, scale=0.1))


@dataclass
class SharedServer:
    """The session's weightsync-backed vLLM server (see the module docstring).

    Attributes:
        base: the checkpoint every start serves first (``shared_base``).
        log_dir: where each start's log goes (``vllm-server-<port>.log``).
        starts: the URL of every start, in order (more than one: a test's ``restart``, or a server found
            dead or unclean between tests).
    """

    base: Path
    log_dir: Path
    server: object | None = None
    starts: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.ensure().url

    @property
    def log_path(self) -> Path:
        return self.ensure().log_path

    @property
    def fault_file(self) -> Path:
        """The fault file the server's worker reads at each sync's begin (module docstring)."""
        return self.log_dir / "faults.json"

    def arm_fault(self, faults: dict | None) -> None:
        """Arm test-only faults in the server's apply path for the next syncs (``engines.faults.arm``: kind →
        tensor names in the checkpoint naming); ``None`` disarms."""
        from sync_service.engines.faults import arm

        arm(self.fault_file, faults)

    def ensure(self):
        """The running server (``LocalServer``), started on ``base`` if there is none or it died."""
        from sync_service.engines.vllm_server.launch import LocalServer

        if self.server is not None and self.server.process.poll() is None:
            return self.server
        self.stop()
        from sync_service.engines.faults import ENV

        self.server = LocalServer.start(self.base, dtype=SERVER_DTYPE, timeout_s=START_TIMEOUT_S, log_dir=self.log_dir,
                                        env={ENV: str(self.fault_file)}, extra_args=SERVER_ARGS)
        self.starts.append(self.server.url)
        return self.server

    def kill(self) -> None:
        """SIGKILL the server (its whole process group); the next ``url`` / ``ensure`` starts a new one."""
        if self.server is not None:
            self.server.kill()

    def restart(self):
        """Stop the server (if it runs) and start a fresh one on ``base``; returns it (``LocalServer``)."""
        self.stop()
        return self.ensure()

    def version(self) -> int | None:
        """The weight version the server serves (``/weight_info``; ``None`` before its first commit)."""
        v = self._get("/weight_info").get("weight_version")
        return int(v) if v is not None and str(v).lstrip("-").isdigit() else None

    def next_version(self) -> int:
        """The first version a test may push: one above the served one (0 on a server that never committed)."""
        v = self.version()
        return 0 if v is None else v + 1

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    # -- between tests ---------------------------------------------------------------------------
    def clean(self) -> None:
        """Leave the server idle for the next test: channel closed, prefix cache reset. A server that died, is
        paused, or holds a received, uncommitted sync (only a failed test leaves that) is stopped; the next
        ``url`` starts a fresh one."""
        self.arm_fault(None)
        if self.server is None:
            return
        if self.server.process.poll() is not None or not self._idle():
            self.stop()
            return
        for route in ("/shutdown_weight_transfer_engine", "/reset_prefix_cache"):
            self._post(route)

    def _idle(self) -> bool:
        from sync_service.engines.vllm_server.wire import COMMAND_METHOD

        try:
            if self._get("/is_paused").get("is_paused"):
                return False
            answer = self._post("/collective_rpc", {"method": COMMAND_METHOD, "args": ["status", ""]})
            status = ((answer or {}).get("results") or [{}])[0] or {}
            return status.get("received") is None
        except Exception:  # noqa: BLE001 - a server that cannot answer is not idle: replaced
            return False

    def _get(self, route: str) -> dict:
        with urllib.request.urlopen(f"{self.url}{route}", timeout=60) as answer:
            return json.loads(answer.read() or b"{}")

    def _post(self, route: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(f"{self.url}{route}", data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as answer:
            return json.loads(answer.read() or b"{}")
