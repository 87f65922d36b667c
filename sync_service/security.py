"""The per-session secret that authenticates every bucket of a weight sync.

Every ``BucketHeader`` a trainer shard sends carries ``mac`` = HMAC-SHA256(secret, header without
mac) (``protocols.wire.seal``; the header includes the payload's xxh3_64 checksum, so the mac covers
the payload too). A rollout engine built with the same secret refuses any bucket whose mac is
missing or wrong (``ProtocolError("header.mac")``) before a byte of it is applied: a process
without the secret cannot get a bucket applied, even if it can write into the transport.

Where the secret comes from (entry points only; nothing deeper reads files or the environment):

- ``WeightSync`` generates one per instance by default (``new_secret``), or takes
  ``SyncConfig.secret``; it hands the secret to every trainer shard and engine when it opens a
  channel (a Ray actor call: the control plane between our own actors, inside the trusted cluster).
- ``weightsync sync --secret-file PATH`` (or ``$WEIGHTSYNC_SECRET_FILE``) and ``weightsync run`` (the
  config's ``secret.env`` variable, else ``secret.file``) read one with ``load_secret``, e.g. one shared
  by processes started by other launchers; every file goes through ``read_secret_file``'s checks.

The secret is never logged: ``fingerprint`` gives a short, non-reversible id to compare two sides.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

__all__ = ["MIN_SECRET_BYTES", "SECRET_BYTES", "SECRET_FILE_ENV", "check_secret", "fingerprint", "new_secret",
           "load_secret", "read_secret_file", "resolve_secret"]

SECRET_BYTES = 32
"""Size of a generated secret, bytes (RFC 2104 §3: at least the hash output length, 32 for SHA-256)."""
MIN_SECRET_BYTES = 16
"""Shortest secret accepted, bytes (128 bits)."""
MAX_SECRET_BYTES = 4096
"""Longest secret file accepted, bytes."""
SECRET_FILE_ENV = "WEIGHTSYNC_SECRET_FILE"
"""Environment variable naming a secret file (read by ``resolve_secret`` at entry points)."""


def new_secret() -> bytes:
    """A fresh random secret of ``SECRET_BYTES`` bytes from the OS CSPRNG (``secrets.token_bytes``)."""
    return secrets.token_bytes(SECRET_BYTES)


def check_secret(secret: object, what: str = "secret", min_bytes: int = MIN_SECRET_BYTES) -> bytes:
    """Return ``secret`` if it is ``bytes`` of at least ``min_bytes`` (default ``MIN_SECRET_BYTES``).

    Raises:
        TypeError: not bytes. ValueError: too short.
    """
    if not isinstance(secret, bytes):
        raise TypeError(f"{what} must be bytes, got {type(secret).__name__}; use sync_service.security.new_secret()")
    if len(secret) < max(min_bytes, MIN_SECRET_BYTES):
        raise ValueError(f"{what} has {len(secret)} bytes, need >= {max(min_bytes, MIN_SECRET_BYTES)}; "
                         f"generate one with `head -c {SECRET_BYTES} /dev/urandom > secret`")
    return secret


def read_secret_file(path: str | Path, min_bytes: int = MIN_SECRET_BYTES) -> bytes:
    """The secret stored in ``path``: its bytes with surrounding ASCII whitespace stripped (a
    trailing newline from ``echo`` does not count). Key files are text, e.g. ``openssl rand -hex 32``
    (raw random bytes could begin or end with a whitespace byte, which would be stripped).

    Raises:
        FileNotFoundError: no such file.
        PermissionError: the file is writable by group or others (anyone could replace the key).
        ValueError: shorter than ``min_bytes`` or longer than ``MAX_SECRET_BYTES`` (not a key file).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"secret file {str(path)!r} does not exist (or is not a file)")
    mode = path.stat().st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"secret file {str(path)!r} is writable by group/others (mode {stat.filemode(mode)}); "
                              f"run `chmod 600 {path}`")
    if path.stat().st_size > MAX_SECRET_BYTES:
        raise ValueError(f"secret file {str(path)!r} has {path.stat().st_size} bytes > {MAX_SECRET_BYTES}: not a key file")
    return check_secret(path.read_bytes().strip(), f"secret file {str(path)!r}", min_bytes)


def load_secret(*, value_env: str | None = None, file: str | Path | None = None, file_optional: bool = False,
                environ: Mapping[str, str] | None = None, min_bytes: int = MIN_SECRET_BYTES) -> bytes | None:
    """The one secret loader of the entry points: the key held by the environment variable ``value_env``
    (its UTF-8 bytes, whitespace stripped), else the key in ``file`` (``read_secret_file``: permission
    and size checks), else ``None`` (the caller then generates one). ``environ`` defaults to ``os.environ``.

    Args:
        file_optional: a ``file`` that does not exist counts as no secret (a default mount path).
        min_bytes: shortest accepted key, bytes (never below ``MIN_SECRET_BYTES``).

    Raises:
        as ``read_secret_file`` (a value from ``value_env``: ValueError when too short).
    """
    env = os.environ if environ is None else environ
    if value_env is not None and env.get(value_env):
        return check_secret(env[value_env].strip().encode(), f"${value_env}", min_bytes)
    if file is None or (file_optional and not Path(file).exists()):
        return None
    return read_secret_file(file, min_bytes)


def resolve_secret(secret_file: str | Path | None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """``weightsync sync``'s secret: the key in ``secret_file``, else in the file named by
    ``environ[SECRET_FILE_ENV]``, else ``None`` (the caller then generates one).

    Raises:
        as ``read_secret_file``.
    """
    env = os.environ if environ is None else environ
    return load_secret(file=secret_file if secret_file is not None else env.get(SECRET_FILE_ENV) or None, environ=env)


def fingerprint(secret: bytes) -> str:
    """First 12 hex digits of SHA-256 over a domain tag and the secret: safe to log, to check that
    two processes hold the same secret."""
    return hashlib.sha256(b"weightsync-secret-fingerprint\0" + secret).hexdigest()[:12]
