"""``CommitGate``: the engine's authority over its weight versions — one per engine, every engine kind.

An engine, not the coordinator that pushes to it, decides what it serves. Every engine adapter keeps
one ``CommitGate`` where its served weights live (``HFEngine``, ``MemoryEngine``, ``VLLMEngine`` in
process, and for a vLLM server the ``WorkerEngine`` inside the server's worker), and every update goes
through it:

1. ``begin(version, reset_versions=)`` fences the update and hands out its **update token** (the
   ``update_id``, a random hex string). Refused (``UpdateInProgressError``) while another update is
   staged, naming the version in progress; refused (``VersionFenceError``) for a version at or below
   the one served, unless the caller asked for ``reset_versions`` (then explicit here too). Nothing is
   staged after a refusal, and nothing of the staged update changes.
2. ``prepare(update)`` runs the **pre-commit checks** at the end of ``finish_update`` (after the
   engine's completeness check and post-load processing, before the receiver acks): the engine's vote
   of the two-phase commit. A check is ``check(update: StagedUpdate) -> None`` that raises
   ``CommitRefused`` to refuse; any other exception refuses too (named). The engine then aborts its own
   update (the previous version stays served) and the refusal reaches the coordinator as the receive's
   error, so the version is aborted on every engine. Checks plug in by name (``set_check``).
3. ``check_commit(version, update_id)`` at ``commit``: the token must be the staged update's (another
   owner's commit or abort never acts on it), its version the one begun, finished, and still above the
   served one (or begun with ``reset_versions``). ``committed`` records the new served version.
4. ``owns(update_id)`` at ``abort``: an abort with another update's token does nothing; ``None``
   (a caller that holds no token: a single-owner test or tool) drops whatever is staged.

Thread safe (one lock); the engine does its own staging, apply and swap around these calls.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = ["CommitGate", "CommitRefused", "ForeignCommit", "PreCommitCheck", "StagedUpdate", "UpdateInProgressError",
           "VersionFenceError"]

RESET_HINT = "reset_versions (SyncConfig(reset_versions=True); weightsync sync|demo|run: --reset-versions)"
"""The setting that lets an engine take a version at or below the one it serves."""


class CommitRefused(RuntimeError):
    """The engine's gate refused an update (a fence, a token that is not the staged update's, a check)."""


class VersionFenceError(CommitRefused):
    """A version at or below the one the engine serves, without ``reset_versions``."""


class ForeignCommit(CommitRefused):
    """A commit with a token that is not the staged update's (nothing of the staged update changes)."""


class UpdateInProgressError(RuntimeError):
    """``begin_update`` while another update is staged on the engine (commit or abort it first)."""


@dataclass(frozen=True, slots=True)
class StagedUpdate:
    """What a pre-commit check sees of the update the engine is about to vote for.

    Attributes:
        engine: the engine's name in messages (``"HFEngine"``, ``"vllm-server worker"``).
        update_id: the update's token. version: the version it would serve. served: the version served
            now (``None``: nothing committed). reset_versions: begun with ``reset_versions``.
        names: the tensors the update announced (the engine table's names), in order.
        applied: elements applied per announced name (each box of a sync is disjoint; a complete
            update has ``applied[n] == numel(n)``).
        values: the staged values by name, on the engine's device, read without copying — where the
            engine holds them in this process (HF, memory: the staging buffers; a vLLM worker: the
            checkpoint-format staging); ``None`` where it cannot. Valid only during the check.
        extra: engine-specific facts a check may use (documented by the engine that sets them).
    """

    engine: str
    update_id: str
    version: int
    served: int | None
    reset_versions: bool
    names: tuple[str, ...]
    applied: Mapping[str, int] = field(default_factory=dict)
    values: Callable[[], Mapping[str, object]] | None = None
    extra: Mapping[str, object] = field(default_factory=dict)


PreCommitCheck = Callable[[StagedUpdate], None]
"""A pre-commit check: returns to vote yes, raises ``CommitRefused`` (its message names the tensor and
the cause) to refuse the update. Runs on the engine, at the end of ``finish_update``."""


@dataclass(slots=True)
class _Update:
    update_id: str
    version: int
    reset_versions: bool
    prepared: bool = False


class CommitGate:
    """See the module docstring. ``engine``: the name refusals carry."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._served: int | None = None
        self._staged: _Update | None = None
        self._checks: dict[str, PreCommitCheck] = {}

    # -- state -----------------------------------------------------------------------------
    @property
    def served(self) -> int | None:
        """The committed version the engine serves (``None``: nothing committed)."""
        return self._served

    @property
    def staged_version(self) -> int | None:
        """The version of the update staged (``None``: none)."""
        staged = self._staged
        return None if staged is None else staged.version

    @property
    def staged_id(self) -> str | None:
        """The token of the update staged (``None``: none)."""
        staged = self._staged
        return None if staged is None else staged.update_id

    # -- checks ----------------------------------------------------------------------------
    def set_check(self, name: str, check: PreCommitCheck | None) -> None:
        """Install ``check`` under ``name`` (replacing one of that name); ``None`` removes it. Checks run in
        the order they were first installed."""
        with self._lock:
            if check is None:
                self._checks.pop(name, None)
            else:
                self._checks[name] = check

    def check(self, name: str) -> PreCommitCheck | None:
        """The check installed under ``name`` (``None``: none)."""
        with self._lock:
            return self._checks.get(name)

    def check_names(self) -> list[str]:
        with self._lock:
            return list(self._checks)

    # -- lifecycle -------------------------------------------------------------------------
    def begin(self, version: int, *, reset_versions: bool = False) -> str:
        """Fence a new update of ``version``; returns its token.

        Raises:
            UpdateInProgressError: another update is staged (naming its version).
            VersionFenceError: ``version`` is at or below the served one and ``reset_versions`` is false.
        """
        with self._lock:
            if self._staged is not None:
                raise UpdateInProgressError(
                    f"{self.engine}: begin_update({version}) refused: version {self._staged.version} is in progress "
                    f"(another sync's update); it commits or aborts first, then push again")
            self._fence(version, reset_versions, "begin_update")
            self._staged = _Update(secrets.token_hex(8), version, reset_versions)
            return self._staged.update_id

    def begin_staged(self, version: int, stage: Callable[[], None], *, reset_versions: bool = False) -> str:
        """``begin``, then ``stage()`` (the engine's own staging of the update); returns the token. A failing
        ``stage`` drops the update it begun and re-raises, so nothing stays fenced. Raises ``begin``'s refusals."""
        update_id = self.begin(version, reset_versions=reset_versions)
        try:
            stage()
        except BaseException:
            self.dropped(update_id)
            raise
        return update_id

    def staged_update(self, names, applied: Mapping[str, int] | None = None,
                      values: Callable[[], Mapping[str, object]] | None = None,
                      extra: Mapping[str, object] | None = None) -> StagedUpdate:
        """The ``StagedUpdate`` of the update staged, with the engine's ``names`` / ``applied`` / ``values``.

        Raises:
            CommitRefused: no update is staged.
        """
        staged = self._staged
        if staged is None:
            raise CommitRefused(f"{self.engine}: no update is staged")
        return StagedUpdate(engine=self.engine, update_id=staged.update_id, version=staged.version,
                            served=self._served, reset_versions=staged.reset_versions, names=tuple(names),
                            applied=dict(applied or {}), values=values, extra=dict(extra or {}))

    def prepare(self, update: StagedUpdate) -> None:
        """Run every pre-commit check on ``update`` (the staged one); marks it prepared when all pass.

        Raises:
            CommitRefused: a check refused or failed (named); the caller aborts its update.
        """
        with self._lock:
            staged = self._staged
            if staged is None or staged.update_id != update.update_id:
                raise CommitRefused(f"{self.engine}: prepare of update {update.update_id} that is not staged")
            checks = list(self._checks.items())
        for name, check in checks:
            try:
                check(update)
            except CommitRefused as exc:
                raise CommitRefused(f"{self.engine}: version {update.version} refused by the {name} check: {exc}") \
                    from None
            except Exception as exc:  # noqa: BLE001 - a failing check refuses, named
                raise CommitRefused(f"{self.engine}: version {update.version} refused: the {name} check failed: "
                                    f"{type(exc).__name__}: {exc}") from None
        with self._lock:
            if self._staged is staged:
                staged.prepared = True

    def owns(self, update_id: str | None) -> bool:
        """Whether ``update_id`` may act on the staged update: it is its token, or ``None`` (the caller
        holds none) while an update is staged."""
        staged = self._staged
        return staged is not None and (update_id is None or staged.update_id == update_id)

    def check_commit(self, version: int, update_id: str | None, *, finished: bool) -> str:
        """The staged update's token if ``commit(version)`` with ``update_id`` may go on.

        Raises:
            CommitRefused: ``update_id`` is not the staged update's (the staged update is kept: it belongs
                to another sync); or — for the staged update itself, which the caller then aborts —
                ``version`` is not the one begun, it is not finished and prepared, or it is at or below
                the served version without ``reset_versions``.
        """
        with self._lock:
            staged = self._staged
            if staged is None or (update_id is not None and staged.update_id != update_id):
                raise ForeignCommit(
                    f"{self.engine}: commit({version}) refused: update {update_id} is not the one staged "
                    f"(staged: {None if staged is None else f'version {staged.version}'}); version {self._served} "
                    f"stays served")
            if staged.version != version or not finished or not staged.prepared:
                raise CommitRefused(
                    f"commit({version}): no finished update of that version (in progress: {staged.version}, "
                    f"finished: {finished and staged.prepared}); the staged update is dropped, version "
                    f"{self._served} stays served")
            self._fence(version, staged.reset_versions, "commit")
            return staged.update_id

    def vote(self, abort: Callable[[str | None], object], names, applied: Mapping[str, int] | None = None,
             values: Callable[[], Mapping[str, object]] | None = None,
             extra: Mapping[str, object] | None = None) -> None:
        """``prepare`` the staged update (the engine's ``finish_update`` calls this last); on a refusal
        ``abort(update_id)`` drops the engine's own update, then the ``CommitRefused`` is raised."""
        update_id = self.staged_id
        try:
            self.prepare(self.staged_update(names, applied, values, extra))
        except CommitRefused:
            abort(update_id)
            raise

    def admit_commit(self, version: int, update_id: str | None, *, finished: bool,
                     abort: Callable[[str | None], object]) -> str:
        """``check_commit``; a refusal of the staged update itself calls ``abort(update_id)`` first (a
        ``ForeignCommit`` leaves the staged update alone). Returns the staged update's token."""
        try:
            return self.check_commit(version, update_id, finished=finished)
        except ForeignCommit:
            raise
        except CommitRefused:
            abort(update_id)  # a refused commit leaves nothing staged: the next sync begins cleanly
            raise

    def committed(self, version: int) -> None:
        """The staged update is served now, as ``version``."""
        with self._lock:
            self._served, self._staged = version, None

    def dropped(self, update_id: str | None = None) -> bool:
        """Forget the staged update if ``update_id`` owns it (``owns``); returns whether one was dropped."""
        with self._lock:
            if self._staged is None or (update_id is not None and self._staged.update_id != update_id):
                return False
            self._staged = None
            return True

    def _fence(self, version: int, reset_versions: bool, call: str) -> None:
        if not reset_versions and self._served is not None and version <= self._served:
            raise VersionFenceError(
                f"{self.engine}: {call}({version}) refused: this engine serves version {self._served}; an engine "
                f"commits only a version above the one it serves; push {self._served + 1} or later, or pass "
                f"{RESET_HINT}")
