"""A Megatron-Core LoRA training step on CPU: a real LM loss through Megatron's own forward and backward, AdamW on
the Megatron-Bridge adapter parameters only (the Megatron demo's trainer; ``weightsync demo --trainer megatron``).

``AdapterTrainer(model)`` over one rank's model chunks (a list, as ``provide_distributed_model`` returns; any TP /
EP / expert-TP / PP of Megatron's ``parallel_state``):

- the batch is fixed: ``fixed_batch`` draws ``global_batch`` sequences of ``seq_len`` token ids [0, vocab) from a
  seed; each data-parallel rank takes its own ``global_batch / dp`` of them, split in micro-batches of 1 (the ranks
  of one TP / PP group see the same tokens, as Megatron requires);
- the step runs Megatron's own schedule, ``megatron.core.pipeline_parallel.get_forward_backward_func()``
  (``forward_backward_no_pipelining`` at PP=1, the 1F1B ``forward_backward_pipelining_without_interleaving`` with
  its p2p send / recv of hidden states at PP > 1), over ``GPTModel.forward(input_ids, position_ids,
  attention_mask, labels)``: the per-token loss is Megatron's vocab-parallel cross entropy (next token), averaged
  over the micro-batch's tokens; the schedule divides by the number of micro-batches;
- gradients are reduced as Megatron's ``DistributedDataParallel`` does (we do not wrap: the model stays the
  chunks Megatron-Bridge built and that weightsync reads in place): every dense parameter's gradient summed over
  the data-parallel group, every expert parameter's (``allreduce`` False) over the expert-data-parallel group,
  both scaled by 1 / dp (Megatron's ``gradient_scaling_factor`` and ``expert_gradient_scaling_factor`` without
  ``average_in_collective``). The expert gradients are also divided by the copies of each token the experts
  computed on (``_expert_token_copies``): without sequence parallelism (the CPU provider's layout, which the
  endpoint reads) the ranks of a TP group hold the same tokens and the allgather dispatcher gathers each of them
  from every rank of the expert tensor-and-model-parallel group, so an expert's weight gradient sums that many
  copies (the forward is right: the combine hands each copy back to its own rank). Megatron-Core refuses to train
  MoE × TP without sequence parallelism; with this division the gradients equal one rank's at expert-TP 1
  (``tests/megatron/test_train.py``). At expert-TP > 1 Megatron-Bridge 0.6.2's expert adapter gradients are not the
  derivative of its forward (measured, docs/integrate.md "Megatron-Core / Megatron-Bridge"): the step applies them
  as Megatron computes them. The Bridge adapters are all tensor-parallel shards (``tensor_model_parallel``
  True), so no gradient needs a TP reduction; the base is frozen (Bridge's LoRA sets ``requires_grad`` False);
- at construction every adapter parameter is broadcast from the first rank of its (expert-)data-parallel group,
  as Megatron's DDP ``broadcast_params`` does, so replicas start equal and stay equal;
- ``torch.optim.AdamW`` over the adapter parameters only (``linear_in`` / ``linear_out``); its state is per rank,
  for the shards the rank holds.

``step()`` returns the loss before the update: the mean over the data-parallel ranks of their micro-batch
losses, the same value on every rank (an all-reduce over the world). Runs on CPU only with the CPU launcher's
patches (``megatron_cpu.apply``: its ``schedules total_num_tokens`` patch is the schedule's); on a GPU it needs
none (unmeasured: no GPU lent).
"""

from __future__ import annotations

from functools import partial

import torch

__all__ = ["AdapterTrainer", "adapter_parameters", "fixed_batch"]


def fixed_batch(vocab: int, *, global_batch: int = 4, seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    """The fixed training batch: ``global_batch`` sequences of ``seq_len`` token ids in [0, ``vocab``) (int64
    [global_batch, seq_len]) drawn from ``seed``; the same on every rank."""
    return torch.randint(0, vocab, (global_batch, seq_len), generator=torch.Generator().manual_seed(seed))


def adapter_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every Megatron-Bridge adapter parameter (``.adapter.`` in its name) of the chunks."""
    return [(n, p) for chunk in model for n, p in chunk.named_parameters() if ".adapter." in n]


def _forward_step(batches, data_iterator, model):
    """Megatron's ``forward_step_func``: (output, loss_func) of one micro-batch [1, s] (labels: the next token)."""
    tokens = next(data_iterator)
    b, s = tokens.shape
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    s -= 1
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).expand(b, 1, s, s)
    positions = torch.arange(s).expand(b, s)
    out = model(input_ids=inputs, position_ids=positions, attention_mask=mask, labels=labels)
    return out, partial(_loss, batches)


def _loss(batches: list, per_token: torch.Tensor):
    """Megatron's loss_func: the mean per-token loss of the micro-batch; its value kept in ``batches``."""
    loss = per_token.float().mean()
    batches.append(loss.detach().clone())
    return loss, {"lm loss": loss.detach()}


def _expert_token_copies(config) -> int:
    """How many copies of each token an expert computes on: without sequence parallelism every rank of a TP group
    holds the same tokens, and the allgather dispatcher gathers over the expert tensor-and-model-parallel group,
    so each token arrives once per rank of that group in this rank's TP group (1 with sequence parallelism)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if config.sequence_parallel or ps.get_tensor_model_parallel_world_size() == 1:
        return 1
    tp = set(dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()))
    return len(tp & set(dist.get_process_group_ranks(ps.get_expert_tensor_and_model_parallel_group())))


class AdapterTrainer:
    """AdamW on the Bridge adapters of ``model`` (this rank's chunks) over Megatron's forward / backward on
    ``tokens`` (the fixed global batch [B, s]; default ``fixed_batch`` of the model's vocabulary); see the module
    docstring.

    The chunks run in eval mode, with autograd on: Megatron-Core 0.19 refuses MoE × tensor parallelism in training
    mode without sequence parallelism (``MoELayer.forward``), which the CPU provider leaves off (the local spec's torch
    norm refuses it without Transformer Engine or Apex; the expert gradients' token copies that this brings are divided
    out: the module docstring). The function differentiated is the one training mode computes, because what differs between the modes
    is off in this model: dropout (``hidden_dropout`` / ``attention_dropout`` 0, checked here), the router's
    input jitter (``moe_input_jitter_eps`` unset) and its auxiliary loss (``moe_aux_loss_coeff`` 0). It is also
    exactly the forward the demo's oracle runs (``megatron_logits``, eval mode).

    Raises:
        ValueError: no adapter parameter in ``model`` (Bridge LoRA not applied), dropout or a router term that
            only training mode computes, or a global batch that the data-parallel size does not divide."""

    def __init__(self, model, *, lr: float = 3e-2, tokens: torch.Tensor | None = None, seed: int = 0) -> None:
        from megatron.core import parallel_state as ps

        self.model = model
        self.params = adapter_parameters(model)
        if not self.params:
            raise ValueError("AdapterTrainer: the model has no Megatron-Bridge adapter parameter (.adapter.): apply "
                             "Bridge LoRA before training")
        for chunk in model:
            for name, p in chunk.named_parameters():
                p.requires_grad_(".adapter." in name)
        config = model[0].config
        train_only = {k: getattr(config, k, None) for k in ("hidden_dropout", "attention_dropout",
                                                             "moe_input_jitter_eps", "moe_aux_loss_coeff")}
        if any(train_only.values()):
            raise ValueError(f"AdapterTrainer: {train_only}: the step runs in eval mode, where these are off; "
                             "set them to 0 / None in the provider")
        self.dp = ps.get_data_parallel_world_size(with_context_parallel=True)
        tokens = fixed_batch(config.vocab_size if hasattr(config, "vocab_size") else model[0].vocab_size, seed=seed) \
            if tokens is None else tokens
        if tokens.shape[0] % self.dp:
            raise ValueError(f"AdapterTrainer: a global batch of {tokens.shape[0]} does not split over dp={self.dp}")
        per = tokens.shape[0] // self.dp
        rank = ps.get_data_parallel_rank(with_context_parallel=True)
        self.micro = [tokens[i:i + 1] for i in range(rank * per, (rank + 1) * per)]
        self.seq_len = tokens.shape[1] - 1
        self.optimizer = torch.optim.AdamW([p for _, p in self.params], lr=lr, weight_decay=0.0)
        self.groups = {True: ps.get_data_parallel_group(with_context_parallel=True),
                       False: ps.get_expert_data_parallel_group()}
        self.token_copies = _expert_token_copies(config)
        self.steps = 0
        self._broadcast_params()

    @torch.no_grad()
    def _broadcast_params(self) -> None:
        """Every adapter parameter from the first rank of its data-parallel group (dense) or expert-data-parallel
        group (experts), as Megatron's ``DistributedDataParallel.broadcast_params`` does at wrap: replicas start
        equal (Megatron's CPU initialization draws each rank's ``linear_in`` from its own RNG)."""
        import torch.distributed as dist

        for _, p in self.params:
            group = self.groups[getattr(p, "allreduce", True)]
            if dist.get_world_size(group) > 1:
                dist.broadcast(p.data, src=dist.get_global_rank(group, 0), group=group)

    def step(self) -> float:
        """One AdamW step on the fixed batch; returns the loss before it (mean over the data-parallel ranks)."""
        loss = self.backward()
        self.optimizer.step()
        self.steps += 1
        return loss

    def backward(self) -> float:
        """Megatron's forward and backward of the fixed batch, the gradients reduced (each adapter parameter's
        ``.grad``: the gradient of the global batch's mean micro-batch loss, this rank's shard); returns the loss
        (mean over the data-parallel ranks, the same on every rank). Collective."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        for chunk in self.model:  # inference mode (train(False)): see the class docstring
            chunk.train(False)
        self.optimizer.zero_grad(set_to_none=True)
        config = self.model[0].config
        config.finalize_model_grads_func = None  # we reduce below, as Megatron's DDP would
        config.grad_scale_func = None
        batches: list[torch.Tensor] = []
        get_forward_backward_func()(
            forward_step_func=partial(_forward_step, batches), data_iterator=iter(self.micro),
            model=self.model if len(self.model) > 1 else self.model[0], num_microbatches=len(self.micro),
            seq_length=self.seq_len, micro_batch_size=1, forward_only=False)
        self._reduce_grads()
        # the loss lives on the last pipeline stage; every rank reports the same mean over the dp ranks
        loss = torch.stack(batches).mean() if batches else torch.zeros(())
        last = ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
        total = torch.stack([loss * last, torch.tensor(float(last))])
        dist.all_reduce(total)
        return (total[0] / total[1]).item()

    def _reduce_grads(self) -> None:
        import torch.distributed as dist

        for name, p in self.params:
            if p.grad is None:  # an expert no token reached, on this rank
                p.grad = torch.zeros_like(p)
            group = self.groups[getattr(p, "allreduce", True)]
            if dist.get_world_size(group) > 1:
                dist.all_reduce(p.grad, group=group)
            p.grad.div_(self.dp * (self.token_copies if ".mlp.experts." in name else 1))
