"""The served check: a pre-commit check of the engine's ``CommitGate`` (``SyncConfig.check_served``).

Before an engine may vote for a version (the end of ``finish_update``, ``engines.commit_gate``), it confirms
what it is about to serve:

1. **Applied exactly once.** Every tensor the sync announced received boxes covering each of its elements
   exactly once (elements counted per name and no box received twice, by ``AppliedDigests``, which sits
   between the receiver and the engine and counts independently of the engine's own bookkeeping), and
   nothing outside the announcement was applied.
2. **The applied bytes are the bytes sent.** Each box is read where it landed in the engine's staging right after
   the engine's copy (``staged_buffer``), while it is in cache. For the transformers and memory engines the receiver
   hashes those landed bytes, instead of the bucket's own, into the bucket's xxh3_64 (``apply_landed``;
   ``streaming.applier.apply_hashed``): the digest of the applied bytes must equal the trainers' checksum, sealed
   by their HMAC, with no second pass. A mismatch whose handed bytes do hash to the checksum is the engine's: the
   boxes whose landed bytes differ are named (``landed_mismatch``), a corruption after the transport's checksum
   (the engine's copy, a conversion); otherwise it is the transport's error, as without the check. Called
   directly (``apply``), the landed box's digest is compared with the handed box's.
3. **Finite.** What will be served is free of NaN / Inf (FP8: the NaN codes; ``engines.landed``): each bucket's
   entries are read as the bucket arrives, on the receiving thread, while it is hot from the transport
   (``received``, called by ``streaming.applier.ApplyStage.put``) — the landed hash of 2 proves the staged bytes are
   those; called directly (``apply``), the landed box itself.

Nothing is read again at the vote: the check's cost is per bucket and per piece, on the receiver's threads,
overlapped with the stream. What the landed read does not see: a write into a box's staging after its own copy returned (another
box's copy straying into it; the HF and memory engines run no post-processing on staged bytes before commit).

Factor channels (the engine merges streamed factors, ``factor_stream.receiver.FactorEngine``): the wrapper sits
between the ``FactorEngine`` and the engine, so 1-3 hold for every engine tensor of the update — plain tensors
(the trainers' bytes) and merged targets (the bytes the engine's merge handed over, finite as served); the factor
blocks and pristine base boxes are compared as the receiver stored them with what the verified buckets handed it
(``check_landed``, values when the receiver widens bf16 factors to float32).

One check per channel owner (``ServedChecks``): each WeightSync's channel installs its own, which judges only the
updates its own ``AppliedDigests`` began (matched by update token), so a second sync on the engine neither judges
the first's updates with digests it never saw nor removes the first's check.

Modes: ``"off"`` (not installed), ``"log"`` (a warning per refused version, counted in ``ServedCheck.refusals``;
the version commits; the number of findings goes back in the engine's receive report, ``findings``, to the push's
``SyncMetrics`` and ``weightsync_served_check_findings_total``), ``"enforce"`` (``CommitRefused``: the engine aborts
its update, keeps serving the previous version, and the push aborts the version on every engine).

Engines: transformers and memory get all three here (``staged_buffer``: the staging in this process). vLLM (in
process, and a server's worker) stages in its worker: check 1 is counted here, in front of the engine (the
trainers' naming); checks 2 and 3 run in the worker, each box read as it lands in its checkpoint-format staging
(``CheckpointStore.record_applied`` / ``staged_problems``, reached through ``StagedUpdate.extra``: ``"rpc"`` in
process, ``"sync"`` in a server's worker), against the bytes the worker was handed.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence

import torch
import xxhash

from protocols.params import Box, box_numel
from protocols.wire import PlanEntry
from sync_service.dtypes import TORCH_DTYPES
from sync_service.engines.commit_gate import CommitRefused, StagedUpdate
from sync_service.engines.landed import Landed, finite
from sync_service.streaming.views import as_byte_tensor

__all__ = ["CHECK_NAME", "MODES", "AppliedDigests", "ServedCheck", "ServedChecks", "findings", "finite", "install"]

MODES = ("off", "log", "enforce")
CHECK_NAME = "served"
"""The check's name in the engine's ``CommitGate`` (``set_check``) and in its refusals."""
WRONG_BYTES = "holds other bytes than the trainers sent (not applied, or corrupted after the transport's checksum)"
"""The finding of a box whose staged bytes are not the bytes handed over (after ``name: box [...]``)."""

_log = logging.getLogger("weightsync.served_check")


class AppliedDigests:
    """The engine as the receiver sees it, recording what every ``apply`` hands it and how it landed (module
    docstring): per name the boxes applied, the first box whose landed bytes differ (``wrong``), the names holding
    NaN / Inf (``nonfinite``). Everything else is the wrapped engine's.

    Args:
        engine: the ``EngineAdapter`` (HF, memory, vLLM in process, a vLLM server's worker engine).
    """

    def __init__(self, engine: object) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self.boxes: dict[str, set[Box]] = {}
        self.update_id: object = None
        """The token of the update this wrapper began last (the ``ServedChecks`` dispatch key)."""
        self.repeated: list[tuple[str, Box]] = []
        self.announced: tuple[str, ...] = ()
        self.wrong: dict[str, Box] = {}
        self.nonfinite: set[str] = set()
        self.numel = {m.name: math.prod(m.shape) for m in engine.param_metas()}
        self.staged_buffer = getattr(engine, "staged_buffer", None)
        """``name -> its staging buffer`` where the engine stages in this process; ``None`` elsewhere (vLLM)."""
        self._landed = Landed()
        self._flat: dict[str, tuple[torch.Tensor, object]] = {}  # name → (staging buffer, its bytes) this sync
        chunk = getattr(engine, "apply_chunk_bytes", None)
        if chunk is not None:
            self.apply_chunk_bytes = chunk  # protocols.interfaces.ChunkedApply, as the engine declares

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)

    def begin_update(self, version: int, names: Sequence[str], **kwargs: object) -> object:
        with self._lock:
            self.boxes, self.repeated, self.announced = {}, [], tuple(dict.fromkeys(names))
            self.wrong, self.nonfinite, self.update_id, self._flat = {}, set(), None, {}
        self.update_id = self.engine.begin_update(version, names, **kwargs)
        return self.update_id

    def _record(self, name: str, box: Box) -> Box:
        box = tuple(map(tuple, box))
        with self._lock:
            held = self.boxes.get(name)
            if held is None:
                held = self.boxes[name] = set()
            if box in held:
                self.repeated.append((name, box))
            held.add(box)
        return box

    def _landed_bytes(self, name: str, box: Box):
        """The bytes of ``box`` as staged for ``name`` (``Landed.bytes``; the buffer's own bytes kept per sync)."""
        held = self._flat.get(name)
        if held is None:
            buf = self.staged_buffer(name)
            flat = buf.reshape(-1).view(torch.uint8).numpy() if buf.device.type == "cpu" and buf.is_contiguous() else None
            held = self._flat[name] = (buf, flat)
        return self._landed.bytes(held[0], box, held[1])

    def apply_landed(self, name: str, box: Box, data: torch.Tensor):
        """Apply ``data`` and return its bytes as they landed in the engine's staging (``Landed.bytes``: valid until
        the next call on this thread). The receiver hashes them into the bucket's checksum
        (``streaming.applier.apply_hashed``; ``landed_mismatch`` when they do not match); their finiteness was
        recorded as the bucket arrived (``received``)."""
        box = self._record(name, box)
        self.engine.apply(name, box, data)
        if self.staged_buffer is None:
            return self._landed.bytes(data)
        return self._landed_bytes(name, box)

    def received(self, entries: Sequence[PlanEntry], payload: object) -> None:
        """A bucket arrived (``streaming.applier.ApplyStage.put``, on the receiving thread, before the apply thread
        copies it): record the entries holding NaN / Inf, reading the bucket while it is hot from the transport.
        The landed hash proves the staged bytes are these, so this is the finiteness of what will be served."""
        if self.staged_buffer is None:  # staged in a vLLM worker: checked there
            return
        buf = as_byte_tensor(payload)
        raw = buf.numpy() if buf.device.type == "cpu" else buf
        for e in entries:
            if not self._landed.finite(raw[e.offset:e.offset + e.nbytes], TORCH_DTYPES[e.dtype]):
                with self._lock:
                    self.nonfinite.add(e.name)

    def landed_mismatch(self, pieces: Sequence[tuple[str, Box, torch.Tensor]]) -> None:
        """A bucket's landed bytes did not hash to its checksum while the bytes handed over did: record the
        ``(name, box, handed data)`` pieces whose staged box differs."""
        for name, box, data in pieces:
            if self.staged_buffer is not None and not self._same(self._landed_bytes(name, box), data):
                self.wrong.setdefault(name, tuple(map(tuple, box)))

    def apply(self, name: str, box: Box, data: torch.Tensor) -> None:
        box = self._record(name, box)
        self.engine.apply(name, box, data)
        if self.staged_buffer is not None:
            self._judge(name, box, data, self._landed_bytes(name, box), data.dtype)

    def check_landed(self, name: str, box: Box, handed: torch.Tensor, stored: torch.Tensor) -> None:
        """Record whether ``stored`` (where ``handed`` was kept; another dtype: its values) holds the bytes handed
        over and is finite. Thread safe (a factor receiver's merge workers apply meanwhile)."""
        if handed.dtype != stored.dtype:
            handed = handed.to(stored.dtype)
        self._judge(name, box, handed, self._landed.bytes(stored), stored.dtype)

    def _judge(self, name: str, box: Box, handed: torch.Tensor, landed, dtype: torch.dtype) -> None:
        ok = self._landed.finite(landed, dtype)  # first: _same may reuse the scratch ``landed`` lies in
        same = self._same(landed, handed)
        if not (same and ok):
            with self._lock:
                if not same:
                    self.wrong.setdefault(name, tuple(map(tuple, box)))
                if not ok:
                    self.nonfinite.add(name)

    def _same(self, landed, handed: torch.Tensor) -> bool:
        """Whether the landed bytes (``Landed.bytes``) have the digest of ``handed``'s."""
        def digest(raw) -> int:
            return xxhash.xxh3_64_intdigest(raw.cpu().numpy() if isinstance(raw, torch.Tensor) else raw)

        return digest(landed) == digest(self._landed.bytes(handed))


class ServedCheck:
    """The ``CommitGate`` check (module docstring). ``digests``: the ``AppliedDigests`` in front of the engine;
    ``mode``: ``"log"`` or ``"enforce"``; ``engine``: its name in messages."""

    def __init__(self, digests: AppliedDigests, mode: str, engine: str) -> None:
        if mode not in ("log", "enforce"):
            raise ValueError(f"check_served={mode!r}: use one of {MODES}")
        self.digests, self.mode, self.engine = digests, mode, engine
        self.refusals = 0
        """Versions the check found wrong (under ``log`` they committed anyway)."""
        self.checked = 0
        self.last: tuple[object, int] | None = None
        """``(update token, findings)`` of the update judged last: the problems found (0: clean)."""

    def __call__(self, update: StagedUpdate) -> None:
        try:
            problems = self.problems(update)
        except Exception as exc:  # noqa: BLE001 - under log a failing check never stops a version
            if self.mode == "enforce":
                raise
            problems = [f"the check failed: {type(exc).__name__}: {exc}"]
        self.checked += 1
        self.last = (update.update_id, len(problems))
        if not problems:
            return
        self.refusals += 1
        message = f"{len(problems)} problem(s): " + "; ".join(problems[:5])
        if self.mode == "enforce":
            raise CommitRefused(message)
        _log.warning("%s: version %s: served check (log only, committing anyway): %s", self.engine, update.version,
                     message)

    def problems(self, update: StagedUpdate) -> list[str]:
        """What is wrong with ``update`` (empty: nothing), each naming the tensor and the cause, from what
        ``AppliedDigests`` recorded as the boxes landed; a vLLM worker's staging is asked (``update.extra``)."""
        d = self.digests
        out = [f"{n}: box {list(map(list, b))} applied more than once" for n, b in d.repeated[:3]]
        out += [f"{n}: applied but not announced for version {update.version}"
                for n in sorted(set(d.boxes) - set(d.announced))]
        for name in d.announced:
            got, numel = sum(box_numel(b) for b in d.boxes.get(name, ())), d.numel.get(name)
            if got != numel:
                out.append(f"{name}: {got} of {numel} elements applied (a tensor the plan promised is missing)")
        out += [f"{n}: box {list(map(list, b))} {WRONG_BYTES}" for n, b in d.wrong.items()]
        out += [f"{n}: holds NaN/Inf (would be served)" for n in sorted(d.nonfinite)]
        if d.staged_buffer is None:  # staged in a vLLM worker: bytes and finiteness checked there (CheckpointStore)
            rpc, sync = update.extra.get("rpc"), update.extra.get("sync")
            if rpc is not None:
                out += list(rpc("ws_staged_problems"))
            elif sync is not None:
                out += sync.store.staged_problems()
            else:
                out.append(f"{update.engine}: applied bytes and finiteness not checked (the engine offers neither "
                           f"staged_buffer nor a worker's staging)")
        return out


class ServedChecks:
    """The gate's one ``"served"`` check: per channel owner its ``ServedCheck``; an update is judged by the check
    whose ``AppliedDigests`` began it (same update token), and by no other. An update no channel's wrapper began
    (a peer copy, a factor channel) is not checked here."""

    def __init__(self) -> None:
        self.by_owner: dict[str, ServedCheck] = {}

    def __call__(self, update: StagedUpdate) -> None:
        for check in list(self.by_owner.values()):
            if check.digests.update_id is not None and check.digests.update_id == update.update_id:
                check(update)
                return


def findings(engine: object, owner: str = "") -> int | None:
    """The served check's findings (problems, each a tensor and a cause) for the update ``owner``'s check judged
    last, if that is the update its ``AppliedDigests`` began last (the one just received): 0 when clean; ``None``
    when ``owner`` has no check installed (``"off"``, an engine without a gate) or it has not judged that update.
    Under ``"log"`` a version with findings commits; the receive report carries the count
    (``ReceiveReport.served_findings``) to the push's ``SyncMetrics`` and the Prometheus metrics."""
    gate = getattr(engine, "commit_gate", None)
    checks = None if gate is None else gate.check(CHECK_NAME)
    check = checks.by_owner.get(owner) if isinstance(checks, ServedChecks) else None
    if check is None or check.last is None or check.digests.update_id is None:
        return None
    token, count = check.last
    return count if token == check.digests.update_id else None


def install(engine: object, mode: str, name: str, owner: str = "") -> object:
    """Install ``owner``'s served check on ``engine``'s ``CommitGate`` (``mode`` ``"log"`` / ``"enforce"``; ``"off"``
    removes that owner's) and return the updater ``owner``'s receiver should apply to (``AppliedDigests`` over
    ``engine``, or ``engine`` itself when off or when the engine has no gate). Other owners' checks stay as they are.

    Raises:
        ValueError: ``mode`` is not one of ``MODES``.
    """
    if mode not in MODES:
        raise ValueError(f"check_served={mode!r}: use one of {MODES}")
    gate = getattr(engine, "commit_gate", None)
    if gate is None:
        return engine
    checks = gate.check(CHECK_NAME)
    checks = checks if isinstance(checks, ServedChecks) else ServedChecks()
    digests = None
    if mode == "off":
        checks.by_owner.pop(owner, None)
    else:
        digests = AppliedDigests(engine)
        checks.by_owner[owner] = ServedCheck(digests, mode, name)
    gate.set_check(CHECK_NAME, checks if checks.by_owner else None)
    record = getattr(engine, "record_applied", None)  # an engine that stages elsewhere records there (vLLM)
    if record is not None:
        record(bool(checks.by_owner))
    return engine if digests is None else digests


def validate_mode(mode: object) -> str:
    """``mode`` if it is one of ``MODES``. Raises ``ValueError`` naming the choices."""
    if mode not in MODES:
        raise ValueError(f"check_served={mode!r}: use one of {', '.join(MODES)}")
    return str(mode)

