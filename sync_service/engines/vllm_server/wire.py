"""What the coordinator-side handle and the in-server backend exchange over vLLM's HTTP API.

No vLLM, Ray or torch import: both sides use it. Three messages:

- **init** (``POST /init_weight_transfer_engine``, body ``{"init_info": {...}}``): the channel's
  ``TransportSpec`` bytes, the plan bytes, this server's receiver index and the session secret,
  base64 in JSON (``InitInfo``). The secret travels only in this body (never a URL, never a log
  line: ``InitInfo.__repr__`` leaves it out).
- **update** (``POST /update_weights``, body ``{"update_info": {"timeout_s": t}}``): receive one whole
  sync within ``t`` seconds.
- **commands** (``POST /collective_rpc``, ``{"method": "weight_transfer_engine", "args": [op, body]}``):
  vLLM calls the worker's backend object with the two strings (``WeightsyncTransferEngine.__call__``)
  and returns its JSON result. ``table``, ``status`` and ``served`` only read; ``abort`` changes state and must
  carry ``command_mac`` of the session secret over ``(op, nonce)`` with a nonce larger than any
  seen before (a replayed abort is refused).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from dataclasses import dataclass, field

__all__ = ["BACKEND", "COMMAND_METHOD", "InitInfo", "b64", "command_body", "command_mac", "served_body", "served_request",
           "unb64", "verify_command"]

BACKEND = "weightsync"
"""The backend name the server is started with: ``--weight-transfer-config '{"backend": "weightsync"}'``."""
COMMAND_METHOD = "weight_transfer_engine"
"""The worker attribute ``/collective_rpc`` calls: vLLM's worker holds the backend under this name."""


def b64(data: bytes) -> str:
    """``data`` as base64 text (JSON bodies carry bytes so)."""
    return base64.b64encode(data).decode("ascii")


def unb64(text: str, what: str) -> bytes:
    """The bytes of base64 ``text``. Raises ``ValueError`` naming ``what`` when it is not base64."""
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError, AttributeError) as exc:
        raise ValueError(f"{what} is not base64: {exc}") from None


def served_body(names: list[str] | None, values: bool) -> str:
    """The JSON body string of a ``served`` command (read only, not authenticated)."""
    return json.dumps({"names": names, "values": bool(values)})


def served_request(body: str) -> tuple[list[str] | None, bool]:
    """``(names, values)`` of a ``served`` command body.

    Raises:
        ValueError: not ``{"names": [str, ...] | null, "values": bool}``.
    """
    try:
        msg = json.loads(body or "{}")
    except ValueError:
        raise ValueError("command 'served': body must be JSON {\"names\": [...] | null, \"values\": bool}") from None
    names, values = (msg.get("names"), msg.get("values", False)) if isinstance(msg, dict) else (0, 0)
    if not (names is None or (isinstance(names, list) and all(isinstance(n, str) for n in names))) \
            or not isinstance(values, bool):
        raise ValueError("command 'served': body must be JSON {\"names\": [str, ...] | null, \"values\": bool}")
    return names, values


@dataclass(kw_only=True, slots=True)
class InitInfo:
    """Init body of one channel (all fields are JSON strings / ints)."""

    spec: str
    """``TransportSpec.to_bytes()``, base64."""
    plan: str
    """``protocols.wire.encode(SyncPlan)``, base64."""
    receiver: int
    """This server's receiver index on the channel."""
    secret: str = field(default="", repr=False)
    """The session's HMAC key, base64 (empty: buckets are not authenticated)."""
    check_served: str = "off"
    """The served check the worker runs before it votes (``SyncConfig.check_served``: off, log, enforce)."""

    @classmethod
    def make(cls, spec: bytes, plan: bytes, receiver: int, secret: bytes | None,
             check_served: str = "off") -> "InitInfo":
        return cls(spec=b64(spec), plan=b64(plan), receiver=receiver, secret=b64(secret or b""),
                   check_served=check_served)

    def to_json(self) -> dict:
        return {"spec": self.spec, "plan": self.plan, "receiver": self.receiver, "secret": self.secret,
                "check_served": self.check_served}

    def decoded(self) -> tuple[bytes, bytes, int, bytes | None]:
        """``(spec bytes, plan bytes, receiver, secret or None)``.

        Raises:
            ValueError: a field is not base64 or ``receiver`` is not an int >= 0.
        """
        if type(self.receiver) is not int or self.receiver < 0:
            raise ValueError(f"init_info.receiver={self.receiver!r} must be an int >= 0")
        secret = unb64(self.secret, "init_info.secret")
        return unb64(self.spec, "init_info.spec"), unb64(self.plan, "init_info.plan"), self.receiver, secret or None


def command_mac(secret: bytes, op: str, nonce: int) -> str:
    """HMAC-SHA256 (hex) of ``op`` and ``nonce`` under the session secret."""
    return hmac.new(secret, f"{op}\n{nonce}".encode(), hashlib.sha256).hexdigest()


def command_body(secret: bytes | None, op: str, nonce: int) -> str:
    """The JSON body string of an authenticated command."""
    return json.dumps({"nonce": nonce, "mac": command_mac(secret or b"", op, nonce)})


def command_op(op: str, fields: dict | None) -> str:
    """What an authenticated command's mac covers: ``op`` and its arguments (``fields``, canonical JSON), so
    a commit's version and update token cannot be altered in transit."""
    return op if not fields else f"{op}\n{json.dumps(fields, sort_keys=True)}"


def verify_command(secret: bytes | None, op: str, body: str, last_nonce: int) -> int:
    """The command's nonce if its mac is right and the nonce is new.

    Raises:
        PermissionError: no session yet, a bad mac, or a replayed nonce.
    """
    if not secret:
        raise PermissionError(f"command {op!r}: no authenticated session (call /init_weight_transfer_engine first)")
    try:
        msg = json.loads(body)
        nonce, mac = int(msg["nonce"]), str(msg["mac"])
    except (ValueError, KeyError, TypeError):
        raise PermissionError(f"command {op!r}: body must be JSON with 'nonce' and 'mac'") from None
    if not hmac.compare_digest(mac, command_mac(secret, op, nonce)):
        raise PermissionError(f"command {op!r}: mac does not match the session secret")
    if nonce <= last_nonce:
        raise PermissionError(f"command {op!r}: nonce {nonce} already used (replay)")
    return nonce
