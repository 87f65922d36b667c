"""``ServerAdapter``: a running vLLM server behind the ``EngineAdapter`` calls of the engine conformance suite.

The suite drives engines box by box; a server takes whole syncs through vLLM's weight-transfer API.
This adapter is the trainers' side of one server, in this process:

- ``begin_update`` / ``apply`` stage the boxes here (``engines.staging.Staging`` against the server's own
  table, read from its worker: the box and completeness checks every engine shares);
- ``finish_update`` streams the staged tensors into the server as one real sync (``Sender`` over a shm
  channel with an HMAC session secret, opened once through ``/init_weight_transfer_engine``): the server
  pauses, its worker verifies, stages and reloads the touched modules (vLLM's post-load processing) and
  acks; nothing is served yet;
- ``commit`` / ``abort`` / ``weight_version`` / ``reset_caches`` are ``VLLMServerEngine``'s (``/finish_weight_update``
  with the version; the authenticated abort, after which the worker reloads the served version).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from protocols.interfaces import FinishReport
from protocols.params import Box, ParamMeta
from protocols.wire import encode
from sync_service.dtypes import TORCH_DTYPES
from sync_service.engines.staging import Staging
from sync_service.streaming import BucketPool, Sender, TensorSource
from sync_service.streaming.plan import build_plan
from sync_service.transports import TransportSpec, open_sender

BUCKET_BYTES = 1 << 20


class ServerAdapter:
    """``EngineAdapter`` over ``server`` (a ``VLLMServerEngine``); see the module docstring.

    Args:
        server: the handle of a server started with the weightsync backend.
        timeout_s: bound of the channel's opening and of each sync, seconds.
    """

    def __init__(self, server, *, timeout_s: float = 120.0) -> None:
        self.server, self.timeout_s = server, timeout_s
        self._metas = tuple(ParamMeta(n, d, tuple(s)) for n, d, s, _ in server.param_metas())
        by_name = {m.name: m for m in self._metas}
        self._staging = Staging(lambda n: torch.empty(by_name[n].shape, dtype=TORCH_DTYPES[by_name[n].dtype]),
                                server.engine_name())
        self._finished = False
        self._plan = build_plan(self._metas, bucket_bytes=BUCKET_BYTES)
        self._sender = self._open_channel()
        self._pool = ThreadPoolExecutor(1)

    def _open_channel(self) -> Sender:
        secret = os.urandom(32)
        spec = TransportSpec(kind="shm", name="srv" + uuid.uuid4().hex[:10], num_senders=1, num_receivers=1,
                             bucket_bytes=BUCKET_BYTES, connect_timeout_s=self.timeout_s, op_timeout_s=self.timeout_s)
        with ThreadPoolExecutor(1) as pool:  # the server's side blocks until this side attached
            opened = pool.submit(self.server.open_transport, spec.to_bytes(), encode(self._plan), 0, secret=secret)
            transport = open_sender(spec, 0)
            opened.result(timeout=self.timeout_s + 60)
        return Sender(transport, BucketPool(bucket_bytes=BUCKET_BYTES), secret=secret)

    commit_gate = None
    """The server's gate lives in its worker (``WorkerEngine.commit_gate``), not in this process."""

    def param_metas(self) -> Sequence[ParamMeta]:
        return self._metas

    def weight_version(self) -> int | None:
        return self.server.weight_version()

    def begin_update(self, version: int, names: Sequence[str], *, reset_versions: bool = False) -> None:
        """Stages here; the server's own ``begin_update`` (its ``CommitGate``: fence, token) runs when
        ``finish_update`` streams the sync, so its refusals are raised there. Hands out no token here:
        ``update_id`` holds the server's after ``finish_update``."""
        unknown = sorted(set(names) - {m.name for m in self._metas})
        if unknown:
            raise KeyError(f"begin_update: {unknown[:5]} not in the server's table")
        self._staging.begin(version, names)
        self._finished, self._reset, self.update_id = False, reset_versions, None

    def apply(self, name: str, box: Box, data: torch.Tensor) -> None:
        self._staging.apply(name, box, data)

    def finish_update(self) -> FinishReport:
        """One sync of the staged tensors into the server (applied and reloaded there, not committed)."""
        if self._staging.version is None or self._finished:
            raise RuntimeError("finish_update needs exactly one begin_update before it")
        self._staging.check_complete()
        t0, names = time.perf_counter(), self._staging.names()
        source = TensorSource({n: self._staging.buffer(n) for n in names})
        received = self._pool.submit(self.server.receive, self.timeout_s, self._reset)
        try:
            self._sender.send_sync(f"conformance-{self._staging.version}", self._staging.version, source, self._plan,
                                   names=frozenset(names), timeout_s=self.timeout_s)
        finally:
            self.update_id = received.result(timeout=self.timeout_s + 60)["update_id"]  # or the server's error
        modules = int(self.server.status()["received"]["modules"])  # the worker's reload of this sync
        self._finished = True
        return FinishReport(tensors=len(names), modules=modules, seconds=time.perf_counter() - t0)

    def commit(self, version: int, update_id: str | None = None) -> None:
        try:
            self.server.commit(version, update_id)  # the server's gate refuses (and aborts) what it did not stage
        finally:
            if update_id is None or update_id == self.update_id:
                self._staging.drop()
                self._finished = False

    def abort(self, update_id: str | None = None) -> bool:
        self.server.abort(update_id)
        if update_id is None or update_id == self.update_id:
            self._staging.drop()
            self._finished = False
        return True

    def reset_caches(self) -> None:
        self.server.reset_caches()

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._sender.transport.close()
        self.server.close_transport()
