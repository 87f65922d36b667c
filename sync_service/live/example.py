"""An example training rank, as a user's Ray actor runs one: a real PEFT LoRA training loop (gloo on CPU).

It is what an RL framework's worker looks like: it builds the model from a checkpoint, adds PEFT
LoRA on attention (``target_modules``) and on the fused experts (``target_parameters``), wraps it
(FSDP2 ``fully_shard`` per decoder layer, DDP, or expert parallel: each rank's module holds only its
expert block, or, given a ``mesh_shape``, FSDP2 × EP / TP × EP over DTensors: ``example_ep.py``) and
trains with AdamW on an LM loss. It calls ``attach_trainer`` and knows nothing else of weightsync. ``weightsync demo --trainer KIND`` and the tests run it as
``ray.remote(num_cpus=0, max_concurrency=2)(ExampleTrainingRank)``: the endpoint's calls run beside
the training step. ``hold_sends`` / ``release_sends`` gate the endpoint's sends (``before_send``)
so a test can make a send overlap a training step for certain.
"""

from __future__ import annotations

import hashlib
import threading
from datetime import timedelta

import numpy as np
import torch

from sync_service.live.example_ep import average_grads_over_ep, build_ep, ep_data_rank
from sync_service.live.example_load import empty_base, load_from_rank0
from sync_service.live.example_mesh import data_rank, wrap_fsdp2
from sync_service.transports.store import free_port

MODES = ("fsdp2", "ddp", "ep")
TARGET_MODULES = ["q_proj", "v_proj"]
TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def lora_config(r: int = 2):
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=8, target_modules=TARGET_MODULES, target_parameters=TARGET_PARAMETERS)


def _localize_experts(model, rank: int, world: int) -> None:
    """Keep only this rank's contiguous expert block in every MoE layer (as torchtitan shards experts);
    the routes to other ranks' experts get weight 0 here (their ranks compute them; no all-to-all in
    this test)."""
    for layer in model.model.layers:
        experts = layer.mlp.experts
        e_local = experts.num_experts // world
        e0 = rank * e_local
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            setattr(experts, name, torch.nn.Parameter(full.detach()[e0:e0 + e_local].clone()))
        experts.num_experts = e_local

        def remap(_module, args, kwargs, e0=e0, e_local=e_local):
            hidden, index, weights = (list(args) + [kwargs.get(k) for k in ("top_k_index", "top_k_weights")])[:3]
            mine = (index >= e0) & (index < e0 + e_local)  # others' experts: local expert 0 with weight 0
            return (hidden, torch.where(mine, index - e0, 0), weights * mine), {}

        experts.register_forward_pre_hook(remap, with_kwargs=True)


@torch.no_grad()
def _randomize_lora(model, rank: int, ep: bool) -> None:
    """Non-zero seeded factors; replicated factors equal on every rank, EP expert factors per rank."""
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if "lora_" not in name:
            continue
        expert = ".experts." in name
        seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little") + (1000 * rank if ep and expert else 0)
        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)


class ExampleTrainingRank:
    """One rank of a user's training job (see the module docstring); ``rank`` of ``world``."""

    def __init__(self, rank: int, world: int) -> None:
        torch.set_num_threads(1)
        self.rank, self.world = rank, world
        self._hold = threading.Event()
        self._release = threading.Event()
        self._step = 0
        self._data_rank = rank
        self._ep_mesh = None  # the DTensor EP mesh (mode "ep" with a mesh_shape)

    def rendezvous(self) -> tuple[str, int]:
        return "127.0.0.1", free_port()

    def setup(self, host: str, port: int, base_dir: str, mode: str, *, lora_r: int = 2, shard_dim: int = 0,
              mesh_shape: tuple[int, ...] | None = None, tp: bool = False, restore: dict[str, np.ndarray] | None = None,
              dtype: str = "float32", **attach_kw):
        """Join the training group, ``build`` the model and optimizer (its arguments); attach weightsync."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=120))
        return self.attach(self.build(base_dir, mode, lora_r=lora_r, shard_dim=shard_dim, mesh_shape=mesh_shape, tp=tp,
                                      restore=restore, dtype=dtype), **attach_kw)

    def build(self, base_dir: str, mode: str, *, lora_r: int = 2, shard_dim: int = 0,
              mesh_shape: tuple[int, ...] | None = None, tp: bool = False, restore: dict[str, np.ndarray] | None = None,
              dtype: str = "float32"):
        """Build and wrap the model and make the optimizer, over the default process group (made by
        ``setup``, or by the job: a Ray Train worker's); returns the wrapped model (``self.model``).
        ``lora_r`` / ``shard_dim`` (FSDP2 placement dim) / ``mesh_shape`` (FSDP2 mesh, default ``(world,)``;
        2-D: HSDP) / ``tp`` (the last mesh axis is TP: ``example_mesh.py``) choose the sharding, or give
        ranks differing models;
        ``mode="ep"`` with a 2-D ``mesh_shape``: FSDP2 × EP on ("dp", "ep"), with ``tp``: TP × EP on ("ep", "tp")
        (``example_ep.py``); without one, plain expert blocks (``expert_range=``);
        ``restore``: the whole adapter of a checkpoint (``adapter_state``) to resume from (not under EP);
        ``dtype``: the torch dtype name the base is loaded in (the engines' dtype). Under FSDP2 (``mode="fsdp2"``,
        no ``restore``, no ``tp``) only rank 0 reads the checkpoint; the others build the model weightless and receive their
        shards (``example_load.py``)."""
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM

        self.mode, self._step, self._ep_mesh = mode, 0, None
        blocks = mode == "ep" and mesh_shape is None  # plain expert blocks
        # FSDP2 / HSDP: rank 0 reads, the others get their shards; not under TP (parallelize_module scatters from
        # every TP group's first rank, which would hold no values)
        from_rank0 = mode == "fsdp2" and restore is None and not tp
        if from_rank0 and self.rank != 0:
            base = empty_base(base_dir, getattr(torch, dtype))
        else:
            base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=getattr(torch, dtype))
        if blocks:
            _localize_experts(base, self.rank, self.world)
        self.peft = get_peft_model(base, lora_config(lora_r))
        _randomize_lora(self.peft, self.rank, blocks)
        if restore is not None:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.peft, {k: torch.from_numpy(v.copy()) for k, v in restore.items()})
        if mode == "ep" and not blocks:
            kind = "tp" if tp else "fsdp2"
            self._data_rank = ep_data_rank(self.rank, tuple(mesh_shape), kind)
            self.model, self._ep_mesh = build_ep(self.peft, mesh_shape=tuple(mesh_shape), ep_kind=kind)
        else:
            mesh_shape = tuple(mesh_shape or (self.world,))
            self._data_rank = data_rank(self.rank, mesh_shape, tp and mode == "fsdp2")  # a TP group shares a batch
            full = self.peft.state_dict() if from_rank0 and self.rank == 0 else None
            self.model = self._wrap(mode, shard_dim, mesh_shape, tp)
            if from_rank0:
                load_from_rank0(self.model, full)
                del full
        self.opt = torch.optim.AdamW([p for p in self.peft.parameters() if p.requires_grad], lr=2e-2)
        return self.model

    def attach(self, model, **attach_kw):
        """``attach_trainer(model)`` with this rank's send gate (``hold_sends``) and, under EP, its expert range."""
        from sync_service.live import attach_trainer

        kw = dict(attach_kw)
        if self._blocks and "expert_range" not in kw:
            e_local = self.peft.get_base_model().model.layers[0].mlp.experts.num_experts
            kw["expert_range"] = (self.rank * e_local, (self.rank + 1) * e_local)
        return attach_trainer(model, before_send=self._gate, **kw)

    @property
    def _blocks(self) -> bool:
        """Expert parallel over plain expert blocks (mode "ep" without a mesh)."""
        return self.mode == "ep" and self._ep_mesh is None

    def _wrap(self, mode: str, shard_dim: int, mesh_shape: tuple[int, ...], tp: bool):
        if mode == "fsdp2":
            return wrap_fsdp2(self.peft, mesh_shape=mesh_shape, shard_dim=shard_dim, tp=tp)
        if mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(self.peft, find_unused_parameters=True)
        return self.peft

    def train_step(self) -> float:
        """One AdamW step on an LM loss over a fixed batch of seeded tokens (one per data-parallel rank, the
        same every step, so the returned loss — computed before this step's update — falls as the model
        learns it), in the usual order ``zero_grad``, forward, backward, ``step``: the step's grads stay in
        ``.grad`` until the next step."""
        import torch.distributed as dist

        self._step += 1
        g = torch.Generator().manual_seed(self._data_rank)
        tokens = torch.randint(3, 64, (2, 12), generator=g)
        self.opt.zero_grad(set_to_none=False)
        loss = self.model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        if self._ep_mesh is not None and self._ep_mesh.mesh_dim_names[-1] == "tp":
            average_grads_over_ep(self.peft, self._ep_mesh)
        elif self._blocks:  # the non-expert part is data parallel across EP ranks
            for name, p in self.peft.named_parameters():
                if p.grad is not None and ".experts." not in name:
                    dist.all_reduce(p.grad)  # gloo has no AVG
                    p.grad.div_(self.world)
        self.opt.step()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {self.rank} step {self._step}: loss {float(loss)}")
        return float(loss)

    def adapter_state(self) -> dict[str, np.ndarray]:
        """The whole trained adapter (PEFT keys, full tensors). Collective: every rank calls it."""
        import torch.distributed as dist
        from peft import get_peft_model_state_dict

        out = {}
        for key, t in sorted(get_peft_model_state_dict(self.peft).items()):
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            elif self._blocks and ".experts." in key:
                parts = [torch.empty_like(t) for _ in range(self.world)]
                dist.all_gather(parts, t.detach().contiguous())
                t = _join_experts(key, parts, self.peft.peft_config[self.peft.active_adapter].r)
            out[key] = t.detach().numpy().copy()
        return out

    def save_checkpoint(self, out_dir: str) -> None:
        """Save the whole PEFT model as FSDP2 trainers do: ``get_model_state_dict`` of the wrapped model and
        ``torch.distributed.checkpoint.save`` (every rank writes its own shards; keys are the PEFT model's
        names), and on rank 0 its ``config.json`` and ``adapter_config.json`` beside them. Collective.

        Raises:
            ValueError: in ``ep`` mode (each rank's model holds only its expert block).
        """
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        if self.mode == "ep":
            raise ValueError("save_checkpoint: the ep mode's ranks hold partial models; use fsdp2 or ddp")
        dcp.save(get_model_state_dict(self.model), checkpoint_id=out_dir)
        if self.rank == 0:
            self.peft.get_base_model().config.save_pretrained(out_dir)
            self.peft.peft_config["default"].save_pretrained(out_dir)
        dist.barrier()

    def digest(self) -> str:
        """sha256 over every parameter, grad and optimizer-state tensor (local bytes)."""
        h = hashlib.sha256()
        for name, p in self.peft.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            h.update(name.encode() + local.detach().numpy().tobytes())
            if p.grad is not None:
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                h.update(grad.numpy().tobytes())
        for state in self.opt.state.values():
            for k, v in sorted(state.items()):
                v = v.to_local() if hasattr(v, "to_local") else v
                h.update(k.encode() + (v.numpy().tobytes() if torch.is_tensor(v) else repr(v).encode()))
        return h.hexdigest()

    def hold_sends(self) -> None:
        """The next send waits in ``before_send`` until ``release_sends`` (injected gate)."""
        self._release.clear()
        self._hold.set()

    def release_sends(self) -> None:
        self._hold.clear()
        self._release.set()

    def _gate(self, version: int) -> None:
        if self._hold.is_set() and not self._release.wait(timeout=120):
            raise TimeoutError(f"send({version}) held for 120 s")


def _join_experts(key: str, parts: list[torch.Tensor], r: int) -> torch.Tensor:
    """EP ranks' fused expert factors of LoRA rank ``r`` → the whole factor (A [r·E, in]: rows expert-major,
    the ranks' blocks in order; B [out, r·E]: columns rank-major, k·E + e, so each rank's [out, r, E_local]
    joins on the expert dim)."""
    if ".lora_A." in key:
        return torch.cat(parts, 0)
    out, cols = parts[0].shape
    return torch.cat([p.view(out, r, cols // r) for p in parts], 2).reshape(out, -1)
