"""A Megatron-Core training rank as a Ray actor, on CPU: the Megatron demo's launcher side and the tests' ranks.

``start_megatron_ranks(hf_dir, tp=2, ep=2, etp=2)`` starts ``world`` actors (``MegatronRank``, threaded: the
endpoint's calls run beside the training step), joins them in one gloo process group, initializes Megatron's
``parallel_state`` and builds the model with Megatron-Bridge (``AutoBridge`` → provider → Bridge ``LoRA`` on
``linear_qkv`` / ``linear_proj`` / ``linear_fc1`` / ``linear_fc2`` → ``provide_distributed_model``), with the CPU
launcher's patches (``megatron_cpu.py``, each named and explained there). Then, per actor:

- ``attach(**kw)`` → the rank's ``EndpointHandle`` (``sync_service.megatron.attach.attach_megatron``; collective:
  call it on every actor at once), for ``WeightSync(trainers=handles, ...)``;
- ``logits(tokens)`` → Megatron's own forward of the unmerged LoRA model at the ranks' parallelism (fp32 logits
  [b, s, V] as a numpy array on the last pipeline stage, ``None`` on the others; collective);
- ``randomize_adapters(seed)`` (collective-free: replicas get equal values, each global adapter tensor is drawn
  whole from ``seed`` and its key, and every rank keeps its boxes), ``adapter_state()`` / ``set_adapters(...)``.

The model is ``self.model`` (the list of model chunks); a training step lives beside it in its own module.
"""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta

import numpy as np
import torch

__all__ = ["LORA_ALPHA", "LORA_DIM", "TARGETS", "TOKENS", "MegatronRank", "build_model", "megatron_logits",
           "randomize_adapters", "start_megatron_ranks"]

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
LORA_DIM, LORA_ALPHA = 4, 8
TOKENS = torch.tensor([[3, 17, 42, 5, 9, 60, 1, 33, 12, 7, 50, 21]])


def build_model(hf_dir: str, *, tp: int = 1, ep: int = 1, etp: int | None = None, pp: int = 1, lora: bool = True,
                dim: int = LORA_DIM, alpha: float = LORA_ALPHA):
    """(model chunks, bridge) of ``hf_dir`` converted by Megatron-Bridge at these sizes (fp32, local layer spec, no
    grouped GEMM), with Bridge LoRA (``dim``, ``alpha``) on ``TARGETS``. Initializes ``parallel_state`` if needed
    (the default process group must exist)."""
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
        peft = LoRA(target_modules=TARGETS, dim=dim, alpha=alpha)
        provider.register_pre_wrap_hook(lambda chunks: peft(chunks, training=True))
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True,
                                               mixed_precision_wrapper=None)
    return model, bridge


def _seed(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:6], "little")


@torch.no_grad()
def randomize_adapters(model, *, seed: int, scale: float = 0.1) -> None:
    """Every Bridge adapter tensor (``linear_in``, ``linear_out``) seeded random: each global tensor (its
    ``torch_dist`` key, ``sync_service.megatron.placement``) drawn whole from ``seed`` and the key, each rank
    keeping its boxes — so replicas (TP-replicated factors, data-parallel copies) hold equal values."""
    from sync_service.megatron.placement import local_placements

    params = {n: p for chunk in model for n, p in chunk.named_parameters()}
    for pl in local_placements(model):
        if pl.role == "base":
            continue
        whole = torch.randn(pl.global_shape, generator=torch.Generator().manual_seed(_seed(seed, pl.key))) * scale
        local = params[pl.name]
        for box, index in pl.pieces:
            values = whole[tuple(slice(a, b) for a, b in box)]
            (local[index] if index else local).copy_(values)


@torch.no_grad()
def megatron_logits(model, tokens: torch.Tensor = TOKENS) -> torch.Tensor | None:
    """Megatron's own forward of ``model`` on ``tokens`` [b, s]: fp32 logits [b, s, V] gathered over TP, on the last
    pipeline stage (``None`` on the others). With pipeline stages each stage runs its own chunk's forward and
    hands its hidden states [s, b, H] to the next stage (gloo send / recv on Megatron's pipeline group, as its
    schedule's p2p does). The causal mask is explicit: the local spec's attention needs it on CPU."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    b, s = tokens.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).expand(b, 1, s, s)
    positions = torch.arange(s).expand(b, s)
    for chunk in model:
        chunk.train(False)  # inference mode (nn.Module.train(False): dropout off)
    chunk = model[0]
    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    if pp > 1:
        if stage > 0:
            hidden = torch.empty(s, b, chunk.config.hidden_size, dtype=torch.float32)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            chunk.set_input_tensor(hidden)
        out = chunk(input_ids=tokens, position_ids=positions, attention_mask=mask)
        if stage < pp - 1:
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
        logits = out
    else:
        logits = chunk(input_ids=tokens, position_ids=positions, attention_mask=mask)
    if ps.get_tensor_model_parallel_world_size() > 1:
        logits = gather_from_tensor_model_parallel_region(logits)
    return logits.float()


class MegatronRank:
    """One Megatron-Core rank (``rank`` of ``world``); see the module docstring. Run as
    ``ray.remote(num_cpus=0, max_concurrency=4)(MegatronRank)`` (``start_megatron_ranks`` does)."""

    def __init__(self, rank: int, world: int) -> None:
        torch.set_num_threads(1)
        os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self.rank, self.world = rank, world
        self.model = self.bridge = None
        self.mesh: dict[str, int] = {}
        self.hf_dir = ""

    def rendezvous(self) -> tuple[str, int]:
        from sync_service.transports.store import free_port

        return "127.0.0.1", free_port()

    def build(self, host: str, port: int, hf_dir: str, *, tp: int = 1, ep: int = 1, etp: int | None = None,
              pp: int = 1, seed: int | None = 0, timeout_s: float = 300) -> dict[str, int]:
        """Join the gloo group, initialize ``parallel_state`` and build the model (collective: every actor at once);
        the adapters random from ``seed`` (``None``: Bridge's own init, ``linear_out`` zero). Returns the mesh
        ``{"tp", "ep", "etp", "pp", "dp"}`` (Megatron's sizes; dp of the dense layers)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world,
                                    timeout=timedelta(seconds=timeout_s))
        self.model, self.bridge = build_model(hf_dir, tp=tp, ep=ep, etp=etp, pp=pp)
        self.hf_dir = hf_dir
        if seed is not None:
            randomize_adapters(self.model, seed=seed)
        self.mesh = {"tp": tp, "ep": ep, "etp": etp or tp, "pp": pp,
                     "dp": ps.get_data_parallel_world_size(with_context_parallel=True)}
        return dict(self.mesh)

    def attach(self, **kw):
        """``attach_megatron`` over this rank's model (``hf_config``: the HF directory it was built from, unless
        given); the ``EndpointHandle``. Collective: every actor at once."""
        from sync_service.megatron.attach import attach_megatron

        kw.setdefault("hf_config", self.hf_dir)
        return attach_megatron(self.model, **kw)

    def logits(self, tokens: list[list[int]] | None = None) -> np.ndarray | None:
        """Megatron's forward (``megatron_logits``) on ``tokens`` (default ``TOKENS``); collective."""
        t = TOKENS if tokens is None else torch.tensor(tokens, dtype=torch.long)
        out = megatron_logits(self.model, t)
        return None if out is None else out.numpy()

    def randomize_adapters(self, seed: int, scale: float = 0.1) -> None:
        randomize_adapters(self.model, seed=seed, scale=scale)

    def adapter_state(self) -> dict[str, np.ndarray]:
        """This rank's adapter parameters (local shards) by parameter name."""
        return {n: p.detach().numpy().copy() for chunk in self.model for n, p in chunk.named_parameters()
                if ".adapter." in n}

    @torch.no_grad()
    def set_adapters(self, tensors: dict[str, np.ndarray]) -> None:
        """Copy ``tensors`` (parameter name → this rank's local values) into the adapter parameters.

        Raises:
            KeyError: a name that is not an adapter parameter of this rank. ValueError: another shape."""
        params = {n: p for chunk in self.model for n, p in chunk.named_parameters() if ".adapter." in n}
        for name, value in tensors.items():
            if name not in params:
                raise KeyError(f"{name} is not an adapter parameter of Megatron rank {self.rank}")
            if tuple(value.shape) != tuple(params[name].shape):
                raise ValueError(f"{name}: shape {tuple(value.shape)}, the rank holds {tuple(params[name].shape)}")
            params[name].copy_(torch.from_numpy(np.asarray(value)))


def start_megatron_ranks(hf_dir: str, *, world: int, tp: int = 1, ep: int = 1, etp: int | None = None, pp: int = 1,
                         seed: int | None = 0, timeout_s: float = 300) -> tuple[list, dict]:
    """(actors in rank order, mesh): ``world`` ``MegatronRank`` actors in one gloo group, each with its model built
    (``MegatronRank.build``; dense layers tp × pp × dp, dp = world / (tp · pp)). Ray must be initialized.

    Raises:
        ValueError: sizes that are not positive or do not divide as Megatron requires (tp · pp divides the world,
            ep · etp divides world / pp)."""
    import ray

    etp_ = etp or tp
    if min(tp, ep, etp_, pp, world) < 1 or world % (tp * pp) or (world // pp) % (ep * etp_):
        raise ValueError(f"start_megatron_ranks: world={world} tp={tp} ep={ep} etp={etp_} pp={pp}: tp x pp must divide "
                         f"the world and ep x etp must divide world / pp")
    actor = ray.remote(num_cpus=0, max_concurrency=4)(MegatronRank)
    ranks = [actor.remote(k, world) for k in range(world)]
    host, port = ray.get(ranks[0].rendezvous.remote(), timeout=timeout_s)
    meshes = ray.get([r.build.remote(host, port, hf_dir, tp=tp, ep=ep, etp=etp, pp=pp, seed=seed,
                                     timeout_s=timeout_s) for r in ranks], timeout=timeout_s)
    return ranks, meshes[0]
