"""Deploy fixtures: a multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``), tiny files.

The head node advertises the ``trainer`` resource and runs the driver; two worker nodes advertise
``rollout: 1`` each. Nodes have no CPUs (actors take ``num_cpus=0``), so no worker processes are
prestarted; each node gets its own 80 MiB object store. ``RAY_TMPDIR`` points at the test's own
short temp dir, so the cluster's address file lands there, not in the shared /tmp/ray.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import ray


OBJECT_STORE_BYTES = 80 << 20
ENV = {"OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """A 1-layer Qwen3-MoE base (E=4) and a rank-2 LoRA on attention + experts."""
    from sync_service.synthetic import make_adapter, make_base

    root = tmp_path_factory.mktemp("deploy")
    base = make_base("qwen3_moe", root / "base", num_experts=4, num_layers=1)
    return base, make_adapter("qwen3_moe", base, root / "lora", kind="target_parameters", r=2)


@pytest.fixture(scope="module")
def cluster():
    """Head (``trainer: 2``) + two rollout nodes (``rollout: 1``); the driver is connected."""
    from ray.cluster_utils import Cluster

    root = tempfile.mkdtemp(prefix="wsmn", dir="/tmp")
    old = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = root
    c = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=0, resources={"trainer": 2}, include_dashboard=False, temp_dir=f"{root}/ray",
        object_store_memory=OBJECT_STORE_BYTES))
    try:
        c.rollout_nodes = [c.add_node(num_cpus=0, resources={"rollout": 1}, object_store_memory=OBJECT_STORE_BYTES)
                           for _ in range(2)]
        ray.init(address=c.address, log_to_driver=False, runtime_env={"env_vars": ENV})
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        if old is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old
        shutil.rmtree(root, ignore_errors=True)
