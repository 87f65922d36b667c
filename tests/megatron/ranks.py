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

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
LORA_DIM, LORA_ALPHA = 4, 8


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


def build_model(hf_dir: str, *, tp: int = 1, ep: int = 1, etp: int | None = None, pp: int = 1,
                lora: bool = True):
    """(model chunks, provider) of ``hf_dir`` converted by Megatron-Bridge at these sizes, with Bridge LoRA."""
    from sync_service.entrypoints.megatron_cpu import apply, cpu_provider

    apply()
    from megatron.bridge import AutoBridge
    from megatron.bridge.peft.lora import LoRA
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=etp or tp)
    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    provider = cpu_provider(bridge.to_megatron_provider(load_weights=True), tp=tp, ep=ep, etp=etp, pp=pp)
    provider.finalize()
    if lora:
        peft = LoRA(target_modules=TARGETS, dim=LORA_DIM, alpha=LORA_ALPHA)
        provider.register_pre_wrap_hook(lambda chunks: peft(chunks, training=True))
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True,
                                               mixed_precision_wrapper=None)
    return model, bridge


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


TOKENS = torch.tensor([[3, 17, 42, 5, 9, 60, 1, 33, 12, 7, 50, 21]])


@torch.no_grad()
def megatron_logits(model, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    """Megatron's own forward of ``model`` (one pipeline stage, TP / EP inside) on ``tokens``: fp32 logits
    [b, s, V], gathered over TP (the causal mask is explicit: the local spec's attention needs it on CPU)."""
    b, s = tokens.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).expand(b, 1, s, s)
    positions = torch.arange(s).expand(b, s)
    for chunk in model:
        chunk.eval()
    logits = model[0](input_ids=tokens, position_ids=positions, attention_mask=mask)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if ps.get_tensor_model_parallel_world_size() > 1:
        logits = gather_from_tensor_model_parallel_region(logits)
    return logits.float()


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
