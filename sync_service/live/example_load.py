"""How the example training rank loads a base under FSDP2 as jobs at scale do: rank 0 reads the checkpoint,
every other rank builds the model weightless (``meta``), all shard it, and rank 0's full state dict is broadcast
one tensor at a time, each rank keeping only its own shards (``set_model_state_dict(full_state_dict=True,
broadcast_from_rank0=True)``, torch's DCP state-dict API; torchtitan and TRL's FSDP2 path load this way).

Memory: rank 0 holds the base once while it is broadcast, every other rank its shards plus one tensor in
flight — not ``world`` whole copies (each rank loading the whole base before sharding it peaked at ~2.5 GiB
of a 1 GB bf16 base on a 2-rank FSDP2 job; four HSDP ranks of a 2 GB base did not fit a 24 GB host).
"""

from __future__ import annotations

import torch

__all__ = ["empty_base", "load_from_rank0"]


def empty_base(base_dir: str, dtype: torch.dtype):
    """The model of ``base_dir``'s ``config.json``, weightless: parameters and buffers on the ``meta`` device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_dir), dtype=dtype)


def load_from_rank0(model: torch.nn.Module, full_state: dict[str, torch.Tensor] | None) -> None:
    """Fill ``model`` (wrapped by ``fully_shard``; weightless on ranks > 0) from rank 0's ``full_state``
    (``state_dict()`` of the same model before wrapping; ``None`` on the other ranks). Collective over the
    default process group. Buffers (rotary ``inv_freq``: not in a state dict) are broadcast from rank 0 too.

    Raises:
        ValueError: ``full_state`` given on a rank > 0 or missing on rank 0.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank = dist.get_rank()
    if (full_state is None) != (rank != 0):
        raise ValueError(f"load_from_rank0: rank {rank} {'has' if full_state is not None else 'lacks'} the full state; "
                         "only rank 0 passes it")
    if rank != 0:
        model.to_empty(device="cpu")  # storage for this rank's shards and buffers; the broadcasts fill it
    set_model_state_dict(model, full_state or {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True))
    for _, buffer in sorted(model.named_buffers(), key=lambda kv: kv[0]):
        dist.broadcast(buffer, src=0)
