"""Typed deploy config: defaults, coercion, and errors that name the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from sync_service.cluster.config import ConfigError, load_config, parse_config
from sync_service.cluster.placement import choose_transport
from sync_service.entrypoints.run_cli import load_secret

MIN = {"model": {"base": "/m/base"}}


def test_minimal_config_takes_defaults():
    cfg = parse_config(MIN)
    assert cfg.model.base == Path("/m/base") and cfg.model.adapter is None
    assert (cfg.trainers.resource, cfg.engines.resource, cfg.sync.transport) == ("trainer", "rollout", "auto")
    assert cfg.trainers.resource_per_shard == 1.0 and isinstance(cfg.trainers.resource_per_shard, float)


@pytest.mark.parametrize("patch, field, words", [
    ({"engines": {"count": 0}}, "engines.count", "must be >= 1"),
    ({"engines": {"count": "2"}}, "engines.count", "expected int"),
    ({"engines": {"cuont": 2}}, "engines.cuont", "unknown field"),
    ({"sync": {"bucket_bytes": 1000}}, "sync.bucket_bytes", "multiple of 64"),
    ({"sync": {"transport": "nccl"}}, "sync.transport", "use one of"),
    ({"sync": {"delta": 1}}, "sync.delta", "expected bool"),
    ({"trainers": {"placement": "pack"}}, "trainers.placement", "use one of"),
    ({"engines": {"resource": "trainer"}}, "engines.resource", "give each group its own"),
    ({"trainers": {"ep": 4}}, "cluster.trainer_group.resource_amount", "raise resource_amount or replicas"),
    ({"engines": {"count": 3}, "cluster": {"rollout_group": {"replicas": 2, "resource_amount": 2}}},
     "cluster.rollout_group.replicas", "STRICT_SPREAD"),
    ({"model": None}, "model", "expected a mapping"),
])
def test_bad_fields_are_named(patch, field, words):
    raw = {**MIN, **patch}
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    assert err.value.field == field and words in str(err.value), str(err.value)


def test_missing_model_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="model: required field is missing"):
        parse_config({})
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [base\n")
    with pytest.raises(ConfigError, match=r"^<top>: not valid YAML \(line 2, column 1: expected ',' or ']', but got") as err:
        load_config(bad)
    assert "\n" not in str(err.value)  # weightsync run prints it as one line


def test_example_config_loads():
    cfg = load_config(Path(__file__).resolve().parents[2] / "deploy" / "example-config.yaml")
    assert cfg.trainers.shards == 2 and cfg.engines.count == 2


def test_transport_choice():
    assert choose_transport("auto", ["10.0.0.1"] * 2, ["10.0.0.1"])[0] == "shm"
    assert choose_transport("auto", ["10.0.0.1"], ["10.0.0.2", "10.0.0.3"])[0] == "ray"
    assert choose_transport("torch", ["a"], ["b"]) == ("torch", "set in the config (sync.transport)")


def test_secret_from_env_then_file(tmp_path):
    cfg = parse_config({**MIN, "secret": {"file": str(tmp_path / "s"), "required": True}}).secret
    with pytest.raises(ConfigError, match="no session secret"):
        load_secret(cfg, environ={})
    (tmp_path / "s").write_text("f" * 64 + "\n")
    assert load_secret(cfg, environ={}) == b"f" * 64
    assert load_secret(cfg, environ={cfg.env: "e" * 40}) == b"e" * 40
    with pytest.raises(ConfigError, match=r"\$WEIGHTSYNC_SESSION_SECRET has 5 bytes, need >= 32"):
        load_secret(cfg, environ={cfg.env: "short"})
    (tmp_path / "s").chmod(0o666)  # anyone could replace the key: refused like weightsync sync's --secret-file
    with pytest.raises(ConfigError, match="writable by group/others"):
        load_secret(cfg, environ={})
