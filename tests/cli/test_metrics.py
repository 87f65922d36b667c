"""Prometheus metrics of a WeightSync, scraped over HTTP after real pushes (real Ray actors, shm
transport): counts, bytes and stage seconds equal the pushes' ``SyncMetrics``; engine versions and
staleness equal the engines' committed versions; a failed push counts under its reason."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from sync_service.api import SyncConfig, SyncError, WeightSync
from actors.launch import start_engines, start_trainers
from sync_service.telemetry import STAGES
from tests.faults import inject
from tests.ray_session import local_ray

pytestmark = pytest.mark.metrics
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray whose workers import this repository (``tests.faults.inject`` runs inside an engine)."""
    with local_ray("wsm", importable=True) as tmp:
        yield tmp


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """``/metrics`` as {(sample name, sorted label items): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_scrape_after_real_pushes(ray_session, tmp_path):
    from sync_service.synthetic import make_adapter, make_base

    base = make_base("qwen3_moe", tmp_path / "base")
    adapter = make_adapter("qwen3_moe", base, tmp_path / "lora", kind="target_parameters")
    trainers = start_trainers(base, adapter, ep=2, timeout_s=TIMEOUT_S)
    engines = start_engines(base, 2, timeout_s=TIMEOUT_S)
    names = ray.get([e.engine_name.remote() for e in engines], timeout=TIMEOUT_S)
    sync = WeightSync(trainers=trainers, engines=engines, config=SyncConfig(
        transport="shm", bucket_bytes=1 << 14, timeout_s=TIMEOUT_S, metrics_port=0))
    try:
        port = sync.metrics_port
        assert port, "metrics_port=0 must bind a free port"
        before = scrape(port)
        assert ("weightsync_latest_version", ()) not in before
        assert not any(n == "weightsync_engine_weight_version" for n, _ in before), "no engine committed yet"
        pushed = []
        for v in range(3):
            if v:
                ray.get([t.train_step.remote(v) for t in trainers], timeout=TIMEOUT_S)
            pushed.append(sync.push(v))
        assert [m.full for m in pushed] == [True, False, False]
        s = scrape(port)
        full, delta = (("kind", "full"), ("mode", "merged")), (("kind", "delta"), ("mode", "merged"))
        assert s[("weightsync_syncs_total", full)] == 1 and s[("weightsync_syncs_total", delta)] == 2
        assert s[("weightsync_bytes_total", full)] == pushed[0].bytes > 0
        assert s[("weightsync_bytes_total", delta)] == pushed[1].bytes + pushed[2].bytes > 0
        for stage, field_name in STAGES.items():
            label = (("stage", stage),)
            assert s[("weightsync_sync_seconds_count", label)] == 3
            assert s[("weightsync_sync_seconds_sum", label)] == pytest.approx(sum(getattr(m, field_name) for m in pushed))
        assert s[("weightsync_latest_version", ())] == 2
        for name in names:
            assert s[("weightsync_engine_weight_version", (("engine", name),))] == 2
            assert s[("weightsync_engine_staleness", (("engine", name),))] == 0

        # a push that fails on one engine: counted under its reason, versions unchanged
        ray.get(engines[1].__ray_call__.remote(inject.fail_apply, "model.layers.1.mlp.experts.down_proj",
                                               "injected: apply failed"), timeout=TIMEOUT_S)
        ray.get([t.train_step.remote(3) for t in trainers], timeout=TIMEOUT_S)
        with pytest.raises(SyncError, match="injected: apply failed"):
            sync.push(3)
        s = scrape(port)
        assert s[("weightsync_failures_total", (("reason", "SyncError"),))] == 1
        assert s[("weightsync_syncs_total", delta)] == 2
        assert s[("weightsync_sync_seconds_count", (("stage", "total"),))] == 3
        committed = ray.get([e.weight_version.remote() for e in engines], timeout=TIMEOUT_S)
        assert committed == [2, 2]
        latest = sync.latest_version
        for name in names:
            assert s[("weightsync_engine_weight_version", (("engine", name),))] == 2
            assert s[("weightsync_engine_staleness", (("engine", name),))] == latest - 2
    finally:
        sync.close()
    with pytest.raises(urllib.error.URLError):  # close() stops the endpoint
        scrape(port)


def test_taken_port_fails_serve_and_close_releases_it():
    """A taken port fails ``serve_metrics`` with OSError; the telemetry is not half-started."""
    import socket

    from sync_service.telemetry import SyncTelemetry

    telemetry = SyncTelemetry(versions=dict, latest=lambda: None)
    port = telemetry.serve(0)
    try:
        other = SyncTelemetry(versions=dict, latest=lambda: None)
        with pytest.raises(OSError):
            other.serve(port)
        assert other.port is None
        with pytest.raises(RuntimeError, match="already served"):
            telemetry.serve(0)
    finally:
        telemetry.close()
    with socket.socket() as sock:  # released: the port can be bound again
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))


def _set_env(engine, name: str, value: str) -> None:
    """In an engine actor's process (``__ray_call__``): set one environment variable."""
    import os

    os.environ[name] = value


def test_served_check_findings_under_log(ray_session, tmp_path):
    """``check_served="log"``: a byte the engine's own copy flips (the fault hook, ``engines.faults``, armed in one
    engine's process only) is a finding of that engine's served check — the version commits on both engines, the
    engine's ``ReceiveReport`` carries 1 into ``SyncMetrics.engines`` and the scraped
    ``weightsync_served_check_findings_total`` counts 1 for it and 0 for the clean engine; a clean push adds 0."""
    from sync_service.engines import faults
    from sync_service.synthetic import make_adapter, make_base

    base = make_base("qwen3_moe", tmp_path / "base", hidden=32, intermediate=16, vocab_size=64)
    adapter = make_adapter("qwen3_moe", base, tmp_path / "lora", r=2, seed=1, kind="target_parameters")
    trainers = start_trainers(base, adapter, ep=1, timeout_s=TIMEOUT_S)
    engines = start_engines(base, 2, timeout_s=TIMEOUT_S, prefix="s")
    path = tmp_path / "faults.json"
    ray.get(engines[1].__ray_call__.remote(_set_env, faults.ENV, str(path)), timeout=TIMEOUT_S)
    sync = WeightSync(trainers=trainers, engines=engines, config=SyncConfig(
        transport="shm", timeout_s=TIMEOUT_S, check_served="log", delta=False, metrics_port=0))
    key = "weightsync_served_check_findings_total"
    try:
        clean = sync.push(1)
        names = [e.engine for e in clean.engines]
        assert [e.served_findings for e in clean.engines] == [0, 0]
        assert [scrape(sync.metrics_port)[(key, (("engine", n),))] for n in names] == [0, 0]

        faults.arm(path, {"corrupt": ["model.norm.weight"]})
        found = sync.push(2)
        faults.arm(path, None)
        assert [e.committed for e in found.engines] == [True, True]
        assert ray.get([e.weight_version.remote() for e in engines], timeout=TIMEOUT_S) == [2, 2]
        assert [e.served_findings for e in found.engines] == [0, 1]
        assert [scrape(sync.metrics_port)[(key, (("engine", n),))] for n in names] == [0, 1]

        assert [e.served_findings for e in sync.push(3).engines] == [0, 0]  # a clean push adds 0
        assert [scrape(sync.metrics_port)[(key, (("engine", n),))] for n in names] == [0, 1]
    finally:
        sync.close()
