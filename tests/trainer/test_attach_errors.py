"""Bad input to ``attach_trainer`` fails on every rank, naming the parameter and the fix, before any byte moves."""

from __future__ import annotations

import re

import pytest
import torch

from tests.trainer.conftest import ray


@pytest.fixture(scope="module")
def tiny(bases):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(bases["qwen3_moe"]), dtype=torch.float32)


def _attach(model, **kw):
    from sync_service.live import build_endpoint

    return build_endpoint(model, group=None, rank=0, world=1, **kw)


def test_not_a_peft_model(tiny):
    from sync_service.live import AttachError

    with pytest.raises(AttachError, match=r"not a peft\.PeftModel; pass the model peft\.get_peft_model"):
        _attach(tiny)


def test_adapter_name_that_does_not_exist(tiny):
    from peft import get_peft_model

    from sync_service.live import AttachError
    from tests.trainer.harness import lora_config

    model = get_peft_model(tiny, lora_config())
    with pytest.raises(AttachError, match=r"adapter_name='policy' is not an adapter of this model; it has \['default'\]"):
        _attach(model, adapter_name="policy")
    assert _attach(model).state.owned()  # the same model attaches with its own adapter name
    model.unload()


@pytest.mark.parametrize("kw, message", [
    ({"expert_range": (0, 1, 2)}, r"expert_range=\(0, 1, 2\) must be two ints \(e0, e1\) with 0 <= e0 < e1"),
    ({"expert_range": ("0", 2)}, r"expert_range=\('0', 2\) must be two ints"),
    ({"expert_range": (0.5, 2)}, r"expert_range=\(0.5, 2\) must be two ints"),
    ({"expert_range": (0, 1 << 70)}, r"must be two ints \(e0, e1\) with 0 <= e0 < e1"),
    ({"expert_range": (2, 2)}, r"expert_range=\(2, 2\) must be two ints"),
    ({"timeout_s": float("nan")}, r"timeout_s=nan must be a finite number of seconds > 0"),
    ({"timeout_s": 0}, r"timeout_s=0 must be a finite number of seconds > 0"),
    ({"timeout_s": 1e12}, r"timeout_s=1000000000000.0 must be a finite number of seconds > 0 and <= 604800"),
])
def test_bad_expert_range_or_timeout(tiny, kw, message):
    """Refused as AttachError naming the argument (before the ranks' all-gather, whose int64 row a
    malformed range could not fill: the other ranks would wait out their timeout)."""
    from peft import get_peft_model

    from sync_service.live import AttachError
    from tests.trainer.harness import lora_config

    model = get_peft_model(tiny, lora_config())
    try:
        with pytest.raises(AttachError, match=message):
            _attach(model, **kw)
    finally:
        model.unload()


def test_non_lora_adapter(bases):
    from peft import IA3Config, get_peft_model
    from transformers import AutoModelForCausalLM

    from sync_service.live import AttachError

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(bases["qwen3_moe"])),
                           IA3Config(target_modules=["q_proj"], feedforward_modules=[]))
    with pytest.raises(AttachError, match="not LoRA"):
        _attach(model)


def test_attach_outside_a_ray_actor(tiny):
    from sync_service.live import attach_trainer

    with pytest.raises(RuntimeError, match="inside the Ray actor"):
        attach_trainer(tiny)


def _errors(ranks, base_dir, mode: str, per_rank) -> list[str]:
    """Each rank's error text from setup (both must fail)."""
    host, port = ray.get(ranks[0].rendezvous.remote())
    refs = [r.setup.remote(host, port, str(base_dir), mode, **per_rank(k)) for k, r in enumerate(ranks)]
    texts = []
    for ref in refs:
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(ref, timeout=300)
        texts.append(str(info.value))
    return texts


@pytest.mark.parametrize("case,mode,per_rank,expected", [
    ("ranks differ", "ep", lambda k: {"lora_r": 2 + 2 * k}, r"the ranks' models differ"),
    ("expert ranges overlap", "ep", lambda k: {"expert_range": (0, 2)}, r"equal contiguous blocks in rank order"),
])
def test_bad_sharding_fails_on_every_rank(bases, ranks, case, mode, per_rank, expected):
    """(``Shard(1)`` and HSDP attach and sync exactly: ``test_live_meshes.py``.)"""
    texts = _errors(ranks, bases["qwen3_moe"], mode, per_rank)
    for text in texts:
        assert "AttachError" in text and re.search(expected, text), (case, text[-600:])


def _attach_with_partial(rank):
    """Runs in a training rank set up with FSDP2: one LoRA factor becomes a ``Partial`` DTensor (a pending
    sum); attach again."""
    from torch.distributed.tensor import DTensor, Partial

    from sync_service.live import attach_trainer

    name = next(n for n, _ in rank.peft.named_parameters() if ".lora_B." in n)
    owner = rank.peft.get_submodule(name.rsplit(".", 1)[0])
    p = owner.weight
    owner.weight = torch.nn.Parameter(DTensor.from_local(p.to_local(), p.device_mesh, [Partial()], run_check=False))
    attach_trainer(rank.model)


def test_partial_placement_fails_on_every_rank(bases, ranks):
    from tests.trainer.conftest import setup_ranks

    setup_ranks(ranks, bases["qwen3_moe"], "fsdp2")
    refs = [r.__ray_call__.remote(_attach_with_partial) for r in ranks]
    for ref in refs:
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(ref, timeout=300)
        text = str(info.value)
        assert "AttachError" in text and re.search(r"lora_B\.weight is a DTensor placed \(Partial\(sum\),\) on a 1-D "
                                                   r"mesh \(2,\); mesh axis 0 has Partial\(sum\).*redistribute", text), text[-600:]


def _reattach(rank):
    from sync_service.live import attach_trainer

    return attach_trainer(rank.model)


def test_replicas_that_differ_fail_on_every_rank(bases, ranks):
    """Two plain replicated ranks (no DDP) whose LoRA factors differ (rank 1 drifted in two factors): each would
    merge its own rows chunk from its own factors, so the engines would serve a chimera; both ranks refuse,
    naming the tensors and the ranks."""
    from tests.trainer.conftest import DRIFT_KEYS, drift_factors, setup_ranks

    setup_ranks(ranks, bases["qwen3_moe"], "plain")
    assert len(ray.get(ranks[1].__ray_call__.remote(drift_factors))) == 2
    refs = [r.__ray_call__.remote(_reattach) for r in ranks]
    for ref in refs:
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(ref, timeout=300)
        text = str(info.value)
        assert "AttachError" in text and "replicas disagree at attach: trainer ranks [0, 1]" in text, text[-800:]
        for key in DRIFT_KEYS:
            assert re.search(key + r"\.weight: ranks \[0\] vs \[1\]", text), (key, text[-800:])
