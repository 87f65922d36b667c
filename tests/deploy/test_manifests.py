"""deploy/: every manifest parses, has the right kind / apiVersion, is a fresh render of the example
config, and advertises the resources the config places its actors by."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from sync_service.cluster.config import load_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CFG = load_config(DEPLOY / "example-config.yaml")


def _render():
    spec = importlib.util.spec_from_file_location("deploy_render", DEPLOY / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


@pytest.mark.parametrize("name", sorted(p.name for p in DEPLOY.glob("*.yaml")))
def test_every_yaml_parses_to_a_mapping(name):
    assert isinstance(_load(name), dict)


def test_committed_manifests_equal_a_fresh_render(tmp_path):
    render = _render()
    assert render.main(["--check"]) == 0, "stale manifests: run python deploy/render.py"
    assert render.main(["--out-dir", str(tmp_path)]) == 0
    for name in render.MANIFESTS:
        assert (tmp_path / name).read_text() == (DEPLOY / name).read_text(), name


def test_kuberay_kinds_and_api_versions():
    assert (_load("raycluster.yaml")["apiVersion"], _load("raycluster.yaml")["kind"]) == ("ray.io/v1", "RayCluster")
    job = _load("rayjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert "weightsync run --config /etc/weightsync/config.yaml --address auto" in job["spec"]["entrypoint"]
    assert job["spec"]["rayClusterSpec"] == _load("raycluster.yaml")["spec"]


def test_launcher_fields():
    doc = _load("cluster-launcher.yaml")
    assert doc["cluster_name"] == CFG.cluster.name and doc["provider"]["type"] == "aws"
    assert set(doc["available_node_types"]) == {"head", "trainer", "rollout"} and doc["head_node_type"] == "head"


def _advertised(params: dict) -> dict:
    raw = params.get("resources")
    return {} if raw is None else json.loads(raw.strip('"').replace('\\"', '"'))


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob.yaml"])
def test_kuberay_groups_hold_what_the_config_places(name):
    doc = _load(name)
    spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
    assert _advertised(spec["headGroupSpec"]["rayStartParams"]) == {}
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    for group, resource, per_actor, actors in (
            ("trainer", CFG.trainers.resource, CFG.trainers.resource_per_shard, CFG.trainers.shards),
            ("rollout", CFG.engines.resource, CFG.engines.resource_per_engine, CFG.engines.count)):
        g = groups[group]
        amount = _advertised(g["rayStartParams"])[resource]
        assert g["replicas"] * (amount // per_actor) >= actors, f"{group}: room for {actors} actors"
        if group == "rollout" and CFG.engines.placement == "STRICT_SPREAD":
            assert g["replicas"] >= actors
        pod = g["template"]["spec"]
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        ref = env[CFG.secret.env]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": CFG.secret.k8s_name, "key": CFG.secret.k8s_key}
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        secret_vol = next(v for v in pod["volumes"] if v["name"] == "session-secret")["secret"]
        assert Path(mounts["session-secret"]) / secret_vol["items"][0]["path"] == CFG.secret.file
        assert secret_vol["secretName"] == CFG.secret.k8s_name


def test_launcher_node_types_hold_what_the_config_places():
    types = _load("cluster-launcher.yaml")["available_node_types"]
    t = types["trainer"]
    assert t["min_workers"] * t["resources"][CFG.trainers.resource] >= CFG.trainers.shards * CFG.trainers.resource_per_shard
    r = types["rollout"]
    assert r["min_workers"] * r["resources"][CFG.engines.resource] >= CFG.engines.count * CFG.engines.resource_per_engine
    assert CFG.trainers.resource not in types["head"]["resources"]


def test_dockerfile_installs_this_project():
    text = (DEPLOY / "Dockerfile").read_text()
    assert "COPY pyproject.toml" in text and "pip install ." in text and "download.pytorch.org/whl/cpu" in text
