"""The ``weightsync`` console entry in a subprocess, once per case family: a bad adapter, transport vs
parallelism, flags (engine names, bucket bounds), and an error raised inside a Ray actor. Each ends
in exactly one ``weightsync <cmd>: error:`` line on stderr, no traceback, no colour codes.

Pre-Ray families run with ``RAY_ADDRESS`` pointing at a closed port: had the command reached
``ray.init`` it would fail there with Ray's own message, so our message proves the check came first.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sync_service.synthetic import make_adapter, make_base

pytestmark = pytest.mark.cli
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli")
    base = make_base("qwen3_moe", root / "base")
    lora = make_adapter("qwen3_moe", base, root / "lora", kind="target_parameters")
    nan = root / "nan"
    shutil.copytree(lora, nan)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(nan / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    sd[key][0, 0] = float("nan")
    save_file(sd, str(nan / "adapter_model.safetensors"))
    return {"base": base, "lora": lora, "nan": nan, "root": root}


def weightsync(argv: list[str], *, ray_allowed: bool = False) -> tuple[int, str, float]:
    """Run ``weightsync ARGV`` (the console script of this venv); (exit status, stderr, seconds)."""
    env = {**os.environ, "NO_COLOR": "", "TERM": "xterm-256color"}
    if not ray_allowed:
        env["RAY_ADDRESS"] = "127.0.0.1:1"  # a closed port: any ray.init fails with Ray's own message
    script = Path(sys.executable).with_name("weightsync")
    t0 = time.monotonic()
    done = subprocess.run([str(script), *argv], capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    return done.returncode, done.stderr, time.monotonic() - t0


def one_error_line(stderr: str, command: str) -> str:
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr and "\x1b[" not in stderr, stderr
    errors = [ln for ln in lines if ln.startswith(f"weightsync {command}: error: ")]
    assert len(errors) == 1, stderr
    assert lines[-1] == errors[0], f"the error must be the last line:\n{stderr}"
    return errors[0]


@pytest.mark.parametrize("family,argv,fragments", [
    ("adapter", ["--adapter", "{nan}"], ("--adapter: ", "q_proj.lora_A.weight", "NaN or Inf")),
    ("transport", ["--transport", "torch"], ("--transport torch carries 1 trainer shard(s), got ep·tp = 2",)),
    ("engine", ["--engine", "vllm", "--engines", "2"], ("--engine vllm runs at most 1 engine(s)",)),
    ("bucket", ["--bucket-bytes", str(1 << 40)], ("--bucket-bytes=1099511627776 exceeds", "8 GiB")),
])
def test_sync_refuses_before_ray(files, family, argv, fragments):
    argv = [a.format(**{k: str(v) for k, v in files.items()}) for a in argv]
    rc, err, seconds = weightsync(["sync", "--base", str(files["base"]), *argv])
    line = one_error_line(err, "sync")
    assert rc == 2, err
    for fragment in fragments:
        assert fragment in line, line
    print(f"{family}: refused in {seconds:.1f} s")


def test_actor_error_is_one_line(files):
    """A checkpoint whose ``model.norm.weight`` has one element too many: every pre-Ray check reads
    headers only and passes, the engine actor's transformers load refuses the shape. The error comes
    from inside Ray and reaches the terminal as one line naming the actor's call and the cause, exit 1."""
    import torch
    from safetensors.torch import load_file, save_file

    base = files["root"] / "bad_shape"
    shutil.copytree(files["base"], base)
    sd = load_file(str(base / "model.safetensors"))
    sd["model.norm.weight"] = torch.ones(sd["model.norm.weight"].numel() + 1)
    save_file(sd, str(base / "model.safetensors"), metadata={"format": "pt"})
    rc, err, seconds = weightsync(["sync", "--base", str(base), "--ep", "1", "--engines", "1", "--timeout", "300"], ray_allowed=True)
    line = one_error_line(err, "sync")
    assert rc == 1, err
    assert "RolloutEngineCore.__init__" in line and "ignore_mismatched_sizes" in line, line
    assert seconds < 300, "the actor's death must end the run, not the timeout"
