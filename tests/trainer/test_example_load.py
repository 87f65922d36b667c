"""The example rank's FSDP2 load (``sync_service/live/example_load.py``): only rank 0 reads the checkpoint; on a
2-D HSDP mesh (replicate 1, shard 2) of 2 gloo processes every rank's parameters and buffers, gathered, equal the
checkpoint as ``from_pretrained`` loads it, bitwise, and the ranks > 0 never open the checkpoint's weights."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(300)

WORLD = 2


def _rank(rank: int, port: int, base: str, out: str) -> None:
    import torch.distributed as dist
    import transformers

    from sync_service.live.example import ExampleTrainingRank

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    opened = []
    original = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def counting(cls, *args, **kwargs):
        opened.append(args[0] if args else kwargs.get("pretrained_model_name_or_path"))
        return original(cls, *args, **kwargs)

    transformers.AutoModelForCausalLM.from_pretrained = classmethod(counting)
    try:
        trainer = ExampleTrainingRank(rank, WORLD)
        trainer.build(base, "fsdp2", mesh_shape=(1, 2), dtype="bfloat16")
    finally:
        transformers.AutoModelForCausalLM.from_pretrained = classmethod(original)
    got = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()  # collective: every rank
           for n, p in trainer.peft.get_base_model().named_parameters() if "lora_" not in n}
    got.update({f"buffer:{n}": b.clone() for n, b in trainer.peft.get_base_model().named_buffers()})
    want = original(transformers.AutoModelForCausalLM, base, dtype=torch.bfloat16)
    want = {**dict(want.named_parameters()), **{f"buffer:{n}": b for n, b in want.named_buffers()}}
    want = {k.replace(".base_layer", ""): v for k, v in want.items()}
    got = {k.replace(".base_layer", ""): v for k, v in got.items()}
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    differ = [k for k in want if not torch.equal(got[k], want[k].detach())]
    Path(out, f"rank{rank}").write_text(f"opened={len(opened)} differ={differ}")
    dist.barrier()
    dist.destroy_process_group()


def test_hsdp_ranks_load_their_shards_from_rank0(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from sync_service.synthetic import make_base

    base = make_base("qwen3_moe", tmp_path / "base", dtype="bfloat16", hidden=64, intermediate=32, num_experts=4,
                     vocab_size=128, scale=0.1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(port, str(base), str(tmp_path)), nprocs=WORLD, join=True)
    reports = [(tmp_path / f"rank{k}").read_text() for k in range(WORLD)]
    assert reports == ["opened=1 differ=[]"] + ["opened=0 differ=[]"] * (WORLD - 1)
