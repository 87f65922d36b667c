"""Rank bodies for the Megatron training-step test (``run_ranks`` of ``tests/megatron/ranks.py``): the same model,
adapters and fixed batch at several meshes in one process group, each rank writing its reduced gradients (with their
placements, ``sync_service.megatron.placement``) and the losses of a few AdamW steps as files, never pickles."""

from __future__ import annotations

import json
from pathlib import Path

import torch

LR = 1e-2


def train_meshes(rank: int, world: int, hf_dir: str, meshes: list[dict], out: str, seed: int, steps: int) -> None:
    """For each mesh in turn (``parallel_state`` rebuilt between them): the model at that mesh with the adapters drawn
    from ``seed`` (each global tensor from its key: equal at every mesh), ``AdapterTrainer.backward`` once — this
    rank's reduced adapter gradients to ``out/<i>/grads<rank>`` — then ``steps`` AdamW steps, the losses to
    ``out/<i>/losses.json``."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    from sync_service.entrypoints.megatron_rank import build_model, randomize_adapters
    from sync_service.entrypoints.megatron_train import AdapterTrainer
    from sync_service.megatron.placement import local_placements

    for i, mesh in enumerate(meshes):
        model, _ = build_model(hf_dir, **mesh)
        randomize_adapters(model, seed=seed)
        trainer = AdapterTrainer(model, lr=LR)
        losses = [trainer.backward()]
        grads = {n: p.grad for n, p in trainer.params}
        rows, tensors = [], {}
        for pl in local_placements(model):
            if pl.name in grads:
                rows.append({"name": pl.name, "key": pl.key, "role": pl.role, "shape": list(pl.global_shape),
                             "sender": pl.sender,
                             "pieces": [[list(map(list, box)), [[s.start, s.stop] for s in index]]
                                        for box, index in pl.pieces]})
                tensors[pl.name] = grads[pl.name].detach().clone().contiguous()
        d = Path(out, str(i))
        d.mkdir(parents=True, exist_ok=True)
        Path(d, f"grads{rank}.json").write_text(json.dumps(rows))
        save_file(tensors, str(d / f"grads{rank}.safetensors"))
        trainer.optimizer.step()
        losses += [trainer.step() for _ in range(steps - 1)]
        losses.append(trainer.backward())  # the loss after the last step
        checks = {kind: directional_check(model, trainer, kind, seed) for kind in ("linear_fc1", "linear_fc2")}
        if rank == 0:
            Path(d, "losses.json").write_text(json.dumps(losses))
            Path(d, "directional.json").write_text(json.dumps(checks))
        del trainer, model
        torch.distributed.barrier()
        ps.destroy_model_parallel()


def _direction(model, kind: str, seed: int) -> dict[str, torch.Tensor]:
    """A random direction over the experts' adapter parameters of ``kind`` ("linear_fc1" or "linear_fc2"; zero on the
    others) of the last layer only (no router downstream: top-k routing does not flip along it, the loss is smooth): each global
    tensor (stacked per layer) drawn from ``seed`` and its key, each rank keeping its boxes (replicas equal)."""
    import hashlib

    from sync_service.megatron.placement import local_placements

    params = {n: p for chunk in model for n, p in chunk.named_parameters() if ".adapter." in n}
    out = {}
    for pl in local_placements(model):
        if pl.name not in params:
            continue
        local = torch.zeros_like(params[pl.name])
        last = f"decoder.layers.{model[0].config.num_layers - 1}."  # the keys name global layers
        if ".mlp.experts." in pl.key and f".{kind}." in pl.key and pl.key.startswith(last):
            key = int.from_bytes(hashlib.sha256(f"{seed}:{kind}:{pl.key}".encode()).digest()[:6], "little")
            whole = torch.randn(pl.global_shape, generator=torch.Generator().manual_seed(key))
            for box, index in pl.pieces:
                (local[index] if index else local).copy_(whole[tuple(slice(a, b) for a, b in box)])
        out[pl.name] = local
    return out


@torch.no_grad()
def directional_check(model, trainer, kind: str, seed: int, eps: float = 1e-2) -> list[float]:
    """[the reduced gradients along a random direction u of ``kind``, the central difference D(h) = (L(θ+hu) -
    L(θ-hu)) / 2h of the loss Megatron computes at this mesh, extrapolated (4 D(ε/2) - D(ε)) / 3]: equal when the gradients are the derivative of that loss.
    Collective."""
    from sync_service.megatron.placement import local_placements

    u = _direction(model, kind, seed)
    with torch.enable_grad():
        trainer.backward()  # the gradients at θ
    grads = {n: p.grad for n, p in trainer.params}
    dot = torch.zeros((), dtype=torch.float64)
    for pl in local_placements(model):
        if pl.sender and pl.name in u:
            for _, index in pl.pieces:
                dot += (grads[pl.name][index].double() * u[pl.name][index].double()).sum()
    torch.distributed.all_reduce(dot)
    params = dict(trainer.params)

    def loss_at(shift: float) -> float:
        for name, p in params.items():
            p.add_(u[name], alpha=shift)
        with torch.enable_grad():
            loss = trainer.backward()
        for name, p in params.items():
            p.sub_(u[name], alpha=shift)
        return loss

    def central(h: float) -> float:
        return (loss_at(h) - loss_at(-h)) / (2 * h)

    return [dot.item(), (4 * central(eps / 2) - central(eps)) / 3]  # Richardson: the h^2 term cancels


def global_grads(d: Path, world: int) -> dict[str, torch.Tensor]:
    """The ranks' gradient files in ``d`` assembled into global tensors (torch_dist keys)."""
    from safetensors.torch import load_file

    from sync_service.megatron.placement import Placement, assemble

    pieces = []
    for rank in range(world):
        tensors = load_file(str(d / f"grads{rank}.safetensors"))
        for row in json.loads((d / f"grads{rank}.json").read_text()):
            boxes = tuple((tuple(map(tuple, box)), tuple(slice(a, b) for a, b in index)) for box, index in row["pieces"])
            pieces.append((Placement(row["name"], row["key"], row["role"], tuple(row["shape"]), boxes, row["sender"]),
                           tensors[row["name"]]))
    return assemble(pieces)
