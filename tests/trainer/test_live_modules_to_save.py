"""A live PEFT model with ``modules_to_save``: the trained copy replaces its base tensor in the sync,
the frozen original is the base. One process (no group): the endpoint's merged boxes of two versions
equal PEFT ``merge_and_unload`` in float64 (cast once) of the adapter as PEFT saves it."""

from __future__ import annotations

import torch

from protocols.params import box_shape
from sync_service.dtypes import TORCH_DTYPES


def _merged_boxes(endpoint, version: int) -> tuple[dict[str, torch.Tensor], frozenset[str] | None]:
    report = endpoint.snapshot(version)
    source = endpoint.state.source(version)
    out = {}
    for m in endpoint.owned_metas():
        whole = out.setdefault(m.name, torch.empty(m.shape, dtype=TORCH_DTYPES[m.dtype]))
        box = m.box or tuple((0, n) for n in m.shape)
        view = whole[tuple(slice(a, b) for a, b in box)]
        assert tuple(view.shape) == box_shape(box)
        source.fill(m.name, box, view)
    return out, report.changed


def test_modules_to_save_copy_replaces_its_base_tensor(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from sync_service.live import build_endpoint
    from sync_service.synthetic import make_base
    from tests.merge.conftest import peft_merged_model

    base_dir = make_base("qwen3_moe", tmp_path / "base", num_experts=4, num_layers=1, hidden=32)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                            modules_to_save=["lm_head"]))
    endpoint = build_endpoint(peft, group=None, rank=0, world=1)
    copy = dict(peft.named_parameters())["base_model.model.lm_head.modules_to_save.default.weight"]
    original = dict(peft.named_parameters())["base_model.model.lm_head.original_module.weight"].detach().clone()
    g = torch.Generator().manual_seed(0)
    for version in range(2):
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name or "modules_to_save" in name:
                    p.add_(torch.randn(p.shape, generator=g) * 0.1)
        held = copy.detach().clone()
        got, changed = _merged_boxes(endpoint, version)
        assert torch.equal(copy.detach(), held), "the sync wrote the trained copy"
        assert changed is None if version == 0 else "lm_head.weight" in changed
        peft.save_pretrained(str(tmp_path / f"lora{version}"))
        oracle = peft_merged_model(base_dir, tmp_path / f"lora{version}").to(torch.float32).state_dict()
        assert not torch.equal(oracle["lm_head.weight"], original), "the copy was not trained"
        assert set(got) == set(oracle)
        for name, ref in oracle.items():
            torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"v{version} {n}: {m}")
    assert torch.equal(dict(peft.named_parameters())["base_model.model.lm_head.original_module.weight"], original)
