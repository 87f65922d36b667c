"""docs/vllm.md's server command is the one the tests' servers run.

``LocalServer`` (``sync_service/engines/vllm_server/launch.py``) starts every vLLM server of the tests — the shared
``vllm_server`` of tests/vllm, the bf16 servers of test_server.py, ``weightsync demo --engine vllm-server`` — so
the documented line starts and answers there whenever they do. This test holds the two equal: the doc's
environment is ``CPU_ENV`` and its argv (``python`` as this interpreter, ``BASE_DIR`` and the port filled in) is
the first part of ``server_command``'s, which only appends its own flags (``--seed``, ``--max-model-len``, a
test's extras). No server starts here.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from sync_service.engines.vllm_server.launch import CPU_ENV, server_command

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
BLOCK = re.compile(r"<!-- vllm-server-command:begin -->\n```bash\n(.*?)```\n<!-- vllm-server-command:end -->", re.S)


def _documented() -> tuple[dict[str, str], list[str]]:
    """The doc's command: its leading ``NAME=value`` words and the argv after them."""
    blocks = BLOCK.findall(DOC.read_text())
    assert len(blocks) == 1, "docs/vllm.md: one vllm-server-command block"
    words = shlex.split(blocks[0].replace("\\\n", " "))
    env = {}
    while re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def test_the_tests_servers_run_the_documented_command(tmp_path: Path) -> None:
    env, argv = _documented()
    assert env == CPU_ENV
    assert argv[0] == "python" and "BASE_DIR" in argv and "8000" in argv
    filled = [sys.executable] + [{"BASE_DIR": str(tmp_path), "8000": "8123"}.get(w, w) for w in argv[1:]]
    dtype = argv[argv.index("--dtype") + 1]
    ran = server_command(tmp_path, 8123, dtype=dtype, max_model_len=128, extra_args=("--block-size", "32"))
    assert ran[:len(filled)] == filled, (ran, filled)
    assert ran[len(filled):] == ["--seed", "0", "--max-model-len", "128", "--block-size", "32"]
    assert filled[filled.index("--max-logprobs") + 1] == "-1"  # else policy_kl is null (docs/operations.md)
    assert "--kv-cache-memory-bytes" in filled  # without it vLLM's CPU worker reserves 0.92 of the RAM at start
