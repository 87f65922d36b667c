"""``ServerClient``: the HTTP calls weightsync makes to a vLLM server, each bounded by a timeout.

Errors name the server and the fix: an unreachable URL (``ServerUnreachableError``), a route that is
not mounted (the RL / dev routes need ``VLLM_SERVER_DEV_MODE=1``), a rejected API key, or the
server's own error text (``ServerRequestError``). The API key is sent as ``Authorization: Bearer``
(vLLM's ``--api-key``) and never appears in an error or a repr.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.parse
import urllib.request

__all__ = ["ServerClient", "ServerError", "ServerRequestError", "ServerSetupError", "ServerUnreachableError", "redact"]

DEV_MODE_HINT = "start the server with the environment variable VLLM_SERVER_DEV_MODE=1 (it mounts vLLM's RL routes)"


def redact(url: str) -> str:
    """``url`` with any ``user:password@`` part replaced by ``***@`` (for messages and logs)."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


class ServerError(RuntimeError):
    """A vLLM server call failed. ``url``: the server."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(message)
        self.url = url

    def __reduce__(self):
        return (type(self), (self.url, str(self)))


class ServerUnreachableError(ServerError):
    """No answer from the server (refused, reset, or past the timeout): it is down or the URL is wrong."""


class ServerSetupError(ServerError):
    """The server runs but lacks what weightsync needs (a route, the backend, the API key)."""


class ServerRequestError(ServerError):
    """The server answered a call with an error (its text in the message)."""


class ServerClient:
    """JSON over HTTP to one vLLM server.

    Args:
        url: base URL, e.g. ``http://127.0.0.1:8000`` (no trailing path).
        api_key: the server's ``--api-key``, or ``None``.
        timeout_s: default bound of one call, seconds (connect + answer).
    """

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 30.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"vLLM server URL {redact(url)!r} must start with http:// or https://, e.g. http://127.0.0.1:8000")
        if "@" in urllib.parse.urlsplit(url).netloc:
            raise ValueError(f"vLLM server URL {redact(url)!r} carries credentials (user:password@); drop them and give "
                             f"the server's --api-key as api_key= (CLI: --vllm-api-key or $VLLM_API_KEY)")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def __repr__(self) -> str:
        return f"ServerClient({self.url!r})"

    def get(self, path: str, *, params: dict | None = None, timeout_s: float | None = None) -> object:
        return self._call("GET", path, None, params=params, timeout_s=timeout_s)

    def post(self, path: str, body: dict | None = None, *, params: dict | None = None,
             timeout_s: float | None = None) -> object:
        return self._call("POST", path, b"{}" if body is None else json.dumps(body).encode(), params=params,
                          timeout_s=timeout_s)

    def _call(self, method: str, path: str, data: bytes | None, *, params: dict | None, timeout_s: float | None) -> object:
        """The decoded JSON answer (``None`` for an empty body). Blocks up to ``timeout_s``.

        Raises:
            ServerUnreachableError, ServerSetupError (404 / 401), ServerRequestError (other >= 400, or an
            answer that is not JSON).
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        where = f"vLLM server {self.url}: {method} {path}"
        query = "" if not params else "?" + urllib.parse.urlencode(params)
        req = urllib.request.Request(self.url + path + query, data=data, headers=self._headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise self._http_error(where, exc.code, exc.read()) from None
        except (TimeoutError, socket.timeout):
            raise ServerUnreachableError(self.url, f"{where}: no answer within {timeout:.0f} s") from None
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServerUnreachableError(self.url, f"{where}: unreachable ({reason}); is the server running and is "
                                                   "the URL right?") from None
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            raise ServerRequestError(self.url, f"{where}: the answer is not JSON ({_error_text(raw)[:80]!r}); "
                                               "is the URL a vLLM server's?") from None

    def _http_error(self, where: str, status: int, raw: bytes) -> ServerError:
        if status == 404:
            return ServerSetupError(self.url, f"{where}: route not found; {DEV_MODE_HINT}")
        if status == 401:
            return ServerSetupError(self.url, f"{where}: API key rejected; pass the key the server was started with "
                                              "(--api-key) as api_key= / --vllm-api-key")
        return ServerRequestError(self.url, f"{where}: HTTP {status}: {_error_text(raw)}")


def _error_text(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:2000]
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:2000]
    return str(body)[:2000]
