"""Adapters that touch the vocabulary: PEFT trainable tokens (``trainable_token_indices``: saved rows
replace the base's, ``W.index_copy``) and a vocabulary resized before training (the adapter holds the
resized embeddings). Each is compared with PEFT's float64 ``merge_and_unload`` cast once
(``verify.peft_oracle``, which resizes the base first as PEFT's docs say); the vocabulary tensors bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from protocols.params import ParamMeta
from sync_service.factor_stream.plan import target_costs
from sync_service.merge.adapter import adapter_from_state_dict, load_adapter
from sync_service.merge.base import SafetensorsBase
from sync_service.merge.errors import MergeError
from sync_service.merge.export import merge_checkpoint
from sync_service.merge.source import MergeConfig, MergedSource
from sync_service.synthetic import make_adapter
from sync_service.verify.peft_oracle import checkpoint_state, compare_state, peft_merged_state

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
TOKENS = {
    "list": [3, 7, 60],
    "dict": {"embed_tokens": [3, 7], "lm_head": [5, 63]},  # on a tied base: one tensor, rows of both
}


def _tokens_adapter(base_factory, tmp_path, tied: bool, indices):
    base_dir = base_factory("qwen3_moe", "bfloat16", tie_word_embeddings=tied)
    adapter = make_adapter("qwen3_moe", base_dir, tmp_path / "lora", kind="dense", target_modules=["q_proj"],
                           trainable_token_indices=indices)
    return base_dir, adapter


def _assert_equals_peft(got: dict, want: dict, base: dict, vocab_changed: set[str]) -> None:
    """Same names; the LoRA tensors within the fp32 merge's rounding; the vocabulary tensors bitwise,
    and the rows the adapter changed really differ from the base's (the test is not vacuous)."""
    check = compare_state(got, want)
    assert check.ok, check
    for name in vocab_changed:
        assert torch.equal(got[name], want[name]), name
        assert got[name].shape != base[name].shape or not torch.equal(got[name], base[name]), name


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("form", sorted(TOKENS))
def test_trainable_tokens_merge_equals_peft(base_factory, tmp_path, tied, form):
    base_dir, adapter = _tokens_adapter(base_factory, tmp_path, tied, TOKENS[form])
    assert any(k.endswith("token_adapter.trainable_tokens_delta") for k in load_file(adapter / "adapter_model.safetensors"))

    merge_checkpoint(base_dir, adapter, tmp_path / "merged", progress=False)

    want, base = peft_merged_state(base_dir, adapter), checkpoint_state(base_dir)
    changed = {EMBED} if tied or form == "list" else {EMBED, HEAD}
    _assert_equals_peft(checkpoint_state(tmp_path / "merged"), want, base, changed)
    rows = {i for ids in (TOKENS[form].values() if form == "dict" else [TOKENS[form]]) for i in ids}
    if tied:  # both names write the one shared tensor, exactly those rows
        assert set((want[EMBED] != base[EMBED]).any(1).nonzero().flatten().tolist()) == rows
        assert json.loads((tmp_path / "merged" / "config.json").read_text())["tie_word_embeddings"]


def test_trainable_tokens_trained_twice_on_a_tied_pair_are_refused(base_factory, tmp_path):
    """PEFT's merge of overlapping ids on a tied pair depends on module order (the last wins); refused."""
    base_dir, adapter_dir = _tokens_adapter(base_factory, tmp_path, True, {"embed_tokens": [3, 7], "lm_head": [7]})
    base = SafetensorsBase(base_dir)
    with pytest.raises(MergeError, match=r"trainable_token_indices rows \[7\] of model.embed_tokens.weight are trained twice"):
        load_adapter(adapter_dir, base.layout, base.metas(), tied_aliases=base.tied_aliases)


def test_trainable_tokens_fill_row_boxes(base_factory, tmp_path):
    """Row slices (as a TP/FSDP rank owns them) and a column slice: each box gets exactly its rows."""
    base_dir, adapter_dir = _tokens_adapter(base_factory, tmp_path, False, TOKENS["dict"])
    base = SafetensorsBase(base_dir)
    adapter = load_adapter(adapter_dir, base.layout, base.metas(), tied_aliases=base.tied_aliases)
    assert {EMBED, HEAD} <= adapter.changed_names()
    vocab, hidden = next(m.shape for m in base.metas() if m.name == EMBED)
    boxes = [((0, 4), (0, hidden)), ((4, 6), (0, hidden)), ((6, 40), (0, hidden)), ((40, vocab), (0, hidden)),
             ((4, 6), (3, 11)), ((6, 12), (3, 11))]
    owned = [ParamMeta(name, "bfloat16", (vocab, hidden), box) for name in (EMBED, HEAD) for box in boxes[:4]]
    source = MergedSource(base, adapter, config=MergeConfig(check_finite=True), owned=owned)
    want = peft_merged_state(base_dir, adapter_dir)
    for name in (EMBED, HEAD):
        for box in boxes:
            out = torch.empty(box[0][1] - box[0][0], box[1][1] - box[1][0], dtype=torch.bfloat16)
            source.fill(name, box, out)
            assert torch.equal(out, want[name][box[0][0]:box[0][1], box[1][0]:box[1][1]]), (name, box)
    assert not source.touches(EMBED, ((8, 40), (0, hidden))) and source.touches(HEAD, ((40, vocab), (0, hidden)))
    costs = {c.name: c.why_not for c in target_costs(adapter, base.metas(), {})}
    assert "trainable_token_indices" in costs[EMBED]  # never factor-streamed: carried merged


def test_trainable_tokens_snapshot_and_refresh(base_factory, tmp_path):
    """A live trainer's new token rows reach the merge through ``refresh``; a snapshot keeps its values."""
    base_dir, adapter_dir = _tokens_adapter(base_factory, tmp_path, False, TOKENS["list"])
    base = SafetensorsBase(base_dir)
    from peft import PeftConfig

    state = load_file(adapter_dir / "adapter_model.safetensors")
    adapter = adapter_from_state_dict(PeftConfig.from_pretrained(str(adapter_dir)), state, base.layout, base.metas())
    frozen = adapter.snapshot()
    key = next(k for k in state if k.endswith("trainable_tokens_delta"))
    state[key].add_(1.0)
    adapter.refresh()
    box = ((3, 4), (0, state[key].shape[1]))
    now, before = (torch.empty(1, box[1][1], dtype=torch.bfloat16) for _ in range(2))
    MergedSource(base, adapter, config=MergeConfig()).fill(EMBED, box, now)
    MergedSource(base, frozen, config=MergeConfig()).fill(EMBED, box, before)
    assert torch.equal(now[0], state[key][0].to(torch.bfloat16))
    assert torch.equal(before[0], (state[key][0] - 1.0).to(torch.bfloat16))


RESIZED = {
    "lora_on_embeddings": dict(target_modules=["q_proj", "embed_tokens", "lm_head"], save_embedding_layers=True),
    "modules_to_save": dict(target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"]),
}


@pytest.mark.parametrize("kind", sorted(RESIZED))
def test_resized_vocabulary_merges_as_peft(base_factory, tmp_path, kind):
    base_dir = base_factory("qwen3_moe", "float32")
    adapter = make_adapter("qwen3_moe", base_dir, tmp_path / "lora", kind="dense", vocab_size=70, **RESIZED[kind])

    merge_checkpoint(base_dir, adapter, tmp_path / "merged", progress=False)

    want, base, got = peft_merged_state(base_dir, adapter), checkpoint_state(base_dir), checkpoint_state(tmp_path / "merged")
    assert want[EMBED].shape[0] == 70 and base[EMBED].shape[0] == 64
    _assert_equals_peft(got, want, base, {EMBED, HEAD} if kind == "modules_to_save" else set())
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["vocab_size"] == 70


def test_resized_vocabulary_is_refused_for_sync(base_factory, tmp_path):
    base_dir = base_factory("qwen3_moe", "float32")
    adapter = make_adapter("qwen3_moe", base_dir, tmp_path / "lora", kind="dense", vocab_size=70,
                           **RESIZED["lora_on_embeddings"])
    base = SafetensorsBase(base_dir)
    with pytest.raises(MergeError, match=r"(embed_tokens|lm_head)\.weight has a vocabulary of 70 rows in the adapter "
                                         r"and 64 in the base.*weightsync merge.*start the engines from the merged"):
        load_adapter(adapter, base.layout, base.metas(), tied_aliases=base.tied_aliases)
