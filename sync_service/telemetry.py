"""Prometheus metrics of a ``WeightSync``, served over HTTP for scraping (``prometheus_client``).

Fed from each push's ``SyncMetrics`` (or its error) when the push finishes; engine versions and
staleness are read from the coordinator's version board at scrape time. One registry per
``WeightSync`` (two in one process never collide). Names (``weightsync_`` prefix):

==================================================  =========  ==================================================
``weightsync_syncs_total{mode,kind}``               counter    pushes committed; mode: ``SyncConfig.mode``
                                                               (merged | factors | auto), kind: full | delta
``weightsync_bytes_total{mode,kind}``               counter    payload bytes sent (``SyncMetrics.bytes``)
``weightsync_sync_seconds{stage}``                  histogram  seconds per push and stage: gather, merge, pack,
                                                               transfer, apply, commit (``SyncMetrics.*_s``) and
                                                               total (``SyncMetrics.seconds``)
``weightsync_failures_total{reason}``               counter    failed pushes; reason: the error's type name
``weightsync_served_check_findings_total{engine}``  counter    problems the engine's served check found (each a
                                                               tensor and a cause; ``check_served="log"``: the
                                                               version committed anyway, the engine logged a
                                                               warning) — ``EngineResult.served_findings`` of
                                                               every push, failed ones too; 0 added per clean
                                                               version; no sample for an engine whose check is off
``weightsync_latest_version``                       gauge      last version pushed (``WeightSync.latest_version``)
``weightsync_engine_weight_version{engine}``        gauge      version each member engine committed
``weightsync_engine_staleness{engine}``             gauge      latest pushed - the engine's committed version
==================================================  =========  ==================================================

Engines that have not committed any version yet have no version and staleness sample.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from sync_service.coordinator.metrics import STAGES as PIPELINE_STAGES
from sync_service.coordinator.metrics import SyncMetrics

__all__ = ["STAGES", "SyncTelemetry"]

# stage label -> SyncMetrics field (seconds): the pipeline stages (``coordinator.metrics.STAGES``) and the total
STAGES: dict[str, str] = {**{field.removesuffix("_s"): field for field in PIPELINE_STAGES}, "total": "seconds"}

SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Histogram bucket bounds, seconds (a stage of a tiny model takes ms; a push of a large one minutes)."""


class _VersionCollector(Collector):
    """Engine versions and staleness, read when scraped."""

    def __init__(self, versions: Callable[[], dict[str, int | None]], latest: Callable[[], int | None]) -> None:
        self._versions, self._latest = versions, latest

    def collect(self) -> Iterator[GaugeMetricFamily]:
        latest, versions = self._latest(), self._versions()
        pushed = GaugeMetricFamily("weightsync_latest_version", "Last weight version pushed")
        if latest is not None:
            pushed.add_metric([], latest)
        version = GaugeMetricFamily("weightsync_engine_weight_version", "Weight version the engine committed",
                                    labels=["engine"])
        stale = GaugeMetricFamily("weightsync_engine_staleness", "Versions the engine is behind the latest pushed",
                                  labels=["engine"])
        for engine, v in sorted(versions.items()):
            if v is None:
                continue
            version.add_metric([engine], v)
            if latest is not None:
                stale.add_metric([engine], max(latest - v, 0))
        yield from (pushed, version, stale)


class SyncTelemetry:
    """The metrics of one WeightSync (table in the module docstring), in their own registry.

    Args:
        versions: committed version per member engine (called at scrape time; must not block).
        latest: the last version pushed, ``None`` before the first push (called at scrape time).
    """

    def __init__(self, *, versions: Callable[[], dict[str, int | None]], latest: Callable[[], int | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._syncs = Counter("weightsync_syncs", "Pushes committed on every engine", ["mode", "kind"],
                              registry=self.registry)
        self._bytes = Counter("weightsync_bytes", "Payload bytes sent by all trainers", ["mode", "kind"],
                              registry=self.registry)
        self._seconds = Histogram("weightsync_sync_seconds", "Seconds of a push, by stage", ["stage"],
                                  buckets=SECONDS_BUCKETS, registry=self.registry)
        self._failures = Counter("weightsync_failures", "Failed pushes, by reason", ["reason"], registry=self.registry)
        self._findings = Counter("weightsync_served_check_findings", "Problems the engine's served check found",
                                 ["engine"], registry=self.registry)
        self.registry.register(_VersionCollector(versions, latest))
        self._server = None
        self._lock = threading.Lock()

    def record(self, metrics: SyncMetrics) -> None:
        """Count one committed push: its bytes, every stage's seconds and its engines' served-check findings."""
        kind = "full" if metrics.full else "delta"
        self._syncs.labels(metrics.mode, kind).inc()
        self._bytes.labels(metrics.mode, kind).inc(metrics.bytes)
        for stage, field_name in STAGES.items():
            self._seconds.labels(stage).observe(getattr(metrics, field_name))
        self._count_findings(metrics)

    def record_failure(self, error: BaseException) -> None:
        """Count one failed push under ``reason`` = the error's type name (``SyncError``, ``TimeoutError``…), and
        the served check's findings its engines reported (``SyncError.metrics``)."""
        self._failures.labels(type(error).__name__).inc()
        metrics = getattr(error, "metrics", None)
        if isinstance(metrics, SyncMetrics):
            self._count_findings(metrics)

    def _count_findings(self, metrics: SyncMetrics) -> None:
        """Add each engine's served-check findings (``None``: its check is off, no sample)."""
        for engine in metrics.engines:
            if engine.served_findings is not None:
                self._findings.labels(engine.engine).inc(engine.served_findings)

    def serve(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` in a daemon thread (0: a free port); returns the bound
        port. Raises ``RuntimeError`` when already serving, ``OSError`` when the port is taken."""
        with self._lock:
            if self._server is not None:
                raise RuntimeError(f"metrics are already served on port {self._server.server_port}; call close() first")
            self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
            return self._server.server_port

    @property
    def port(self) -> int | None:
        """The port ``/metrics`` is served on, ``None`` when not serving."""
        return None if self._server is None else self._server.server_port

    def close(self) -> None:
        """Stop serving (idempotent); the counters stay readable through ``registry``."""
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
