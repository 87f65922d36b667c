"""``VLLMServerEngine``: a running vLLM server as a weightsync rollout engine (coordinator side).

It answers the calls the coordinator makes of every engine (``actors.rollout.RolloutEngine``'s:
``param_metas``, ``open_transport``, ``receive``, ``commit``, ``abort``, ``weight_version``, ...) by
calling the server; the bytes never pass through it: trainers stream buckets straight into the
server's worker (``backend.WeightsyncTransferEngine``) over weightsync's transport.

Channels (docs/vllm.md, "Updating a running vLLM server"):

- vLLM's native weight-transfer routes carry the lifecycle: ``/init_weight_transfer_engine``
  (channel + plan + session secret, in the body), ``/start_weight_update``, ``/update_weights``
  (one whole sync), ``/finish_weight_update`` (commit, with ``weight_version``), ``/weight_info``.
- The acks go where every engine's go: from the worker to the trainers over the transport (the
  coordinator commits only when every engine acked).
- vLLM's routes return only a message and have no abort, so the parameter table, the receive
  stats / error and the abort travel as commands through vLLM's ``/collective_rpc`` to the backend
  object (``wire``); the abort is authenticated with the session secret.

Atomic versions: ``receive`` first pauses the server (``/pause``, mode ``wait``: running requests
finish on the served version, new ones wait; or ``abort``), so no request sees two versions; the
served weights change inside ``/update_weights``; ``commit`` / ``abort`` reset the prefix cache and
resume. ``PauseMode.KEEP`` is refused: vLLM's "keep" resumes frozen requests on the new weights.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from protocols.interfaces import PauseMode
from sync_service.engines.vllm_server.client import ServerClient, ServerRequestError, ServerSetupError, redact
from sync_service.engines.vllm_server.wire import BACKEND, COMMAND_METHOD, InitInfo, command_body, command_op, served_body, unb64
from sync_service.transports import TransportSpec

__all__ = ["LogprobsUnavailable", "ServerGeneration", "VLLMServerConfig", "VLLMServerEngine"]

MAX_LOGPROBS_VOCAB = 8192
"""The largest vocabulary ``token_logprobs`` reads over HTTP (JSON: ~60 bytes per token and position; larger
models report no ``policy_kl`` through a server)."""
BACKEND_FLAG = f"--weight-transfer-config '{{\"backend\": \"{BACKEND}\"}}'"


@dataclass(kw_only=True, slots=True)
class VLLMServerConfig:
    """How weightsync reaches and updates one vLLM server."""

    url: str
    """Base URL, e.g. ``http://127.0.0.1:8000``."""
    api_key: str | None = field(default=None, repr=False)
    """The server's ``--api-key`` (``None``: none)."""
    name: str | None = None
    """Engine name in metrics and errors; ``None``: ``vllm-server@<url>``."""
    pause_mode: PauseMode = PauseMode.WAIT
    """``WAIT``: running requests finish on the served version, new ones wait for the commit.
    ``ABORT``: running requests are aborted. ``KEEP`` is refused (frozen requests would resume on the
    new weights: one request, two versions)."""
    timeout_s: float = 30.0
    """Bound of one control call (table, status, commit, abort), seconds; data calls get the push's."""

    def __post_init__(self) -> None:
        self.pause_mode = PauseMode(self.pause_mode)
        if self.pause_mode is PauseMode.KEEP:
            raise ValueError("pause_mode=KEEP: vLLM resumes kept requests on the new weights (one request, two "
                             "versions); use WAIT or ABORT")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0 seconds")


class LogprobsUnavailable(ServerSetupError):
    """The server refuses full-vocabulary prompt logprobs (``--max-logprobs`` below the vocabulary)."""


@dataclass(frozen=True, slots=True)
class ServerGeneration:
    """One greedy completion: ``tokens`` (ids), ``logprobs`` (natural log, one per token)."""

    tokens: list[int]
    logprobs: list[float]


class VLLMServerEngine:
    """One vLLM server as a rollout engine (see the module docstring).

    Raises (constructor):
        ServerUnreachableError: no answer within ``timeout_s``.
        ServerSetupError: dev routes not mounted, or the server was started without the backend (the
            message names the flag to add), or with more than one worker.
    """

    def __init__(self, config: VLLMServerConfig) -> None:
        self.config = config
        self.name = config.name or f"vllm-server@{config.url}"
        self._client = ServerClient(config.url, api_key=config.api_key, timeout_s=config.timeout_s)
        self._secret: bytes | None = None
        self._nonce = time.time_ns()  # increasing across handles of one server
        self._active = False  # a start_weight_update the server has not finished
        self._update_id = ""  # the server's token of the update this handle's last receive staged
        self._model = self._check_server()

    def _check_server(self) -> str:
        info = self._client.get("/server_info", params={"config_format": "json"})
        if not isinstance(info, dict):
            raise ServerSetupError(self.config.url, f"vLLM server {self.config.url}: GET /server_info answered "
                                   f"{type(info).__name__}, not an object; is the URL a vLLM server's?")
        vllm_config = info.get("vllm_config") or {}
        transfer = vllm_config.get("weight_transfer_config") or {}
        if transfer.get("backend") != BACKEND:
            raise ServerSetupError(self.config.url, f"vLLM server {self.config.url} runs without the weightsync "
                                   f"weight-transfer backend (has {transfer.get('backend')!r}); restart it with "
                                   f"{BACKEND_FLAG} (weightsync installed in the server's environment)")
        return str((vllm_config.get("model_config") or {}).get("model", ""))

    # -- the engine calls the coordinator makes ------------------------------------------------
    def engine_name(self) -> str:
        return self.name

    def param_metas(self) -> list[list]:
        """The server worker's own table, ``[name, dtype, shape, None]`` per tensor (hf-fused naming)."""
        return [[n, d, list(s), None] for n, d, s in self._command("table")]

    def weight_version(self) -> int | None:
        """The version ``/weight_info`` reports (``None`` before the first commit)."""
        v = self._client.get("/weight_info").get("weight_version")
        return int(v) if isinstance(v, (int, str)) and str(v).lstrip("-").isdigit() else None

    def can_export(self) -> bool:
        return False

    def open_transport(self, spec_bytes: bytes, plan_bytes: bytes, receiver: int, *, secret: bytes | None = None,
                       check_served: str = "off") -> None:
        """Open the server worker's receiver side (``/init_weight_transfer_engine``; blocks until the
        trainers connect). The plan is checked there against the worker's table before any byte; the worker
        installs the served check (``check_served``, ``engines.served_check``) in its commit gate."""
        spec = TransportSpec.from_bytes(spec_bytes)
        self._secret = secret
        info = InitInfo.make(spec_bytes, plan_bytes, receiver, secret, check_served).to_json()
        self._client.post("/init_weight_transfer_engine", {"init_info": info}, timeout_s=spec.connect_timeout_s + 30)

    def close_transport(self) -> None:
        self._client.post("/shutdown_weight_transfer_engine")

    def receive(self, timeout_s: float, reset_versions: bool = False) -> dict:
        """Pause, then receive one whole sync into the server (staged, reloaded, acked; not committed). The
        report carries the server's update token (``update_id``: ``commit`` / ``abort`` act with it) and its
        served check's findings (``served_findings``: ``ReceiveReport``'s; ``None`` when off or not reported);
        ``reset_versions``: the server takes a version at or below the one it serves (``engines.commit_gate``).

        Raises:
            ServerRequestError: the sync failed in the server (its error; the server serves the
                previous version and stays paused until ``abort``); ServerUnreachableError: the
                server went away.
        """
        self._client.post("/pause", params={"mode": self.config.pause_mode.value, "clear_cache": "true"},
                          timeout_s=timeout_s)
        self._client.post("/start_weight_update")
        self._active = True
        try:
            self._client.post("/update_weights", {"update_info": {"timeout_s": timeout_s, "reset_versions": reset_versions}},
                              timeout_s=timeout_s + 30)
        except ServerRequestError as exc:
            self._active = False  # vLLM ends the update session when update_weights raises
            error = self.status().get("error")
            if error:
                raise type(exc)(self.config.url, f"{self.name}: sync failed in the server: {error}") from None
            raise
        received = self.status().get("received") or {}
        self._update_id = str(received.get("update_id") or "")
        findings = received.get("served_findings")  # absent from an older backend: not reported
        return {"engine": self.name, "update_id": self._update_id,
                "served_findings": findings if type(findings) is int else None, **{k: received.get(k, 0) for k in (
                    "version", "buckets", "entries", "payload_bytes", "wait_s", "verify_s", "apply_s", "finish_s",
                    "total_s")}}

    def commit(self, version: int, update_id: str | None = None) -> None:
        """Commit the update of ``update_id`` (``None``: the one this handle's last ``receive`` staged) as
        ``version`` in the server's worker — its ``CommitGate`` decides (the token must be the staged
        update's, the version the one received and above the served one) — then ``/finish_weight_update``
        with ``version`` (vLLM's label), prefix-cache reset, resume.

        Raises:
            RuntimeError: the server refused (a replayed or stale commit, a token that is not the staged
                update's): this handle's own update is aborted then (the served version stays, the next sync
                begins cleanly); another handle's update is never touched.
        """
        token = update_id or self._update_id
        if not token:
            raise RuntimeError(f"{self.name}: commit({version}) refused: this handle staged no update (receive first); "
                               f"version {self.weight_version()} stays served")
        try:
            self._command("commit", authenticated=True, fields={"version": version, "update_id": token})
        except ServerRequestError as exc:
            if "is not the one staged" not in str(exc):  # another update's token: the staged one is kept
                self.abort(token)
            raise RuntimeError(f"{self.name}: {exc}") from None
        if self._active:
            self._client.post("/finish_weight_update", {"weight_version": str(version)})
            self._active = False
        self._update_id = ""
        self._reopen()

    def abort(self, update_id: str | None = None) -> None:
        """Drop the update of ``update_id`` (``None``: this handle's last received one; the server reloads its
        served version; another update's token does nothing there), close vLLM's update, resume."""
        token = update_id or self._update_id
        if token:
            self._command("abort", authenticated=True, fields={"update_id": token})
        if token != self._update_id:
            return  # another update's token: this handle's own update and vLLM's update session stay
        if self._active:
            self._client.post("/finish_weight_update", {})
            self._active = False
        self._update_id = ""
        self._reopen()

    def reset_caches(self) -> None:
        self._client.post("/reset_prefix_cache")

    def status(self) -> dict:
        """The backend's state in the server's worker: ``{"version", "received", "error"}``; ``received``:
        the last received, uncommitted sync's stats (``buckets``, ``payload_bytes``, ``modules``, seconds
        ``wait_s`` ... ``total_s``) or ``None``; ``error``: the last failed receive's error text or ``None``."""
        return self._command("status")

    def served_digests(self, names: Sequence[str] | None = None, values: bool = False) -> tuple[int | None, list[list]]:
        """``(version, rows)``: per tensor the server's worker serves, ``[name, dtype, shape, xxh3_64, source, bytes |
        None]`` (``engines.vllm.served``), computed in the worker inside vLLM's engine-core loop (no generation
        step in between). Raises ``ServerRequestError`` (a name not served there; an update between receive and
        commit)."""
        answer = self._command("served", body=served_body(None if names is None else list(names), values))
        rows = [[*r[:5], None if r[5] is None else unb64(r[5], "served bytes")] for r in answer["rows"]]
        return answer["version"], rows

    # -- serving (verification, tests) ---------------------------------------------------------
    def complete(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[ServerGeneration]:
        """Greedy ``/v1/completions`` of token-id prompts, with each token's logprob."""
        out = []
        for prompt in prompts:
            body = {"model": self._model, "prompt": list(prompt), "max_tokens": max_new_tokens, "temperature": 0.0,
                    "logprobs": 0, "return_token_ids": True}
            choice = self._client.post("/v1/completions", body, timeout_s=self.config.timeout_s * 4)["choices"][0]
            out.append(ServerGeneration(tokens=list(choice["token_ids"]),
                                        logprobs=[float(x) for x in choice["logprobs"]["token_logprobs"]]))
        return out

    def token_logprobs(self, sequences: Sequence[Sequence[int]]) -> tuple[int | None, list]:
        """``(version, per sequence a float32 [len - 1, vocab] tensor)``: the server's teacher-forced next-token
        log-probabilities over the full vocabulary (``/v1/completions`` with vLLM's ``prompt_logprobs=-1``, one
        request per sequence; ``engines.vllm.logprobs.logprob_matrix``), and the version ``/weight_info``
        reports before and after (``None`` if it changed in between). Each answer holds ``len × vocab`` logprobs
        as JSON, so vocabularies above ``MAX_LOGPROBS_VOCAB`` are refused (``LogprobsUnavailable``).

        Raises:
            LogprobsUnavailable: the server refuses full-vocabulary prompt logprobs (started without
                ``--max-logprobs -1``), or the vocabulary exceeds ``MAX_LOGPROBS_VOCAB``. ValueError: a sequence shorter than 2 tokens.
        """
        from sync_service.engines.vllm.logprobs import logprob_matrix

        if any(len(s) < 2 for s in sequences):
            raise ValueError("token_logprobs: every verification sequence needs >= 2 token ids")
        vocab = self._vocab_size()
        if vocab > MAX_LOGPROBS_VOCAB:
            raise LogprobsUnavailable(self.config.url, f"{self.name}: a vocabulary of {vocab} tokens exceeds "
                                      f"{MAX_LOGPROBS_VOCAB}, the most this reads as JSON over HTTP per position")
        before = self.weight_version()
        out = []
        for seq in sequences:  # one request per sequence: one answer holds len × vocab logprobs
            body = {"model": self._model, "prompt": list(seq), "max_tokens": 1, "temperature": 0.0,
                    "prompt_logprobs": -1}
            try:
                choice = self._client.post("/v1/completions", body, timeout_s=self.config.timeout_s * 4)["choices"][0]
            except ServerRequestError as exc:
                if "logprobs" not in str(exc):
                    raise
                raise LogprobsUnavailable(self.config.url, f"{self.name}: the server at {redact(self.config.url)} refuses "
                                          f"full-vocabulary prompt logprobs ({exc}); start it with --max-logprobs -1") from None
            rows = [None if row is None else {int(k): float(v["logprob"]) for k, v in row.items()}
                    for row in choice["prompt_logprobs"]]
            out.append(logprob_matrix(len(seq), vocab, rows))
        return (before if self.weight_version() == before else None), out

    def generate(self, prompt_token_ids: list[int], max_new_tokens: int) -> tuple[list[int], int | None]:
        """Greedy tokens, with the version ``/weight_info`` reports before and after (``None`` if it changed)."""
        before = self.weight_version()
        tokens = self.complete([prompt_token_ids], max_new_tokens)[0].tokens
        return tokens, before if self.weight_version() == before else None

    # -- internals -------------------------------------------------------------------------------
    def _vocab_size(self) -> int:
        """Rows of the output embedding in the worker's table (``lm_head.weight``, else the tied
        ``model.embed_tokens.weight``): the logits' last dimension."""
        shapes = {n: s for n, _, s in self._command("table")}
        for name in ("lm_head.weight", "model.embed_tokens.weight"):
            if name in shapes:
                return int(shapes[name][0])
        raise ServerSetupError(self.config.url, f"{self.name}: the server's table has neither lm_head.weight nor "
                               f"model.embed_tokens.weight; cannot size the vocabulary of its logprobs")

    def _reopen(self) -> None:
        self._client.post("/reset_prefix_cache")
        self._client.post("/resume")


    def _command(self, op: str, *, authenticated: bool = False, body: str = "", fields: dict | None = None) -> object:
        """``fields``: arguments of an authenticated command (``version``, ``update_id``), covered by its mac
        (``wire.command_op``)."""
        if authenticated:
            self._nonce += 1
            body = json.dumps({**json.loads(command_body(self._secret, command_op(op, fields), self._nonce)),
                               **(fields or {})})
        answer = self._client.post("/collective_rpc", {"method": COMMAND_METHOD, "args": [op, body]})
        results = (answer or {}).get("results") or [None]
        if len(results) != 1:
            raise ServerSetupError(self.config.url, f"{self.name}: {len(results)} workers answered; the weightsync "
                                   "backend serves one worker per server (no tensor/pipeline parallelism)")
        return results[0]

