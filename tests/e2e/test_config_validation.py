"""SyncConfig field validation and ``weightsync sync`` flag checks, all before Ray starts (no Ray here)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from sync_service.api import SyncConfig
from actors.cli import main
from sync_service.synthetic import make_base


@pytest.mark.parametrize("kwargs,match", [
    ({"timeout_s": math.nan}, "timeout_s=nan"),
    ({"timeout_s": math.inf}, "timeout_s=inf"),
    ({"timeout_s": 1e10}, "timeout_s=10000000000.0 must be a finite number of seconds > 0 and <= 604800"),
    ({"timeout_s": "10"}, "timeout_s='10' must be int or float"),
    ({"timeout_s": True}, "timeout_s=True"),
    ({"bucket_bytes": 64.0}, "bucket_bytes=64.0 must be int"),
    ({"bucket_bytes": True}, "bucket_bytes=True must be int"),
    ({"check_finite": 1}, "check_finite=1 must be bool"),
    ({"delta": "yes"}, "delta='yes' must be bool"),
    ({"max_in_flight": 1.5}, "max_in_flight=1.5 must be int"),
    ({"max_staleness": None}, "max_staleness=None must be int"),
    ({"experts_per_recipe": False}, "experts_per_recipe=False must be int"),
    ({"factor_memory_bytes": 1.0}, "factor_memory_bytes=1.0 must be int or None"),
    ({"bucket_bytes": 1 << 40}, "bucket_bytes=1099511627776 exceeds 8589934592 \\(8 GiB\\)"),
    ({"bucket_bytes": (8 << 30) + 64}, "exceeds"),
    ({"metrics_port": 65536}, "metrics_port=65536 must be a TCP port"),
    ({"metrics_port": -1}, "metrics_port=-1"),
    ({"metrics_port": True}, "metrics_port=True must be int or None"),
    ({"metrics_host": None}, "metrics_host=None must be str"),
    ({"transport": 3}, "transport=3 must be str"),
    ({"transport": "udp"}, "transport='udp'"),
    ({"relay": "ring"}, "relay='ring'; use one of \\('auto', 'direct', 'chain'\\)"),
    ({"relay": "chain", "transport": "torch"}, "relay='chain'.*'chain' needs transport='ray'"),
    ({"relay": None}, "relay=None must be str"),
    ({"mode": ["merged"]}, "mode=\\['merged'\\] must be str"),
])
def test_sync_config_rejects_bad_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyncConfig(**kwargs)


def test_sync_config_accepts_good_fields():
    cfg = SyncConfig(timeout_s=5, bucket_bytes=128, factor_memory_bytes=None, check_finite=True)
    assert cfg.timeout_s == 5 and cfg.bucket_bytes == 128
    assert SyncConfig(bucket_bytes=8 << 30, metrics_port=0).bucket_bytes == 8 << 30


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cfg") / "base"
    make_base("qwen3_moe", d)  # E=4 experts, I=8, H=16
    return d


def _sync_fails(capsys, argv: list[str], *fragments: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(["sync", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith(("usage: ", " "))]
    assert len(lines) == 1 and lines[0].startswith("weightsync sync: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("argv,fragments", [
    (["--tp", "0"], ("--tp must be >= 1, got 0",)),
    (["--tp", "0", "--trainers", "2"], ("--tp must be >= 1",)),
    (["--ep", "-1"], ("--ep must be >= 1",)),
    (["--engines", "0"], ("--engines must be >= 1",)),
    (["--ep", "3"], ("--ep 3 --tp 1", "mlp.experts.", "dim 0", "divides 4")),
    (["--ep", "1", "--tp", "3"], ("--ep 1 --tp 3", "dim")),
    (["--bucket-bytes", "100"], ("--bucket-bytes=100", "multiple of 64")),
    (["--bucket-bytes", "0"], ("--bucket-bytes=0",)),
    (["--timeout", "nan"], ("--timeout=nan", "finite")),
    (["--timeout", "-1"], ("--timeout=-1",)),
    (["--timeout", "1e308"], ("--timeout=1e+308", "<= 604800 (a week)")),
    (["--json", "/nonexistent-dir/x/out.json"], ("--json", "does not exist")),
])
def test_sync_bad_flags_exit_2_before_ray(base, capsys, argv, fragments):
    import ray

    _sync_fails(capsys, ["--base", str(base), *argv], *fragments)
    assert not ray.is_initialized()
