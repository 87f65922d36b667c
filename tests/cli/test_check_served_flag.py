"""``--check-served {off,log,enforce}`` of ``weightsync sync`` and ``weightsync demo``: the value reaches the
run's ``SyncConfig.check_served`` (default ``"log"``, as ``SyncConfig``'s), and a bad value is refused in one line.
The commands run for real up to the point where they would start Ray; the run itself is captured there."""

from __future__ import annotations

import pytest

from sync_service.api import SyncConfig
from sync_service.entrypoints import demo, sync_cli
from sync_service.entrypoints.cli import build_parser
from sync_service.synthetic.demo_files import ensure_files
from tests.cli.test_cli_subprocess import one_error_line, weightsync


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("check_served")
    ensure_files(cache)
    return cache


def _config_of(module, argv: list[str], monkeypatch) -> SyncConfig:
    """The ``SyncConfig`` the command would run with: its ``RunConfig`` captured where it would start actors."""
    seen = []
    monkeypatch.setattr(module, "execute_engine", lambda cfg, extra, launcher: seen.append(cfg) or 0)
    args = build_parser().parse_args(argv)
    args.launcher = None
    assert module.run(args) == 0
    (cfg,) = seen
    return sync_cli.sync_config(cfg)


@pytest.mark.parametrize("value", [None, "off", "log", "enforce"])
def test_the_value_reaches_the_sync_config(value, demo_cache, monkeypatch):
    flag = [] if value is None else ["--check-served", value]
    want = value or SyncConfig().check_served
    assert want in ("off", "log", "enforce")
    synced = _config_of(sync_cli, ["sync", "--base", str(demo_cache / "base"), "--adapter", str(demo_cache / "lora"),
                                   "--ep", "1", *flag], monkeypatch)
    assert synced.check_served == want
    demoed = _config_of(demo, ["demo", "--cache-dir", str(demo_cache), "--ep", "1", *flag], monkeypatch)
    assert demoed.check_served == want


def test_a_bad_value_is_refused_in_one_line(demo_cache):
    code, stderr, _ = weightsync(["sync", "--base", str(demo_cache / "base"), "--check-served", "strict"])
    assert code == 2
    line = one_error_line(stderr, "sync")
    assert "--check-served" in line and "'strict'" in line and "enforce" in line, line
