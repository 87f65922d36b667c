"""``WeightsyncTransferEngine``: weightsync as a backend of vLLM's weight-transfer API (worker side).

vLLM creates it in every worker of a server started with ``--weight-transfer-config '{"backend":
"weightsync"}'`` (registered by ``plugin.register``, this package's ``vllm.general_plugins`` entry
point) and calls it from its RL endpoints (``VLLM_SERVER_DEV_MODE=1``):

- ``/init_weight_transfer_engine`` → ``init_transfer_engine``: decode the channel (``wire.InitInfo``),
  check the plan against this worker's own parameter table (``PlanMismatchError`` before any byte),
  open the receiver side of the transport (shm on one host, torch.distributed across hosts).
- ``/start_weight_update`` → nothing to prepare (staging is per sync, inside ``WorkerSync``).
- ``/update_weights {"timeout_s": t}`` → ``receive_weights``: one whole sync through weightsync's
  ``BucketReceiver`` (HMAC + xxh3 checked per bucket, staged, one reload of the touched modules,
  Ack to the trainers); not committed.
- ``/finish_weight_update`` → commit the received version (the version the authenticated stream
  carried); with nothing received (an aborted sync), nothing changes.
- ``/collective_rpc`` ``weight_transfer_engine`` → ``__call__`` commands: ``table``, ``status``,
  ``served`` (digests of what the worker serves: ``engines.vllm.served``), ``abort`` (see ``wire``).

Every call runs inside vLLM's engine-core loop: no generation step runs while one is in progress.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo,
)

from protocols.wire import SyncPlan
from protocols.wire_check import decode
from sync_service.coordinator.planning import validate_plan
from sync_service.engines.served_check import findings, install
from sync_service.engines.vllm_server.staging import fused_worker_engine
from sync_service.engines.vllm_server.wire import InitInfo, b64, command_op, served_request, verify_command
from sync_service.streaming.receiver import ApplyStats, BucketReceiver
from sync_service.transports import TransportSpec, open_receiver

__all__ = ["WeightsyncTransferEngine"]


@dataclass
class WeightsyncInitInfo(InitInfo, WeightTransferInitInfo):
    """``wire.InitInfo`` as vLLM's typed init info."""


@dataclass
class WeightsyncUpdateInfo(WeightTransferUpdateInfo):
    timeout_s: float = 120.0
    """Longest wait for the whole sync, seconds."""
    reset_versions: bool = False
    """Begin the update with ``reset_versions`` (a version at or below the served one; ``engines.commit_gate``)."""


def _command_fields(op: str, body: str) -> dict:
    """The arguments of an authenticated ``commit`` (``version``, ``update_id``) or ``abort`` (``update_id``).

    Raises:
        ValueError: the body is not a JSON object with them.
    """
    import json

    try:
        msg = json.loads(body)
        fields = {k: msg[k] for k in (("version", "update_id") if op == "commit" else ("update_id",)) if k in msg}
        if op == "commit" and (type(fields.get("version")) is not int or not isinstance(fields.get("update_id"), str)
                               or not fields["update_id"]):
            raise KeyError("version")
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"command {op!r}: body must be a JSON object with nonce, mac"
                         f"{', version (int), update_id (str)' if op == 'commit' else ', update_id'}") from None
    return fields


def _stats(s: ApplyStats, served_findings: int | None) -> dict:
    return {"version": s.version, "buckets": s.buckets, "entries": s.entries, "payload_bytes": s.payload_bytes,
            "wait_s": s.wait_s, "verify_s": s.verify_s, "apply_s": s.apply_s, "finish_s": s.finish_s,
            "modules": s.modules, "total_s": s.total_s, "update_id": s.update_id, "served_findings": served_findings}


class WeightsyncTransferEngine(WeightTransferEngine[WeightsyncInitInfo, WeightsyncUpdateInfo]):
    """Receive side of weightsync inside a vLLM worker (see the module docstring)."""

    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._adapter = None  # FusedVLLMEngine over WorkerSync, built on first use (the model is loaded)
        self._transport = None
        self._receiver: BucketReceiver | None = None
        self._secret: bytes | None = None
        self._nonce = 0
        self._received: ApplyStats | None = None  # received and acked, not yet committed
        self._findings: int | None = None  # the served check's findings in it (engines.served_check.findings)
        self._error: str | None = None

    # -- vLLM's weight-transfer API ------------------------------------------------------------
    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        """Open the receiver side of a channel for a plan. Blocks until the trainers connect.

        Raises:
            PlanMismatchError: the plan does not fit this server's table (nothing opened).
            ValueError: an undecodable field; TimeoutError: the trainers did not connect in time.
        """
        if self.parallel_config.world_size != 1:
            raise ValueError(f"the weightsync backend serves one worker per server; this one has "
                             f"{self.parallel_config.world_size} (start the server without tensor/pipeline parallelism)")
        spec_bytes, plan_bytes, receiver, secret = InitInfo.decoded(init_info)
        plan = decode(plan_bytes)
        if not isinstance(plan, SyncPlan):
            raise ValueError(f"init_info.plan decodes to {type(plan).__name__}, not a SyncPlan")
        validate_plan(plan, self._engine().param_metas(), engine=str(self.model_config.model))
        self.shutdown()
        self._transport = open_receiver(TransportSpec.from_bytes(spec_bytes), receiver=receiver)
        self._secret, self._nonce = secret, 0
        updater = install(self._engine(), getattr(init_info, "check_served", "off"), "vllm-server worker")
        self._receiver = BucketReceiver(updater, plan, receiver=receiver, secret=secret)

    def start_weight_update(self) -> None:
        if self._receiver is None:
            raise RuntimeError("start_weight_update before /init_weight_transfer_engine opened a channel")
        self._received, self._error, self._findings = None, None, None

    def update_weights(self, update_info: dict) -> None:
        """vLLM's ``update_weights`` without its device synchronisation on CPU (no accelerator)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        """One whole sync, staged and reloaded, acked to the trainers, not committed. On failure the
        served weights are the previous version's and the error is kept for ``status``."""
        try:
            self._received = self._receiver.receive_sync(self._transport, timeout_s=float(update_info.timeout_s),
                                                         reset_versions=bool(update_info.reset_versions))
            self._findings = findings(self._engine())
        except BaseException as exc:
            self._error = f"{type(exc).__name__}: {exc}"
            raise

    def finish_weight_update(self) -> None:
        """Commit the received version; nothing when the sync was aborted or failed."""
        if self._received is not None:
            received, self._received = self._received, None
            if self._engine().commit_gate.staged_id == received.update_id:  # still the update staged
                self._engine().commit(received.version, received.update_id)

    def shutdown(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self._transport, self._receiver = None, None

    # -- weightsync's commands (``/collective_rpc``) -----------------------------------------
    def __call__(self, op: str, body: str = "") -> dict | list:
        """``table``: ``[[name, dtype, shape], ...]``; ``status``: ``{"version", "received", "error"}`` (``received``:
        the uncommitted sync's stats, ``served_findings`` among them);
        ``served`` (body ``{"names": [...] | null, "values": bool}``): ``{"version", "rows": [[name, dtype, shape,
        xxh3_64, source, base64 bytes | null], ...]}``; ``abort`` (authenticated): drop the received sync, reload
        the served version.

        Raises:
            ValueError: unknown op or a ``served`` body that is not that object; PermissionError: a bad or
                replayed ``abort``; KeyError: ``served`` of a name not served here.
        """
        if op == "table":
            return [[m.name, m.dtype, list(m.shape)] for m in self._engine().param_metas()]
        if op == "status":
            received = None if self._received is None else _stats(self._received, self._findings)
            return {"version": self._engine().weight_version(), "received": received, "error": self._error}
        if op == "served":
            names, values = served_request(body)
            version, rows = self._engine().served_digests(names, values)
            return {"version": version, "rows": [[*r[:5], None if r[5] is None else b64(r[5])] for r in rows]}
        if op in ("commit", "abort"):
            fields = _command_fields(op, body)
            self._nonce = verify_command(self._secret, command_op(op, fields), body, self._nonce)
            token = fields.get("update_id") or None
            if op == "commit":
                try:
                    self._engine().commit(int(fields["version"]), token)  # the server's CommitGate decides
                finally:
                    if self._received is not None and self._received.update_id == token:
                        self._received = None
                return {"committed": int(fields["version"])}
            aborted = self._engine().abort(token)  # another update's token: nothing happens
            if self._received is not None and (token is None or self._received.update_id == token):
                self._received = None
            return {"aborted": bool(aborted)}
        raise ValueError(f"unknown weightsync command {op!r}; use table, status, served or abort")

    def _engine(self):
        if self._adapter is None:
            self._adapter = fused_worker_engine(self.model, self.model_config)
        return self._adapter
