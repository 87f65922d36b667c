"""Megatron-Core ranks for the tests: gloo process groups on CPU, a tiny Qwen3-MoE converted by Megatron-Bridge.

Every function here runs inside a rank process started by ``run_ranks`` (``torch.multiprocessing`` spawn, gloo,
``world`` ranks); each rank first applies the CPU launcher's patches (``sync_service/entrypoints/megatron_cpu.py``,
each named and explained there). Results come back as files the ranks write, never pickles.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch

from sync_service.entrypoints.megatron_rank import (  # noqa: F401  (the harness's names, used by the tests)
    LORA_ALPHA, LORA_DIM, TARGETS, TOKENS, build_model, megatron_logits)



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn, world: int, *args, timeout_s: float = 600) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; raises if any rank fails."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.start_processes(_entry, args=(world, port, fn, args), nprocs=world, join=False, start_method="spawn")
    import time

    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"Megatron ranks did not finish in {timeout_s} s")


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


@torch.no_grad()
def randomize_adapters(model, *, seed: int, scale: float = 0.1) -> None:
    """Every Bridge adapter tensor (``linear_in``, ``linear_out``) seeded random, per rank and name."""
    rank = torch.distributed.get_rank()
    for chunk in model:
        for name, param in chunk.named_parameters():
            if ".adapter." in name:
                gen = torch.Generator().manual_seed(seed * 1000 + rank * 100 + sum(map(ord, name)) % 97)
                param.copy_(torch.randn(param.shape, generator=gen) * scale)


def save_lora_checkpoint(rank: int, world: int, hf_dir: str, out: str, tp: int, ep: int, etp: int, pp: int,
                         seed: int) -> None:
    """Rank body: convert ``hf_dir`` at TP/EP/ETP/PP, random Bridge LoRA, ``dist_checkpointing.save`` (torch_dist)
    to ``out`` plus Megatron-Bridge's ``run_config.yaml`` (``peft: {dim, alpha}``) beside it."""
    from megatron.core import dist_checkpointing

    model, bridge = build_model(hf_dir, tp=tp, ep=ep, etp=etp, pp=pp)
    randomize_adapters(model, seed=seed)
    state = {}
    for chunk in model:
        state.update(chunk.sharded_state_dict())
    dist_checkpointing.save(state, out)
    torch.distributed.barrier()
    if rank == 0:
        Path(out, "run_config.yaml").write_text(
            f"peft:\n  _target_: megatron.bridge.peft.lora.LoRA\n  dim: {LORA_DIM}\n  alpha: {LORA_ALPHA}\n")
    dump_placements(model, str(Path(out).parent / f"placements{rank}"))
    # beside the checkpoint: Megatron-Bridge's merged export and Megatron's forward at the saving parallelism
    from safetensors.torch import save_file

    merged = {name: t.detach().clone() for name, t in bridge.export_hf_weights(model, cpu=True, show_progress=False,
                                                                           merge_adapter_weights=True)}
    logits = megatron_logits(model)
    if rank == 0:
        save_file(merged, str(Path(out).parent / "bridge_live.safetensors"))
        save_file({"logits": logits}, str(Path(out).parent / "megatron_live.logits"))


def bridge_export(rank: int, world: int, hf_dir: str, ckpt: str, out: str) -> None:
    """Rank body (world 1): load ``ckpt`` into a TP=1 / EP=1 Megatron model with Bridge LoRA and write
    Megatron-Bridge's ``export_hf_weights(merge_adapter_weights=True)`` to ``out`` (safetensors)."""
    from safetensors.torch import save_file

    model, bridge = build_model(hf_dir)
    load_into(model, ckpt)
    merged = {name: t.detach().clone() for name, t in bridge.export_hf_weights(model, cpu=True, show_progress=False,
                                                                           merge_adapter_weights=True)}
    save_file(merged, out)
    save_file({"logits": megatron_logits(model)}, out + ".logits")


def load_into(model, ckpt: str) -> None:
    """``dist_checkpointing.load`` of ``ckpt`` into every chunk of ``model`` (strict)."""
    from megatron.core import dist_checkpointing

    state = {}
    for chunk in model:
        state.update(chunk.sharded_state_dict())
    loaded = dist_checkpointing.load(state, ckpt)
    for chunk in model:
        own = set(dict(chunk.named_parameters())) | set(dict(chunk.named_buffers()))
        fixed = {}
        for key, value in loaded.items():
            if key.endswith("_extra_state"):
                continue
            head, _, leaf = key.rpartition(".")
            if key not in own and f"{head}.to_wrap.{leaf}" in own:  # a Bridge AdapterWrapper's base
                key = f"{head}.to_wrap.{leaf}"
            fixed[key] = value
        missing, unexpected = chunk.load_state_dict(fixed, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"{ckpt}: missing {missing[:3]}, unexpected {unexpected[:3]}")


def bridge_mapping(rank: int, world: int, out: str) -> None:
    """Rank body (world 1): the installed Megatron-Bridge's Qwen3-MoE ``mapping_registry()`` as JSON rows
    ``[megatron_param, [hf names...]]`` (a dict-valued mapping's names in its own order: q, k, v / gate, up)."""
    import json

    from sync_service.entrypoints.megatron_cpu import apply

    apply()
    from megatron.bridge.models.qwen.qwen3_moe_bridge import Qwen3MoEBridge

    rows = []
    for mapping in Qwen3MoEBridge().mapping_registry().mappings:
        hf = mapping.hf_param
        rows.append([mapping.megatron_param, list(hf.values()) if isinstance(hf, dict) else [hf]])
    Path(out).write_text(json.dumps(rows))


def dump_placements(model, prefix: str) -> None:
    """This rank's ``local_placements`` (JSON) and its parameters (safetensors), for ``assemble`` in the test."""
    import json

    from safetensors.torch import save_file

    from sync_service.megatron.placement import local_placements

    rows, tensors = [], {}
    params = {n: p for chunk in model for n, p in chunk.named_parameters()}
    for p in local_placements(model):
        rows.append({"name": p.name, "key": p.key, "role": p.role, "shape": list(p.global_shape), "sender": p.sender,
                     "pieces": [[list(map(list, box)), [[s.start, s.stop] for s in index]] for box, index in p.pieces]})
        tensors[p.name] = params[p.name].detach().clone()
    Path(prefix + ".json").write_text(json.dumps(rows))
    save_file(tensors, prefix + ".safetensors")
