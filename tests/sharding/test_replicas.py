"""The replica check (``sharding/replicas.py``) over the parts ``live/replicas.py`` names.

On 2 gloo processes: a plain factor both ranks hold whole, a bfloat16 DTensor factor ``Replicate()`` (HSDP's
replicate axis, a TP-replicated tensor) and one ``Shard(0)`` (each rank its own rows: never compared).
Replicas that agree pass; drifted ones raise the same error on every rank, naming each tensor and part and the
ranks on either side. Without processes: the parts an ep 2 × tp 2 rank names (its ep block, shared by the TP
ranks of that block only).
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
import torch.multiprocessing as mp

PLAIN = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
REPLICATED = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
SHARDED = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"
EXPERTS = "base_model.model.model.layers.0.mlp.experts.lora_A.weight"


def _worker(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from sync_service.live.model import LiveParam
    from sync_service.live.replicas import factor_parts
    from sync_service.sharding.replicas import ReplicaCheck, ReplicasDisagreeError
    from sync_service.sharding.rules import ShardSpec

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        group = dist.new_group(backend="gloo")
        g = torch.Generator().manual_seed(0)
        plain, rep, shard = torch.randn(2, 8, generator=g), torch.randn(6, 2, generator=g), torch.randn(6, 2, generator=g)
        params = {PLAIN: LiveParam(PLAIN, plain, (2, 8)),
                  REPLICATED: LiveParam(REPLICATED, distribute_tensor(rep.bfloat16(), mesh, [Replicate()]), (6, 2)),
                  SHARDED: LiveParam(SHARDED, distribute_tensor(shard, mesh, [Shard(0)]), (6, 2))}
        parts = factor_parts(params, ShardSpec(), [0, 1])
        check = ReplicaCheck([p for p, _ in parts], group=group, rank=rank, world=2, timeout_s=60)
        local = {k: p.local() for k, p in params.items()}
        result = {"replicated": {str(p): list(ks) for p, ks in check.replicated.items()}, "errors": []}
        for drifted in ((), (PLAIN, REPLICATED), (SHARDED,)):
            values = {k: t + 1 if rank == 1 and k in drifted else t for k, t in local.items()}
            try:
                check.check([pick(values) for _, pick in parts], what="push of version 7")
                result["errors"].append(None)
            except ReplicasDisagreeError as exc:
                result["errors"].append(str(exc))
        with open(os.path.join(out, f"r{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def test_replicas_agree_or_every_rank_names_the_differing_ones():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(os.path.join(d, "init"), d), nprocs=2, join=True)
        results = []
        for r in range(2):
            with open(os.path.join(d, f"r{r}.json")) as f:
                results.append(json.load(f))
    assert results[0]["replicated"] == {PLAIN: [0, 1], REPLICATED + " [((0, 6), (0, 2))]": [0, 1]}
    assert results[0]["errors"] == results[1]["errors"], "the ranks raised different errors"
    agreed, drifted, sharded = results[0]["errors"]
    assert agreed is None and sharded is None  # a Shard(0) factor's rows are no replicas
    assert drifted == (
        "replicas disagree at push of version 7: trainer ranks [0, 1] hold different values of 2 replicated "
        f"tensor(s) — {PLAIN}: ranks [0] vs [1]; {REPLICATED} [((0, 6), (0, 2))]: ranks [0] vs [1]. Ranks holding "
        "the same part of a tensor must hold the same values (a step that ran on some ranks only, or a rank restored "
        "from another checkpoint?); bring the ranks back in step (e.g. load one checkpoint on every rank) and push again")


def test_an_expert_parallel_rank_names_its_block():
    """Under ep 2 × tp 2 the fused expert factors are the ep block's own (shared by its TP ranks), the rest whole."""
    from sync_service.live.model import LiveParam
    from sync_service.live.replicas import factor_parts
    from sync_service.sharding.replicas import ReplicaPart
    from sync_service.sharding.rules import ShardSpec

    params = {k: LiveParam(k, torch.zeros(4, 8), (4, 8)) for k in (PLAIN, EXPERTS)}
    for rank, block in ((0, 0), (1, 0), (2, 1), (3, 1)):
        parts = [p for p, _ in factor_parts(params, ShardSpec(rank=rank, ep=2, tp=2), [0, 1, 2, 3])]
        assert parts == [ReplicaPart(PLAIN), ReplicaPart(EXPERTS, f"ep block {block}/2")]


def test_digest_reads_bytes_of_any_dtype_and_layout():
    from sync_service.sharding.replicas import digest

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert digest(t.t()) == digest(t.t().contiguous()) != digest(t)
    assert digest(t.bfloat16()) != digest(t) and digest(t[:0]) == digest(torch.empty(0))
    assert -(1 << 63) <= digest(t) < 1 << 63


def test_the_error_pickles_as_itself():
    """Ray carries a trainer's error to the coordinator pickled: it arrives as itself, with what differs."""
    import pickle

    from sync_service.sharding.replicas import ReplicaPart, ReplicasDisagreeError

    err = pickle.loads(pickle.dumps(ReplicasDisagreeError("replicas disagree", {ReplicaPart(PLAIN): ((0,), (1,))})))
    assert isinstance(err, ReplicasDisagreeError) and str(err) == "replicas disagree"
    assert err.differing == {ReplicaPart(PLAIN): ((0,), (1,))}
