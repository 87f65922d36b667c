"""``FusedVLLMEngine``'s naming bridge, without vLLM: hf-fused boxes in → ``hf`` pieces out.

The wrapped engine is a ``MemoryEngine`` holding the checkpoint in ``hf`` naming (the table a
``VLLMEngine`` reports); hf-fused tensors are pushed in uneven boxes that straddle experts and the
gate/up boundary, and every ``hf`` tensor must then equal the merge core's ``hf`` export of them.
"""

from __future__ import annotations

import pytest
import torch

from protocols.params import full_box
from sync_service.engines.memory import MemoryEngine
from sync_service.engines.vllm.fused import FusedVLLMEngine
from sync_service.merge.base import SafetensorsBase
from sync_service.merge.source import MergeConfig, MergedSource
from sync_service.synthetic import make_base


def test_fused_boxes_land_in_hf_pieces(tmp_path) -> None:
    base_dir = make_base("qwen3_moe", tmp_path / "base", hidden=16, intermediate=8, num_experts=4)
    base = SafetensorsBase(base_dir)
    hf = dict(MergedSource(base, None, config=MergeConfig()).iter_tensors("hf"))
    inner = MemoryEngine({n: torch.zeros_like(t) for n, t in hf.items()})
    engine = FusedVLLMEngine(inner, str(base_dir))

    metas = {m.name: m for m in engine.param_metas()}
    assert metas.keys() == {m.name for m in base.metas()}
    assert metas["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 16, 16)
    fused = {n: base.read(n, full_box(m.shape)) + 1.0 for n, m in metas.items()}  # values unlike the zeros
    engine.begin_update(1, list(fused))
    for name, t in fused.items():
        if t.dim() == 3:  # experts [0, 1) whole, then [1, 4) in row halves split off-centre (gate/up straddled)
            engine.apply(name, ((0, 1), (0, t.shape[1]), (0, t.shape[2])), t[0:1])
            cut = t.shape[1] // 2 + 1
            engine.apply(name, ((1, 4), (0, cut), (0, t.shape[2])), t[1:4, :cut])
            engine.apply(name, ((1, 4), (cut, t.shape[1]), (0, t.shape[2])), t[1:4, cut:])
        else:
            engine.apply(name, full_box(tuple(t.shape)), t)
    engine.finish_update()
    engine.commit(1)
    got = inner.state_dict()
    assert set(got) == set(hf)
    for name, t in hf.items():
        assert torch.equal(got[name], t + 1.0), name
    assert engine.weight_version() == 1


def test_unknown_name_and_bad_box_are_refused(tmp_path) -> None:
    base_dir = make_base("qwen3_moe", tmp_path / "base", hidden=16, intermediate=8, num_experts=4)
    hf = dict(MergedSource(SafetensorsBase(base_dir), None, config=MergeConfig()).iter_tensors("hf"))
    engine = FusedVLLMEngine(MemoryEngine(hf), str(base_dir))
    with pytest.raises(KeyError, match="model.layers.0.mlp.experts.0.gate_proj.weight"):
        engine.begin_update(1, ["model.layers.0.mlp.experts.0.gate_proj.weight"])
    name = "model.layers.0.mlp.experts.down_proj"
    engine.begin_update(1, [name])
    with pytest.raises(ValueError, match="outside"):
        engine.apply(name, ((0, 5), (0, 16), (0, 8)), torch.zeros(5, 16, 8))
