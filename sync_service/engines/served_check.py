"""The served check: a pre-commit check of the engine's ``CommitGate`` (``SyncConfig.check_served``).

Before an engine may vote for a version (the end of ``finish_update``, ``engines.commit_gate``), it confirms
what it is about to serve:

1. **Applied exactly once.** Every tensor the sync announced received boxes covering each of its elements
   exactly once (elements counted per name and no box received twice, by ``AppliedDigests``, which sits
   between the receiver and the engine and counts independently of the engine's own bookkeeping), and
   nothing outside the announcement was applied.
2. **The applied bytes are the bytes sent.** ``AppliedDigests`` takes xxh3_64 of every box as it comes
   out of the verified bucket (the bucket's xxh3_64 and HMAC passed: these are the trainers' bytes); the
   check digests the same box of the staged tensor the engine will serve. A difference is a corruption after
   the transport's checksum (in the engine's copy, a conversion, a reload).
3. **Finite.** Every staged floating tensor is free of NaN / Inf (FP8: the NaN bytes).

One check per channel owner (``ServedChecks``): each WeightSync's channel installs its own, which judges only the
updates its own ``AppliedDigests`` began (matched by update token), so a second sync on the engine neither judges
the first's updates with digests it never saw nor removes the first's check.

Modes: ``"off"`` (not installed), ``"log"`` (a warning per refused version, counted in ``ServedCheck.refusals``;
the version commits), ``"enforce"`` (``CommitRefused``: the engine aborts its update, keeps serving the
previous version, and the push aborts the version on every engine).

Engines: transformers and memory get all three here (staged values in this process: ``StagedUpdate.values``). vLLM
(in process, and a server's worker) stages in its worker: check 1 is counted here, in front of the engine (the
trainers' naming); checks 2 and 3 run in the worker over its checkpoint-format staging
(``CheckpointStore.record_applied`` / ``staged_problems``, reached through ``StagedUpdate.extra``: ``"rpc"`` in
process, ``"sync"`` in a server's worker), on the boxes the worker was handed.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping, Sequence

import torch
import xxhash

from protocols.params import Box, box_numel
from sync_service.engines.commit_gate import CommitRefused, StagedUpdate
from sync_service.engines.readback import tensor_bytes

__all__ = ["CHECK_NAME", "MODES", "AppliedDigests", "ServedCheck", "ServedChecks", "finite", "install"]

MODES = ("off", "log", "enforce")
CHECK_NAME = "served"
"""The check's name in the engine's ``CommitGate`` (``set_check``) and in its refusals."""
_NAN_BYTES = {torch.float8_e4m3fn: (0x7F, 0x7F), torch.float8_e5m2: (0x7C, 0x7C), torch.float8_e8m0fnu: (0xFF, 0xFF)}
"""FP8 dtype → (mask, value): a byte ``b`` is NaN / Inf when ``b & mask == value`` (torch has no isfinite for them)."""

_log = logging.getLogger("weightsync.served_check")


class AppliedDigests:
    """The engine as the receiver sees it, recording what every ``apply`` hands it: per name the boxes and the
    xxh3_64 of each box's bytes. Everything else is the wrapped engine's.

    Args:
        engine: the ``EngineAdapter`` (HF, memory, vLLM in process).
    """

    def __init__(self, engine: object) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self.boxes: dict[str, dict[Box, str]] = {}
        self.update_id: object = None
        """The token of the update this wrapper began last (the ``ServedChecks`` dispatch key)."""
        self.repeated: list[tuple[str, Box]] = []
        self.announced: tuple[str, ...] = ()
        self.numel = {m.name: math.prod(m.shape) for m in engine.param_metas()}
        chunk = getattr(engine, "apply_chunk_bytes", None)
        if chunk is not None:
            self.apply_chunk_bytes = chunk  # protocols.interfaces.ChunkedApply, as the engine declares

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)

    def begin_update(self, version: int, names: Sequence[str], **kwargs: object) -> object:
        with self._lock:
            self.boxes, self.repeated, self.announced = {}, [], tuple(dict.fromkeys(names))
            self.update_id = None
        self.update_id = self.engine.begin_update(version, names, **kwargs)
        return self.update_id

    def apply(self, name: str, box: Box, data: torch.Tensor) -> None:
        box = tuple(tuple(d) for d in box)
        digest = xxhash.xxh3_64_hexdigest(tensor_bytes(data))
        with self._lock:
            held = self.boxes.setdefault(name, {})
            if box in held:
                self.repeated.append((name, box))
            held[box] = digest
        self.engine.apply(name, box, data)


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

    def __call__(self, update: StagedUpdate) -> None:
        try:
            problems = self.problems(update)
        except Exception as exc:  # noqa: BLE001 - under log a failing check never stops a version
            if self.mode == "enforce":
                raise
            problems = [f"the check failed: {type(exc).__name__}: {exc}"]
        self.checked += 1
        if not problems:
            return
        self.refusals += 1
        message = f"{len(problems)} problem(s): " + "; ".join(problems[:5])
        if self.mode == "enforce":
            raise CommitRefused(message)
        _log.warning("%s: version %s: served check (log only, committing anyway): %s", self.engine, update.version,
                     message)

    def problems(self, update: StagedUpdate) -> list[str]:
        """What is wrong with ``update`` (empty: nothing), each naming the tensor and the cause. The staged values
        (``update.values``, the engine table's names) are compared where the engine holds them in this process."""
        boxes, repeated, announced = self.digests.boxes, self.digests.repeated, self.digests.announced
        out = [f"{n}: box {list(map(list, b))} applied more than once" for n, b in repeated[:3]]
        out += [f"{n}: applied but not announced for version {update.version}" for n in sorted(set(boxes) - set(announced))]
        for name in announced:
            got, numel = sum(box_numel(b) for b in boxes.get(name, {})), self.digests.numel.get(name)
            if got != numel:
                out.append(f"{name}: {got} of {numel} elements applied (a tensor the plan promised is missing)")
        values = update.values() if update.values is not None else None
        if values is None:  # staged in a vLLM worker: bytes and finiteness checked there (CheckpointStore)
            rpc, sync = update.extra.get("rpc"), update.extra.get("sync")
            if rpc is not None:
                out += list(rpc("ws_staged_problems"))
            elif sync is not None:
                out += sync.store.staged_problems()
            return out
        for name in announced:
            tensor = values.get(name)
            if tensor is None:
                out.append(f"{name}: announced but not staged by the engine")
                continue
            for box, digest in boxes.get(name, {}).items():
                view = tensor[tuple(slice(a, b) for a, b in box)]
                if xxhash.xxh3_64_hexdigest(tensor_bytes(view)) != digest:
                    out.append(f"{name}: box {list(map(list, box))} holds other bytes than the trainers sent "
                               f"(not applied, or corrupted after the transport's checksum)")
                    break
            if not finite(tensor):
                out.append(f"{name}: holds NaN/Inf (would be served)")
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


def finite(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds no NaN / Inf (FP8: no NaN byte); integers always."""
    nan = _NAN_BYTES.get(tensor.dtype)
    if nan is not None:
        mask, value = nan
        return not bool(((tensor.view(torch.uint8) & mask) == value).any())
    if not tensor.is_floating_point():
        return True
    if bool(torch.isfinite(tensor.sum())):  # NaN / Inf propagate through a sum: a finite sum means all finite
        return True
    return bool(torch.isfinite(tensor).all())  # a non-finite sum may be an overflow: look element by element


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

