"""Layout derivation details: a hub-format (transposed) checkpoint, the one hand-written row, refusals."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from protocols.params import full_box
from sync_service.merge.base import SafetensorsBase
from sync_service.merge.derive import layout_for
from sync_service.merge.errors import MergeError
from sync_service.synthetic import build_config
from tests.merge.conftest import read_checkpoint

_VL_EXPERTS = "model.language_model.layers.0.mlp.experts"


def _hub_format(base_dir, out_dir):
    """The checkpoint with its fused experts stored [E, in, out], as the Qwen3-VL-MoE hub checkpoints are."""
    out_dir.mkdir()
    tensors = read_checkpoint(base_dir)
    hub = {k: (v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v) for k, v in tensors.items()}
    save_file(hub, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text((base_dir / "config.json").read_text())
    return hub


def test_qwen3_vl_moe_hub_checkpoint_reads_as_transformers_loads_it(base_factory, tmp_path):
    import transformers

    base = base_factory("qwen3_vl_moe")
    hub = _hub_format(base, tmp_path / "hub")
    assert hub[f"{_VL_EXPERTS}.gate_up_proj"].shape != read_checkpoint(base)[f"{_VL_EXPERTS}.gate_up_proj"].shape
    model = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(str(tmp_path / "hub"), dtype=torch.float32)
    loaded = model.state_dict()
    for directory in (base, tmp_path / "hub"):
        provider = SafetensorsBase(directory)
        for param in ("gate_up_proj", "down_proj"):
            name = f"{_VL_EXPERTS}.{param}"
            meta = next(m for m in provider.metas() if m.name == name)
            assert torch.equal(provider.read(name, full_box(meta.shape)), loaded[name]), (directory, name)


def test_square_experts_of_a_by_shape_family_are_refused(tmp_path):
    config = build_config("qwen3_vl_moe").to_dict()
    config["text_config"]["moe_intermediate_size"] = config["text_config"]["hidden_size"] // 2  # 2I == H
    (tmp_path / "config.json").write_text(json.dumps(config))
    e, h = 4, config["text_config"]["hidden_size"]
    save_file({f"{_VL_EXPERTS}.gate_up_proj": torch.zeros(e, h, h), f"{_VL_EXPERTS}.down_proj": torch.zeros(e, h, h // 2)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(MergeError, match="orientation cannot be told"):
        SafetensorsBase(tmp_path)


def test_llama4_hand_row_matches_the_experts_forward():
    """The hand row (in_out, gate block first) reproduces Llama4TextExperts' own forward per expert."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    config = build_config("llama4")
    layout = layout_for(config)
    assert layout.source == "hand" and layout.orientation == "in_out"
    torch.manual_seed(0)
    experts = Llama4TextExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
    num_experts, h = experts.gate_up_proj.shape[:2]
    x = torch.randn(num_experts * 3, h)
    got = experts(x).view(num_experts, 3, h)
    act = torch.nn.functional.silu
    for e in range(num_experts):
        w = experts.gate_up_proj[e]  # in_out: [H, 2I], the out axis is the last
        gate = w[:, slice(*layout.out_selection("gate", w.shape[1]))]
        up = w[:, slice(*layout.out_selection("up", w.shape[1]))]
        want = (act(x.view(num_experts, 3, h)[e] @ gate) * (x.view(num_experts, 3, h)[e] @ up)) @ experts.down_proj[e]
        torch.testing.assert_close(got[e], want)


@pytest.mark.parametrize("model_type,why", [
    ("deepseek_v4", "model family deepseek_v4: experts class DeepseekV4Experts overrides _apply_gate"),
    ("nemotron_h", "model family nemotron_h: experts NemotronHExperts hold ['up_proj', 'down_proj']"),
])
def test_underivable_family_is_refused_in_one_line(model_type, why):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type).to_dict()
    with pytest.raises(MergeError, match=re.escape(why)) as err:
        layout_for(config)
    assert "\n" not in str(err.value)


def test_longcat_flash_row_matches_the_experts_forward():
    """LongcatFlashExperts: the hand row where transformers lacks is_transposed / is_concatenated (< 5.20), else the
    derived one; either way [E, 2I, H] gate block first, as its forward computes (zero experts past E included)."""
    from transformers import AutoConfig
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashExperts

    config = AutoConfig.for_model("longcat_flash", hidden_size=8, expert_ffn_hidden_size=6, n_routed_experts=3,
                                  zero_expert_num=2, num_layers=1)
    layout = layout_for(config)
    torch.manual_seed(0)
    experts = LongcatFlashExperts(config)
    assert layout.source == ("derived" if hasattr(experts, "is_transposed") else "hand"), layout
    assert (layout.orientation, layout.gate_up_order, layout.expert_params) == ("out_in", "concat",
                                                                                ("gate_up_proj", "down_proj"))
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
    x, act = torch.randn(4, 8), experts.act_fn
    for e in range(3):
        # top-2: expert e with weight 1, a zero (identity) expert with weight 0
        got = experts(x, torch.tensor([[e, 3]] * 4), torch.tensor([[1.0, 0.0]] * 4))
        w = experts.gate_up_proj[e]  # out_in: [2I, H]
        gate, up = (w[slice(*layout.out_selection(s, w.shape[0]))] for s in ("gate", "up"))
        torch.testing.assert_close(got, (act(x @ gate.T) * (x @ up.T)) @ experts.down_proj[e].T)


def test_jetmoe_row_names_its_one_weight_experts():
    """jetmoe's JetMoeParallelExperts hold one 3D weight each (MLP and attention experts): stored as in memory."""
    from transformers import AutoConfig

    layout = layout_for(AutoConfig.for_model("jetmoe", num_hidden_layers=1).to_dict())
    assert layout.weight_experts == ("mlp.input_linear", "mlp.output_linear", "self_attention.experts.input_linear",
                                     "self_attention.experts.output_linear")
    assert (layout.expert_params, layout.disk, layout.disk_renames) == ((), "fused", ())
    assert layout.is_weight_expert("model.layers.3.mlp.input_linear.weight")
    assert not layout.is_weight_expert("model.layers.3.mlp.router.layer.weight")


@pytest.mark.parametrize("model_type,why", [
    ("jetmoe", "model family jetmoe: its experts are modules of one 3D weight (mlp.input_linear, "),
    ("longcat_flash", "fused expert tensors hold different expert counts ({'down_proj': 2, 'gate_up_proj': 4})"),
])
def test_expert_parallel_sync_of_these_layouts_is_refused_in_one_line(model_type, why):
    """EP shards fused experts along dim 0: jetmoe's one-weight experts and longcat_flash's zero-compute experts
    (gate_up_proj [E + Z, 2I, H], down_proj [E, H, I]) have no such split; ep=1 syncs them (merge = PEFT)."""
    from transformers import AutoConfig

    from sync_service.live.structure import check_expert_ownership
    from sync_service.sharding.base import shard_tensors
    from sync_service.sharding.rules import ShardSpec

    kwargs = {"jetmoe": dict(num_hidden_layers=1), "longcat_flash": dict(num_layers=1, hidden_size=8)}[model_type]
    layout = layout_for(AutoConfig.for_model(model_type, **kwargs).to_dict())
    experts = {"jetmoe": {"mlp.input_linear.weight": (2, 8, 4), "mlp.output_linear.weight": (2, 4, 4)},
               "longcat_flash": {"mlp.experts.gate_up_proj": (4, 8, 4), "mlp.experts.down_proj": (2, 4, 4)}}
    tensors = {f"model.layers.0.{n}": torch.zeros(shape) for n, shape in experts[model_type].items()}
    spec = ShardSpec(rank=0, ep=2)
    with pytest.raises(ValueError, match=re.escape(why)) as err:
        check_expert_ownership(shard_tensors(tensors, spec, layout=layout), spec, 2)
    assert "\n" not in str(err.value) and "ep=1" in str(err.value)
