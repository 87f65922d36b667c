"""``Coordinator``: drives syncs between TrainerShard and RolloutEngine actors (driver side).

One sync of version v:
  1. ``snapshot(v)`` on every trainer (returns the names a delta needs; ``None`` = everything);
  2. every engine ``receive`` (stages, verifies, acks) while every trainer ``send``s its buckets;
  3. all acked → every engine ``commit(v)``; any failure → every engine ``abort()`` (the previous
     version stays served everywhere) and ``SyncError`` is raised with the per-engine results.

Full sync the first time and whenever an engine has not yet received one; otherwise delta: only the
names the adapter changes. Every frame of a channel goes to all its engines, so a late joiner is
first brought to the fleet's version by a peer copy from a member engine (``join.py``): the next
push stays a delta for everyone. Only when no member holds a version it can export does the
joiner's first push go full to every member. Membership changes reopen the channel (a new
``TransportSpec`` sized to the members). ``versions`` (a ``VersionBoard``) records what each engine
committed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import replace

import ray

from actors.trainer import meta_from_list
from protocols.wire import SyncPlan, encode
from sync_service.coordinator.join import JoinMetrics, peer_copy
from sync_service.coordinator.metrics import EngineResult, SyncError, SyncMetrics
from sync_service.coordinator.planning import build_sync_plan, validate_plan
from sync_service.coordinator.versions import VersionBoard
from sync_service.security import new_secret
from sync_service.transports import TRANSPORTS, ChannelHost, TransportSpec, host_channel

def _factor_coordination(config, trainers, get):
    """``FactorCoordination`` for ``SyncConfig.mode`` "factors" / "auto", ``None`` in merged mode."""
    if getattr(config, "mode", "merged") == "merged":
        return None
    from sync_service.factor_stream.choose import FactorPolicy
    from sync_service.factor_stream.coordination import FactorCoordination

    policy = FactorPolicy(mode=config.mode, factor_memory_bytes=config.factor_memory_bytes,
                          experts_per_recipe=config.experts_per_recipe)
    return FactorCoordination(policy, trainers, get)


class Coordinator:
    """Plans once, validates every engine before any byte moves, and runs syncs (blocking)."""

    def __init__(self, trainers: Sequence, engines: Sequence, config) -> None:
        if not trainers:
            raise ValueError("WeightSync needs at least one trainer shard")
        self.config = config
        self.trainers = list(trainers)
        self.engines: list = []
        self.names: list[str] = []
        self._full_done: set[str] = set()
        self._tables: dict[str, list] = {}  # engine name -> its parameter table (ParamMeta list)
        self.versions = VersionBoard()
        self.joins: list[JoinMetrics] = []
        self._channel_id = uuid.uuid4().hex[:8]
        self._secret = config.secret if config.secret is not None else new_secret()  # HMAC key of every bucket
        self._epoch = 0
        self._connected = False
        self._host: ChannelHost | None = None  # what the open channel needs served here (torch: its store)
        self._factors = _factor_coordination(config, self.trainers, self._get)
        self._plan = self._build_plan()
        self._plan_bytes = encode(self._plan)
        for engine in engines:
            self._admit(engine)
        if self.engines:
            self._connect()  # open the channel now, so the first push measures the transfer only

    # -- membership ------------------------------------------------------------------------
    @property
    def plan(self) -> SyncPlan:
        return self._plan

    def add_engine(self, engine) -> str:
        """Validate a new engine against the plan, bring it to the fleet's committed version by a peer
        copy (when a member can export one), and admit it; later pushes are deltas for everyone.

        Raises:
            PlanMismatchError: its table does not fit (nothing changes).
            SyncError: the peer copy failed (the engine is not admitted).
        """
        name, table = self._validate(engine)
        peer = self._pick_peer()
        if peer is None:
            joined = JoinMetrics(engine=name, source="next-push", version=None, bytes=0, buckets=0, seconds=0.0)
        else:
            p = self.engines.index(peer)
            self._epoch += 1
            joined = peer_copy(joiner=engine, joiner_name=name, joiner_table=table, peer=peer, peer_name=self.names[p],
                               peer_table=self._tables[self.names[p]], version=self.versions.snapshot()[self.names[p]],
                               config=self.config, channel=f"ws{self._channel_id}j{self._epoch}", secret=self._secret,
                               get=self._get)
            self._full_done.add(name)
        self._append(engine, name, table, joined.version)
        self.joins.append(joined)
        if self._factors is not None:
            self._factors.stale = True  # a peer copy carries no pristine base: the next push is full
        self._connected = False
        return name

    def remove_engine(self, engine) -> None:
        """Stop syncing to ``engine`` (it keeps serving its last committed version).

        Raises:
            ValueError: not a member.
        """
        for i, e in enumerate(self.engines):
            if e == engine:
                self._get([e.close_transport.remote()], "close_transport")
                del self.engines[i]
                name = self.names.pop(i)
                self._full_done.discard(name)
                self._tables.pop(name, None)
                self.versions.remove(name)
                self._connected = False
                return
        raise ValueError("remove_engine: that engine is not a member of this WeightSync")

    def engine_versions(self) -> dict[str, int | None]:
        return dict(zip(self.names, self._get([e.weight_version.remote() for e in self.engines], "weight_version")))

    # -- syncs -----------------------------------------------------------------------------
    def snapshot(self, version: int) -> frozenset[str] | None:
        """Freeze ``version`` on every trainer; the union of the names a delta needs (``None``: all)."""
        changed = self._get([t.snapshot.remote(version) for t in self.trainers], "snapshot")
        if any(c is None for c in changed):
            return None
        return frozenset(n for c in changed for n in c)

    def transfer(self, version: int, changed: frozenset[str] | None, lost: tuple[EngineResult, ...] = ()) -> SyncMetrics:
        """Stream the snapshot of ``version`` to every engine and commit it — or abort everywhere.

        An engine whose actor died mid-stream leaves the membership: the live engines abort, the
        channel reopens without it, and the same snapshot is streamed again, so they commit
        ``version``; the metrics report the dead one (``committed=False``, error "... died ...").

        Raises:
            SyncError: a trainer or a live engine failed; no engine committed ``version``.
        """
        if not self.engines:
            for t in self.trainers:
                t.drop_snapshot.remote(version)
            raise SyncError(f"push({version}): no engines to sync to", None)
        t0 = time.perf_counter()
        if not self._connected:
            self._connect()
        full = changed is None or any(n not in self._full_done for n in self.names)
        names = None if full else sorted(changed)
        if self._factors is not None:  # factor streaming: full, or changed merged tensors + changed factor blocks
            delta = self._factors.names(version, changed, full)
            full, names = delta is None, None if delta is None else sorted(delta)
        session = f"{self._channel_id}-{self._epoch}-v{version}"
        timeout = self.config.timeout_s
        recv = [e.receive.remote(timeout) for e in self.engines]
        send = [t.send.remote(session, version, names, timeout, check_finite=self.config.check_finite)
                for t in self.trainers]
        sent, send_errors = self._collect(send)
        dead = self._dead_engines() if any(send_errors) else []
        if dead or (any(send_errors) and len(ray.wait(recv, num_returns=len(recv), timeout=1.0)[0]) < len(recv)):
            self._close_senders()  # engines still waiting for frames that will not come see the close at once
        received, recv_errors = self._collect(recv)
        ok = not any(send_errors) and not any(recv_errors)
        if not ok:
            dead = dead or self._dead_engines()
            live = [e for i, e in enumerate(self.engines) if i not in dead]
            self._get([e.abort.remote() for e in live], "abort")
            if dead and live:
                gone = tuple(EngineResult(engine=self.names[i], committed=False, apply_s=0.0, payload_bytes=0,
                                          error=f"engine {self.names[i]} died during push({version}) and left the "
                                                f"membership: {recv_errors[i]}") for i in dead)
                self._drop(dead)
                return self.transfer(version, changed, lost + gone)  # the same snapshot, to the live engines
        results = list(lost)
        if ok:
            tc = time.perf_counter()
            self._get([e.commit.remote(version) for e in self.engines], "commit")
            commit_s = time.perf_counter() - tc
            self._full_done.update(self.names)
            self.versions.record(self.names, version)
            if self._factors is not None:
                self._factors.committed(version)
        else:
            commit_s = 0.0
            if self._factors is not None:
                self._factors.failed()
        for name, stats, err in zip(self.names, received, recv_errors):
            results.append(EngineResult(engine=name, committed=ok, error=err or (None if ok else "sync aborted"),
                                        apply_s=stats["apply_s"] if stats else 0.0,
                                        payload_bytes=stats["payload_bytes"] if stats else 0))
        metrics = SyncMetrics.from_stats(version=version, full=full, sent=[s for s in sent if s],
                                         engines=results, commit_s=commit_s, seconds=time.perf_counter() - t0)
        if self._factors is not None:
            metrics = replace(metrics, mode=self.config.mode, factor_tensors=tuple(sorted(self._factors.choice.factors)))
        if not ok:
            detail = "; ".join(e for e in send_errors + recv_errors if e)
            raise SyncError(f"push({version}) aborted on every engine: {detail[:2000]}", metrics)
        return metrics

    # -- internals -------------------------------------------------------------------------
    def _dead_engines(self) -> list[int]:
        """Indices of member engines whose actor is gone (a busy engine still answers: threaded actor)."""
        refs = [e.engine_name.remote() for e in self.engines]
        dead = []
        for i, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=5.0)
            except ray.exceptions.RayActorError:
                dead.append(i)
            except ray.exceptions.GetTimeoutError:
                pass
        return dead

    def _drop(self, indices: list[int]) -> None:
        """Forget dead member engines (no call reaches them); the channel reopens without them."""
        for i in sorted(indices, reverse=True):
            del self.engines[i]
            name = self.names.pop(i)
            self._full_done.discard(name)
            self._tables.pop(name, None)
            self.versions.remove(name)
        self._connected = False

    def _close_senders(self) -> None:
        """Close the trainers' channel sides (receivers see the close, e.g. shm within ~0.2 s)."""
        try:
            ray.get([t.close_transport.remote() for t in self.trainers], timeout=30)
        except Exception:
            pass  # a dead trainer: its receivers see the peer gone
        self._connected = False

    def _build_plan(self) -> SyncPlan:
        owned = self._get([t.owned_metas.remote() for t in self.trainers], "owned_metas")
        if self._factors is not None:
            return self._factors.build_plan([[meta_from_list(m) for m in metas] for metas in owned],
                                            bucket_bytes=self.config.bucket_bytes)
        return build_sync_plan([[meta_from_list(m) for m in metas] for metas in owned],
                               bucket_bytes=self.config.bucket_bytes)

    def _admit(self, engine) -> str:
        name, table = self._validate(engine)
        self._append(engine, name, table, None)
        return name

    def _validate(self, engine) -> tuple[str, list]:
        name, raw = self._get([engine.engine_name.remote(), engine.param_metas.remote()], "param_metas")
        if name in self.names:
            name = f"{name}#{len(self.names)}"
        table = [meta_from_list(m) for m in raw]
        (validate_plan if self._factors is None else self._factors.validate)(self._plan, table, engine=name)
        return name, table

    def _append(self, engine, name: str, table: list, version: int | None) -> None:
        self.engines.append(engine)
        self.names.append(name)
        self._tables[name] = table
        self.versions.admit(name, version)

    def _pick_peer(self):
        """A member that received a full sync from this coordinator, committed a version and can export."""
        versions = self.versions.snapshot()
        for engine, name in zip(self.engines, self.names):
            if name in self._full_done and versions.get(name) is not None and self._get([engine.can_export.remote()], "can_export")[0]:
                return engine
        return None

    def _connect(self) -> None:
        self._epoch += 1
        spec = TransportSpec(kind=TRANSPORTS[self.config.transport].push, name=f"ws{self._channel_id}e{self._epoch}",
                             num_senders=len(self.trainers), num_receivers=len(self.engines),
                             bucket_bytes=self._plan.bucket_bytes, connect_timeout_s=self.config.timeout_s,
                             op_timeout_s=self.config.timeout_s)
        self._close_host()
        self._host = host_channel(spec, bind_host=self.config.bind_host, port_range=self.config.port_range)
        raw = self._host.spec.to_bytes()
        refs = [t.open_transport.remote(raw, self._plan_bytes, secret=self._secret) for t in self.trainers]
        refs += [e.open_transport.remote(raw, self._plan_bytes, i, secret=self._secret) for i, e in enumerate(self.engines)]
        self._get(refs, "open_transport")
        self._connected = True

    def _collect(self, refs: list) -> tuple[list, list]:
        """Results and error texts of ``refs`` (each waited for at most timeout_s + grace)."""
        results, errors = [], []
        deadline = time.monotonic() + self.config.timeout_s + 30.0
        for ref in refs:
            try:
                results.append(ray.get(ref, timeout=max(deadline - time.monotonic(), 0.1)))
                errors.append(None)
            except Exception as exc:  # RayTaskError wraps the actor's exception; keep its text
                results.append(None)
                errors.append(_short(exc))
        return results, errors

    def _get(self, refs: list, what: str) -> list:
        try:
            return ray.get(refs, timeout=self.config.timeout_s + 30.0)
        except ray.exceptions.RayTaskError as exc:
            raise exc.as_instanceof_cause() from None
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{what}: no answer within {self.config.timeout_s + 30.0:.0f} s") from None

    def close(self) -> None:
        """Close every channel side (best effort, bounded)."""
        refs = [t.close_transport.remote() for t in self.trainers] + [e.close_transport.remote() for e in self.engines]
        try:
            ray.get(refs, timeout=30)
        except Exception:
            pass
        self._connected = False
        self._close_host()

    def _close_host(self) -> None:
        if self._host is not None:
            self._host.close()
            self._host = None


def _short(exc: BaseException) -> str:
    text = str(exc.as_instanceof_cause() if isinstance(exc, ray.exceptions.RayTaskError) else exc)
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:1000] if lines else type(exc).__name__
