"""A plain torch FSDP2 training job that refreshes a rollout engine after every optimizer step (docs/integrate.md).

    python examples/fsdp2_loop.py [--base DIR] [--world 2] [--steps 3]

Everything a job of one's own needs, in order: Ray, training ranks as Ray actors (``max_concurrency=2``, so
weightsync's calls run beside a step), the rendezvous of their process group (rank 0's host and a free port),
PEFT LoRA on attention and on the fused experts, FSDP2 ``fully_shard`` per decoder layer, AdamW on an LM loss
over a batch per rank and step, ``attach_trainer`` on every rank, one ``WeightSync`` in the driver, ``push``
after each step. Then one's own check of what the engine serves: the served bytes of one tensor
(``served_weights``) against W + scaling · B @ A computed from the ranks' DTensors.

``DTensor.full_tensor()`` is a collective (an all-gather over the mesh): every rank must call it, in the same
order. Called on rank 0 alone it waits for the others forever; here every rank runs ``merged_weight``.

Without ``--base`` a tiny Qwen3-MoE checkpoint is generated in a temporary directory (random weights,
``sync_service.synthetic``); any transformers MoE checkpoint whose experts PEFT can target works.

The rank class lives in this script, so Ray ships it by value: it imports torch and the rest inside its methods.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from datetime import timedelta

import ray

TARGET = "model.layers.0.self_attn.q_proj"
"""The module the check reads back (its ``weight`` as the engine names it)."""


@ray.remote(num_cpus=0, max_concurrency=2)
class Worker:
    """One training rank."""

    def rendezvous(self) -> str:
        """Rank 0's address for the process group: this host and a free port."""
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"tcp://127.0.0.1:{s.getsockname()[1]}"

    def setup(self, rank: int, world: int, master: str, base: str):
        import torch
        import torch.distributed as dist
        from peft import LoraConfig, get_peft_model
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

        from sync_service.live import attach_trainer

        torch.set_num_threads(1)
        self.rank, self.world = rank, world
        dist.init_process_group("gloo", init_method=master, rank=rank, world_size=world, timeout=timedelta(seconds=120))
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
        self.vocab = model.config.vocab_size
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        self.model = fully_shard(model, mesh=mesh)
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        return attach_trainer(self.model)  # a collective too: every rank, after wrapping

    def train_step(self, step: int) -> float:
        import torch

        batch = torch.randint(3, self.vocab, (2, 16), generator=torch.Generator().manual_seed(step * self.world + self.rank))
        loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return float(loss)

    def merged_weight(self, module: str) -> torch.Tensor | None:
        """W + scaling · B @ A of a LoRA ``module``, whole, on rank 0 (None elsewhere). Collective: every rank
        calls it (``full_tensor()`` all-gathers the DTensor shards)."""
        lora = self.model.base_model.model.get_submodule(module)
        w, a, b = (p.full_tensor() for p in (lora.base_layer.weight, lora.lora_A["default"].weight,
                                             lora.lora_B["default"].weight))
        return (w + lora.scaling["default"] * (b @ a)).detach() if self.rank == 0 else None


def tiny_base(root: str) -> str:
    from sync_service.synthetic import make_base

    return str(make_base("qwen3_moe", f"{root}/base", dtype="float32", hidden=64, intermediate=32, num_experts=4,
                         vocab_size=128, scale=0.1))


def served(engine, name: str) -> tuple[int | None, torch.Tensor]:
    """The version and the bytes ``engine`` serves for ``name``, as a tensor (``served_weights(values=True)``)."""
    import torch

    from sync_service.coordinator.readback import served_weights

    (weights,) = served_weights([engine], names=[name], values=True).values()
    (t,) = weights.tensors
    return weights.version, torch.frombuffer(bytearray(t.values), dtype=getattr(torch, t.dtype)).reshape(t.shape)


def main(argv: list[str] | None = None) -> int:
    import torch

    from actors.launch import start_engines
    from sync_service.api import SyncConfig, WeightSync

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="a transformers MoE checkpoint (default: a generated tiny one)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = args.base or tiny_base(tmp)
        ray.init(num_cpus=2, include_dashboard=False)
        try:
            workers = [Worker.remote() for _ in range(args.world)]
            master = ray.get(workers[0].rendezvous.remote(), timeout=60)
            handles = ray.get([w.setup.remote(k, args.world, master, base) for k, w in enumerate(workers)], timeout=300)
            engines = start_engines(base, 1)
            sync = WeightSync(trainers=handles, engines=engines, config=SyncConfig(transport="shm", timeout_s=120))
            _, before = served(engines[0], f"{TARGET}.weight")
            for step in range(args.steps):
                losses = ray.get([w.train_step.remote(step) for w in workers], timeout=300)
                metrics = sync.push(step)  # the first push is full, then deltas
                want = ray.get([w.merged_weight.remote(TARGET) for w in workers], timeout=120)[0]  # every rank
                version, got = served(engines[0], f"{TARGET}.weight")
                diff = float((got - want.to(got.dtype)).abs().max())
                ok = version == step and diff <= 1e-6 and not torch.equal(got, before)
                print(f"step {step}: loss {sum(losses) / len(losses):.4f}, pushed {metrics.bytes} bytes "
                      f"({'full' if metrics.full else 'delta'}), engine serves version {version}, {TARGET}.weight "
                      f"max |served - W + s·B@A| = {diff:.1e}: {'ok' if ok else 'MISMATCH'}", flush=True)
                if not ok:
                    return 1
            sync.close()
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
