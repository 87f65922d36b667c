"""``sync_service/megatron/layouts.py``'s table is the installed Megatron-Bridge's Qwen3-MoE mapping: every row of
``Qwen3MoEBridge().mapping_registry()`` (read in a spawned process: ``megatron.bridge`` imports only after the CPU
launcher's patches) is a row of the table with the same HF names in the same order (q, k, v; gate, up)."""

from __future__ import annotations

import json

from sync_service.megatron.layouts import EXPERT_ROWS, LAYER_ROWS, TOP_ROWS
from tests.megatron.ranks import bridge_mapping, run_ranks


def _ours() -> dict[str, list[str]]:
    rows = {r.megatron: list(r.hf) for r in TOP_ROWS}
    rows |= {f"decoder.layers.*.{r.megatron}": [f"model.layers.*.{n}" for n in r.hf] for r in LAYER_ROWS}
    rows |= {f"decoder.layers.*.mlp.experts.local_experts.*.{r.megatron}": [f"model.layers.*.mlp.experts.*.{n}"
                                                                            for n in r.hf] for r in EXPERT_ROWS}
    return rows


def test_table_is_the_bridges_qwen3_moe_mapping(tmp_path):
    run_ranks(bridge_mapping, 1, str(tmp_path / "map.json"))
    bridge = {m: hf for m, hf in json.loads((tmp_path / "map.json").read_text())}
    grouped = {m for m in bridge if m.startswith("decoder.layers.*.mlp.experts.linear_fc")}  # TE grouped GEMM
    assert {m.removesuffix("*") for m in grouped} == {"decoder.layers.*.mlp.experts.linear_fc1.weight",
                                                     "decoder.layers.*.mlp.experts.linear_fc2.weight"}
    ours = _ours()
    missing = {m: hf for m, hf in bridge.items() if m not in grouped and ours.get(m) != hf}
    assert not missing, missing
    for m in grouped:  # the grouped GEMM rows name the same HF tensors as the SequentialMLP rows
        sequential = m.removesuffix("*").replace("mlp.experts.", "mlp.experts.local_experts.*.")
        assert ours[sequential] == bridge[m]
