"""Test-only faults in an engine's apply path: the bytes an engine stages differ from the bytes it was handed.

Off unless the process's environment names a fault file (``WEIGHTSYNC_TEST_FAULTS=/path/faults.json``); nothing
here runs otherwise (``Staging.begin`` reads one environment variable). The served check's fault tests
(``tests/engines/test_served_check.py``, ``tests/vllm/``) arm it to show that ``SyncConfig.check_served="enforce"``
refuses such a version on every engine kind; a process started without the variable (every production engine)
never reads a fault file, and the ``weightsync`` commands drop it from their environment before any engine, Ray
worker or vLLM server inherits it (``entrypoints/cli.py``).

Where: ``engines.staging.Staging.apply``, the copy every engine's ``apply`` ends in — the transformers and memory
engines' staging, and the vLLM worker's checkpoint store (``engines.vllm.store``: a vLLM engine in process and a
vLLM server's worker, which inherits the server's environment). So a fault lands after the bucket's xxh3_64 / HMAC
were verified and after the served check recorded what the engine was handed, as a bug in an engine's copy or
conversion would.

The file (read once per sync, at ``Staging.begin``, so a test arms and disarms it between pushes; absent: no
fault): ``{"corrupt": [name, ...], "drop": [name, ...]}``, names in the staging's naming (the engine table's:
hf-fused for transformers / memory, the checkpoint's ``hf`` naming in a vLLM worker).

- ``corrupt``: after the copy of each box of the name, the lowest bit of the box's first byte is flipped.
- ``drop``: the box is not copied but counted as applied (an engine that lost a tensor while believing it
  applied it, as a dropped routed expert): the staging keeps whatever it held.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from protocols.params import Box

__all__ = ["ENV", "KINDS", "MAX_FILE_BYTES", "arm", "armed", "inject"]

ENV = "WEIGHTSYNC_TEST_FAULTS"
"""The environment variable naming the fault file (unset: no fault can be armed in this process)."""
KINDS = ("corrupt", "drop")


MAX_FILE_BYTES = 1 << 20
"""The largest fault file read (a fault file lists a few tensor names)."""


def armed() -> dict[str, str]:
    """Name → fault kind, from the file ``$WEIGHTSYNC_TEST_FAULTS`` names (``{}``: unset, or no file).

    Only an absolute path to a regular file of at most ``MAX_FILE_BYTES`` is read (opened non-blocking, so a FIFO
    or a device such as ``/dev/zero`` is refused, never waited on or read without end).

    Raises:
        ValueError: the path is not absolute, not a regular file, is larger than ``MAX_FILE_BYTES``, is not UTF-8
            JSON, or is not ``{kind: [names]}`` with kinds of ``KINDS`` and string names.
    """
    path = os.environ.get(ENV)
    if not path:
        return {}
    fix = f"write it with engines.faults.arm or unset {ENV}"
    if not os.path.isabs(path):  # each process (a vLLM server's worker too) would resolve it from its own cwd
        raise ValueError(f"{ENV}={path}: not an absolute path; {fix}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ValueError(f"{ENV}={path}: cannot open the fault file ({exc.strerror}); {fix}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{ENV}={path}: not a regular file; {fix}")
        raw = os.read(fd, MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"{ENV}={path}: larger than {MAX_FILE_BYTES} bytes, not a fault file; {fix}")
    try:
        spec = json.loads(raw.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"{ENV}={path}: not UTF-8 JSON ({exc}); {fix}") from None
    if (not isinstance(spec, dict) or set(spec) - set(KINDS)
            or not all(isinstance(v, list) and all(isinstance(n, str) for n in v) for v in spec.values())):
        raise ValueError(f"{ENV}={path}: expected {{kind: [tensor names]}} with kinds {KINDS}, got {spec!r:.200}; "
                         f"{fix}")
    return {name: kind for kind, names in spec.items() for name in names}


def arm(path: str | Path, faults: Mapping[str, Iterable[str]] | None) -> None:
    """Write the fault file at ``path`` (``faults``: kind → names); ``None`` or empty removes it (disarmed)."""
    path = Path(path)
    if not faults:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({kind: list(names) for kind, names in faults.items()}))
    tmp.replace(path)  # a reader sees the old file or the new one, never half of one


def inject(kind: str, buffer: torch.Tensor, box: Box, data: torch.Tensor) -> None:
    """Apply ``data`` to ``box`` of ``buffer`` as fault ``kind`` would (``Staging.apply`` calls it for an armed name)."""
    region = buffer[tuple(slice(a, b) for a, b in box)]
    if kind == "drop" or region.numel() == 0:
        return
    region.copy_(data)
    first = buffer[tuple(slice(a, a + 1) for a, _ in box)]
    flipped = first.clone()
    flipped.view(torch.uint8).view(-1)[0] ^= 0x01
    first.copy_(flipped)
