"""``Coordinator``: drives syncs between trainer endpoints and rollout endpoints (driver side).

One sync of version v (the calls are ``protocols.endpoints``'):
  1. ``snapshot(v)`` on every trainer (``SnapshotReport``: the names a delta needs);
  2. a ``Transfer`` (``transfer.py``): every engine ``receive``s while every trainer ``send``s —
     phase 1; the first failure cancels the round at once;
  3. all prepared → every engine ``commit(v)`` — phase 2; otherwise every live engine ``abort()``s
     (the previous version stays served) and ``SyncError`` names each endpoint's error.

Full sync the first time and whenever an engine has not received one yet; otherwise delta (the
``SyncMode``, ``modes.py``, chooses the names). An engine whose actor died, or that gave no answer
at all within ``timeout_s`` + grace (a cut link, a hung process), leaves the membership
(``membership.py``) and the same snapshot goes again to the others. A late joiner is brought
to the fleet's version by a peer copy (``join.py``). Membership changes and failed pushes open the
channel again (``channel.py``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence

from protocols.endpoints import EndpointDiedError, EndpointError, SendRequest
from protocols.wire import SyncPlan, encode
from sync_service.coordinator.calls import alive, call_all, settle
from sync_service.coordinator.channel import CLOSE_TIMEOUT_S, Channel
from sync_service.coordinator.join import JoinMetrics, peer_copy
from sync_service.coordinator.membership import Membership
from sync_service.coordinator.metrics import EngineResult, SyncError, SyncMetrics
from sync_service.coordinator.modes import MergedMode, SyncMode
from sync_service.coordinator.planning import check_plan_size, engine_dtypes, scale_companions, with_scales
from sync_service.coordinator.transfer import GRACE_S, Prepared, Transfer
from sync_service.coordinator.versions import check_push_version
from sync_service.security import new_secret

__all__ = ["Coordinator"]

log = logging.getLogger(__name__)


class Coordinator:
    """Plans once, validates every engine before any byte moves, and runs syncs (blocking).

    ``mode(trainers, get)`` makes the ``SyncMode`` (default ``MergedMode``); ``get(refs, what)`` waits
    for calls on the trainers and raises their ``EndpointError``.

    Raises (constructor):
        ValueError: no trainers. PlanMismatchError: an engine's table does not fit.
        EndpointError: an endpoint failed while planning or opening the channel (what this
        coordinator opened is closed again; other coordinators on the same actors are untouched).
    """

    def __init__(self, trainers: Sequence, engines: Sequence, config,
                 mode: Callable[[Sequence, Callable[[list, str], list]], SyncMode] | None = None) -> None:
        if not trainers:
            raise ValueError("WeightSync needs at least one trainer shard")
        self.config = config
        self.trainers = list(trainers)
        self.trainer_names = [f"trainer rank {r}" for r in range(len(self.trainers))]
        self.members = Membership()
        self.versions = self.members.versions
        self.joins: list[JoinMetrics] = []
        self.served: dict[str, int | None] = {}
        self._reset_joiners: set[str] = set()  # engines admitted with add_engine(..., reset_versions=True)
        self._continue_from: dict[str, int] = {}  # add_engine(..., continue_above=True): name -> its version
        """Engine name → the version it served when this coordinator was made (a push must go above it)."""
        self._secret = config.secret if config.secret is not None else new_secret()  # HMAC key of every bucket
        self._mode = MergedMode() if mode is None else mode(self.trainers, self._trainer_get)
        owned = self._trainer_get([t.owned_metas.remote() for t in self.trainers], "owned_metas")
        described: list[tuple[str, list, int | None]] = []  # the engines' tables decide the dtypes sent
        for engine in engines:
            described.append(self._describe(engine, taken=[d[0] for d in described]))
        owned, conversions = engine_dtypes([list(m) for m in owned], {name: table for name, table, _ in described})
        self.conversions: dict[tuple[str, str], int] = conversions
        """(trainer dtype, engine dtype) → number of tensors the trainers cast into the engines' dtype (the plan's
        summary of ``planning.engine_dtypes``; empty when the engines hold the trainers' dtypes)."""
        if self.conversions:
            log.info("plan: tensors cast into the engines' dtype: %s",
                     ", ".join(f"{n} {a} -> {b}" for (a, b), n in sorted(self.conversions.items())))
        check_plan_size(owned, bucket_bytes=config.bucket_bytes)  # before seconds of splitting
        self._plan = self._mode.build_plan(owned, bucket_bytes=config.bucket_bytes)
        self._scales = scale_companions(self._plan)  # FP8 tensor → its scales: a delta sends both
        plan_bytes = encode(self._plan)
        check_plan_size(owned, bucket_bytes=config.bucket_bytes, encoded=len(plan_bytes))
        self._channel = Channel(owner=uuid.uuid4().hex[:8], plan_bytes=plan_bytes,
                                bucket_bytes=self._plan.bucket_bytes, secret=self._secret, config=config)
        for name, table, served in described:  # every engine fits before any is admitted
            self._mode.validate(self._plan, table, engine=name)
        for engine, (name, table, served) in zip(engines, described):
            self.served[name] = served  # a late joiner takes the fleet's version
            self.members.admit(engine, name, table, None)
        if self.members.handles:
            self._open()  # now, so the first push measures the transfer only

    @property
    def plan(self) -> SyncPlan:
        return self._plan

    @property
    def engines(self) -> list:
        return list(self.members.handles)

    @property
    def names(self) -> list[str]:
        return list(self.members.names)

    # -- membership ------------------------------------------------------------------------
    def fleet_version(self) -> int | None:
        """The highest version of this fleet's members: committed through this coordinator, else (unless
        ``config.reset_versions``) served when admitted; ``None``: none."""
        board = self.versions.snapshot()
        known = [v if v is not None else None if self.config.reset_versions else self.served.get(n)
                 for n, v in board.items()]
        return max((v for v in known if v is not None), default=None)

    def add_engine(self, engine, *, reset_versions: bool = False, continue_above: bool = False) -> str:
        """Validate a new engine against the plan, bring it to the fleet's committed version by a peer
        copy (when a member can export one), and admit it; later pushes are deltas for everyone.

        An engine never goes back: one serving a version above the fleet's is refused, unless
        ``continue_above`` (it is admitted as it is and the fleet's next push must go above its version;
        it keeps serving its own until then) or ``reset_versions`` (it takes the fleet's version, explicitly
        at the engine). One serving exactly the fleet's version is brought to the fleet's weights of it.

        Raises:
            ValueError: it serves a version above the fleet's (one line naming both and the options).
            PlanMismatchError: its table does not fit (nothing changes).
            SyncError: the peer copy failed (the engine is not admitted).
        """
        if reset_versions and continue_above:
            raise ValueError("add_engine: reset_versions and continue_above exclude each other; pick one")
        name, table, served = self._validate(engine)
        fleet = self.fleet_version()
        above = served is not None and fleet is not None and served > fleet
        if above and not (reset_versions or continue_above):
            raise ValueError(f"add_engine: engine {name} serves version {served}, above this fleet's {fleet}; a join "
                             f"would take it back to {fleet}. Pass add_engine(..., continue_above=True) to admit it as "
                             f"it is (the next push must go above {served}) or add_engine(..., reset_versions=True) to "
                             f"number it from the fleet's version")
        if continue_above and served is not None:
            self._continue_from[name] = served  # the next push must go above it, whatever reset_versions says
        peer = None if (continue_above and above) else self._pick_peer()
        if peer is None:
            joined = JoinMetrics(engine=name, source="next-push", version=None, bytes=0, buckets=0, seconds=0.0)
        else:
            self._channel.epoch += 1
            peer_name = self.members.names[peer]
            peer_version = self.versions.snapshot()[peer_name]
            joined = peer_copy(joiner=engine, joiner_name=name, joiner_table=table, peer=self.members.handles[peer],
                               peer_name=peer_name, peer_table=self.members.tables[peer_name],
                               version=peer_version, config=self.config,
                               channel=f"ws{self._channel.owner}j{self._channel.epoch}", secret=self._secret,
                               get=self._get,
                               reset_versions=reset_versions or (served is not None and served >= peer_version))
            self._mode.joined()
        if peer is None and reset_versions:
            self._reset_joiners.add(name)  # its first push is begun with reset_versions
        self.members.admit(engine, name, table, joined.version, full=peer is not None)
        self.joins.append(joined)
        return name

    def remove_engine(self, engine) -> None:
        """Stop syncing to ``engine`` (it keeps serving its last committed version). Works on an engine
        whose actor died; removing one that already left (dropped after its death) does nothing.

        Raises:
            ValueError: never a member of this coordinator.
        """
        i = self.members.index(engine)
        if i is None:
            if self.members.departed_handle(engine):
                return
            raise ValueError("remove_engine: that engine is not a member of this WeightSync")
        settle([engine.close_transport.remote(self._channel.owner)], [f"engine {self.members.names[i]}"],
               "close_transport", CLOSE_TIMEOUT_S)
        self.members.drop([i], "removed")

    def engine_versions(self) -> dict[str, int | None]:
        """Committed version per member engine, asked of the engines; an engine whose actor died is
        left out (the next push drops it from the membership)."""
        refs = [e.weight_version.remote() for e in self.members.handles]
        names = list(self.members.names)
        results, errors = settle(refs, [f"engine {n}" for n in names], "weight_version",
                                 self.config.timeout_s + GRACE_S)
        return {n: v for n, v, err in zip(names, results, errors) if err is None}

    # -- syncs -----------------------------------------------------------------------------
    def snapshot(self, version: int) -> frozenset[str] | None:
        """Freeze ``version`` on every trainer; the union of the names a delta needs (``None``: all)."""
        reports = self._trainer_get([t.snapshot.remote(version) for t in self.trainers], "snapshot")
        if any(r.changed is None for r in reports):
            return None
        return frozenset(n for r in reports for n in r.changed)

    def drop_snapshot(self, version: int) -> None:
        """The push of ``version`` will not run: the trainers forget its snapshot (best effort)."""
        settle([t.drop_snapshot.remote(version) for t in self.trainers], self.trainer_names, "drop_snapshot",
               CLOSE_TIMEOUT_S)

    def transfer(self, version: int, changed: frozenset[str] | None) -> SyncMetrics:
        """Stream the snapshot of ``version`` to every engine and commit it — or abort everywhere.

        An engine whose actor died, or that did not answer at all (unreachable), leaves the membership
        and the same snapshot goes again to the others, so they commit ``version``; the metrics report
        the lost one (``committed=False``, error "engine NAME died ..." / "... did not answer ...").

        Raises:
            SyncError: a trainer or a live engine failed; no engine committed ``version``.
        """
        t0, lost = time.perf_counter(), []
        while True:
            if not self.members.handles:
                self.drop_snapshot(version)
                raise SyncError(f"push({version}): no engines to sync to" + _left(lost), None)
            try:
                self._ensure_open(lost)
                if not self.members.handles:
                    continue
                names = with_scales(self._mode.names(version, changed, changed is None or self.members.needs_full()),
                                    self._scales)
            except EndpointError as exc:
                self._forget(version)
                raise SyncError(f"push({version}) failed before any byte moved: {exc}" + _left(lost), None) from None
            run = self._transfer_for()
            prepared = run.prepare(SendRequest(owner=self._channel.owner, session=f"{self._channel.owner}-"
                                               f"{self._channel.epoch}-v{version}", version=version,
                                               names=None if names is None else tuple(sorted(names)),
                                               timeout_s=self.config.timeout_s, check_finite=self.config.check_finite,
                                               accumulate_dtype=self.config.accumulate_dtype),
                                   reset=self._resets(run.engine_names))
            if prepared.ok:
                return self._commit(run, prepared, version, names is None, lost, t0)
            gone = prepared.lost_engines()
            run.abort(skip=gone)
            if gone and len(gone) < len(run.engines) and not prepared.trainer_died():
                lost += self._drop_lost(gone, prepared, version)
                continue  # the same snapshot, to the engines still there
            self._fail(run, prepared, version, names is None, lost, t0)

    # -- internals -------------------------------------------------------------------------
    def _transfer_for(self) -> Transfer:
        return Transfer(channel=self._channel, trainers=self.trainers, trainer_names=self.trainer_names,
                        engines=self.members.handles, engine_names=self.members.names, timeout_s=self.config.timeout_s)

    def _resets(self, names: Sequence[str]) -> list[bool]:
        """Per engine, whether its update of this push is begun with ``reset_versions``: asked for
        (``config.reset_versions``, or ``add_engine(..., reset_versions=True)``) and nothing committed on it
        through this coordinator yet. Later pushes go above what this coordinator committed anyway."""
        board = self.versions.snapshot()
        return [(self.config.reset_versions or n in self._reset_joiners) and board.get(n) is None for n in names]

    def _commit(self, run: Transfer, prepared: Prepared, version: int, full: bool, lost: list,
                t0: float) -> SyncMetrics:
        """Phase 2. Returned means committed on every member: an engine that is still a member and did not
        commit (its gate refused, its commit failed) makes the push raise ``SyncError`` (it serves its previous
        version; the metrics say which engines committed); one that died at commit leaves the membership and is
        reported in the metrics."""
        errors, commit_s = run.commit(version, [r.update_id if r is not None else None for r in prepared.received])
        committed = [n for n, e in zip(run.engine_names, errors) if e is None]
        self.members.committed(version, committed)
        self._reset_joiners.difference_update(committed)
        for name in committed:
            self._continue_from.pop(name, None)
        results = list(lost) + [_result(n, e is None, None if e is None else str(e), r)
                                for n, r, e in zip(run.engine_names, prepared.received, errors)]
        dead = [i for i, e in enumerate(errors) if isinstance(e, EndpointDiedError)]
        refused = [(n, e) for n, e in zip(run.engine_names, errors) if e is not None and
                   not isinstance(e, EndpointDiedError)]
        if dead:
            self.members.drop(dead, [f"engine {run.engine_names[i]} died at commit({version})" for i in dead])
        metrics = self._metrics(version, full, prepared, results, commit_s, t0)
        if refused:
            self._forget(version)
            raise SyncError(f"push({version}) not committed on every member: " + "; ".join(
                f"engine {n} did not commit and serves its previous version: {e}" for n, e in refused)[:2000] +
                f" (committed on: {', '.join(committed) or 'none'})" + _left(lost), metrics)
        self._mode.committed(version)
        return metrics

    def _forget(self, version: int) -> None:
        """A push of ``version`` failed: the mode forgets its delta state, the trainers the snapshot."""
        try:
            self._mode.failed()
        except EndpointError:
            pass  # a dead trainer: the push's own error says so
        self.drop_snapshot(version)

    def _fail(self, run: Transfer, prepared: Prepared, version: int, full: bool, lost: list, t0: float) -> None:
        self._forget(version)
        results = list(lost) + [_result(n, False, str(err) if err else "sync aborted", r)
                                for n, r, err in zip(run.engine_names, prepared.received, prepared.recv_errors)]
        metrics = self._metrics(version, full, prepared, results, 0.0, t0)
        raise SyncError(f"push({version}) aborted on every engine: {prepared.detail()[:2000]}", metrics)

    def _metrics(self, version: int, full: bool, prepared: Prepared, results: list, commit_s: float,
                 t0: float) -> SyncMetrics:
        metrics = SyncMetrics.from_stats(version=version, full=full, sent=[s for s in prepared.sent if s],
                                         engines=results, commit_s=commit_s, seconds=time.perf_counter() - t0)
        return self._mode.report(metrics)

    def _drop_lost(self, gone: list[int], prepared: Prepared, version: int) -> list[EngineResult]:
        names = [self.members.names[i] for i in gone]
        how = {i: "did not answer (unreachable or hung)" for i in prepared.silent}
        reasons = [f"engine {n} {how.get(i, 'died')} during push({version}) and left the membership "
                   f"(add_engine admits it again): {prepared.recv_errors[i]}" for n, i in zip(names, gone)]
        self.members.drop(gone, reasons)
        return [EngineResult(engine=n, committed=False, apply_s=0.0, payload_bytes=0, error=r)
                for n, r in zip(names, reasons)]

    def _ensure_open(self, lost: list) -> None:
        """Open the channel if the members changed or the last push failed. Engines whose actor died
        leave the membership first (an open waits for every receiver: a dead one would stall it)."""
        if self._channel.open_now and not self.members.changed:
            return
        dead = [i for i, ok in enumerate(alive(self.members.handles)) if not ok]
        if dead:
            names = [self.members.names[i] for i in dead]
            reasons = [f"engine {n} died before the push and left the membership" for n in names]
            self.members.drop(dead, reasons)
            lost += [EngineResult(engine=n, committed=False, apply_s=0.0, payload_bytes=0, error=r)
                     for n, r in zip(names, reasons)]
        if self.members.handles:
            self._open()

    def _open(self) -> None:
        self._channel.open(self.trainers, self.trainer_names, self.members.handles,
                           [f"engine {n}" for n in self.members.names])
        self.members.changed = False

    def check_version(self, version: int, previous: int | None) -> None:
        """Raises ValueError unless ``version`` is above ``previous`` (this coordinator's last push) and,
        unless ``config.reset_versions``, above what every engine served when admitted (``versions.py``)."""
        check_push_version(version, previous, self.served, reset=self.config.reset_versions)
        check_push_version(version, None, self._continue_from, reset=False)

    def _describe(self, engine, taken: Sequence[str] = ()) -> tuple[str, list, int | None]:
        """(name unique among the members and ``taken``, parameter table, served version) of ``engine``."""
        name, raw, served = self._get([engine.engine_name.remote(), engine.param_metas.remote(),
                                       engine.weight_version.remote()], "param_metas")
        name = self.members.unique_name(name)
        return (f"{name}#{len(taken)}" if name in taken else name), list(raw), served

    def _validate(self, engine) -> tuple[str, list, int | None]:
        name, table, served = self._describe(engine)
        self._mode.validate(self._plan, table, engine=name)
        return name, table, served

    def _pick_peer(self) -> int | None:
        """A member that received a full sync from this coordinator, committed a version and can export."""
        versions = self.versions.snapshot()
        for i, (engine, name) in enumerate(zip(self.members.handles, self.members.names)):
            if name in self.members.full_done and versions.get(name) is not None and \
                    self._get([engine.can_export.remote()], "can_export")[0]:
                return i
        return None

    def _get(self, refs: list, what: str, names: Sequence[str] | None = None) -> list:
        """Results of ``refs``; raises the first endpoint's ``EndpointError``."""
        return call_all(refs, names or ["engine"] * len(refs), what, self.config.timeout_s + GRACE_S)

    def _trainer_get(self, refs: list, what: str) -> list:
        """``_get`` of calls on the first ``len(refs)`` trainers (named by rank)."""
        return self._get(refs, what, self.trainer_names[:len(refs)])

    def close(self) -> None:
        """Close every channel side this coordinator opened (best effort, bounded), then its host."""
        self._channel.close(self.trainers + self.members.handles)
        self._channel.close_host()


def _result(name: str, committed: bool, error: str | None, report) -> EngineResult:
    return EngineResult(engine=name, committed=committed, error=error, apply_s=report.apply_s if report else 0.0,
                        payload_bytes=report.payload_bytes if report else 0,
                        rx_merge_s=report.rx_merge_s if report else 0.0,
                        served_findings=getattr(report, "served_findings", None))


def _left(lost: list[EngineResult]) -> str:
    return "" if not lost else " (" + "; ".join(r.error or r.engine for r in lost) + ")"
