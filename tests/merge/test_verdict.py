"""The verdict of ``weightsync sync`` / ``demo`` / ``run`` (``verify.verdict``): no false "failed" at a
near-tie, no false "verified" on a wrong sync. Without Ray: the engine is an ``HFEngine`` in this process
serving a crafted state, judged by the same ``verdict`` the commands call on their engines' state and tokens.

The near-tie is built, not searched for: a bf16 base whose ``lm_head`` rows ``a`` and ``b`` are equal, so
the oracle's logits of ``a`` and ``b`` tie exactly (its greedy pick is ``a``, the lower id); the served
state moves row ``b`` by one ulp (element-wise, toward a larger logit at the first step): a state the
ulp-bounded weight check accepts, whose greedy token flips to ``b``.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from sync_service.engines.hf import HFEngine, load_causal_lm
from sync_service.synthetic import make_base
from sync_service.verify.hf import MAX_NEW_TOKENS, PROMPTS, reference
from sync_service.verify.tokens import NEAR_TIE_EPS, OracleDecode, compare_tokens, token_bound
from sync_service.verify.verdict import token_verdict, verdict

HEAD = "lm_head.weight"
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def tie(tmp_path_factory):
    """(base dir, its Reference, a, b, the lm_head input [H] of the first step of PROMPTS[0], an HFEngine)."""
    base = make_base("qwen3_moe", tmp_path_factory.mktemp("tie"), dtype="bfloat16", num_experts=4, vocab_size=64)
    model = load_causal_lm(base)
    seen = []
    model.lm_head.register_forward_hook(lambda mod, args, out: seen.append((args[0][0, -1].clone(), out[0, -1].clone())))
    with torch.no_grad():
        model(input_ids=torch.tensor([PROMPTS[0]]))
    h, logits = seen[0]
    a = int(torch.argmax(logits))  # the greedy first token of PROMPTS[0]
    b = a + 1 if a + 1 < 64 else a - 1
    state = load_file(str(base / "model.safetensors"))
    state[HEAD][b] = state[HEAD][a]
    save_file(state, str(base / "model.safetensors"), metadata={"format": "pt"})
    return base, reference(base, None, tp=1), min(a, b), max(a, b), h, _Served(model, HFEngine(model))


def _nudged(ref, row: int, h: torch.Tensor, ulps: int) -> dict[str, torch.Tensor]:
    """The oracle state with ``lm_head[row]`` moved ``ulps`` bf16 ulps per element toward a larger ``h · row``."""
    state = {n: t.clone() for n, t in ref.oracle.items()}
    w = state[HEAD][row]
    bits = w.view(torch.int16)
    up = (torch.sign(w.float()) == torch.sign(h.float())) | (w == 0)  # magnitude up where w·h grows with it
    step = torch.where(up, ulps, -ulps).to(torch.int16) * (h != 0)
    state[HEAD][row] = (bits + step).view(torch.bfloat16)
    return state


class _Served:
    def __init__(self, model, engine) -> None:
        self.model, self.generate = model, engine.generate


def _tokens(engine: _Served, state: dict[str, torch.Tensor]) -> list[list[int]]:
    """Greedy tokens of ``engine`` (the base's model) serving ``state`` (hf-fused names)."""
    with torch.no_grad():
        for name, param in engine.model.named_parameters():
            param.copy_(state[name])
    return [engine.generate(p, MAX_NEW_TOKENS).tokens for p in PROMPTS]


def test_a_near_tie_flip_verifies_and_a_wrong_sync_does_not(tie):
    _, ref, a, b, h, engine = tie
    assert ref.decodes[0].tokens[0] == a and ref.decodes[0].gaps[0] == 0.0  # an exact tie, broken toward a

    served = _nudged(ref, b, h, 1)
    tokens = _tokens(engine, served)
    assert tokens[0][0] == b, "the 1-ulp state flips the first greedy token"
    row = verdict(ref, served, tokens, 3)
    assert row["verified"] and row["weights_equal_reference"] and not row["weights_bitwise"], row
    assert row["generations_equal"] and not row["tokens_identical"], row  # token equality alone said "failed"
    assert row["token_bound"] == NEAR_TIE_EPS * torch.finfo(torch.bfloat16).eps
    assert row["near_ties"][0] == {"prompt": 0, "step": 0, "gap": 0.0, "allowed": 0.03125 * max(1.0, abs(ref.decodes[0].top_logits[0]))}
    assert all(t["gap"] == 0.0 for t in row["near_ties"])  # every flip is at the crafted tie
    assert row["weight_version"] == 3 and row["mismatched_prompts"] == []

    exact = verdict(ref, ref.oracle, _tokens(engine, ref.oracle), 3)  # bit for bit the oracle: bound 0, no flip
    assert exact["verified"] and exact["weights_bitwise"] and exact["tokens_identical"] and exact["token_bound"] == 0.0
    assert not verdict(ref, ref.oracle, tokens, 3)["verified"]  # the same flip with bitwise weights: refused

    too_far = _nudged(ref, b, h, 3)  # beyond the ulp bound: the weights say so, whatever the tokens
    wrong = verdict(ref, too_far, _tokens(engine, too_far), 3)
    assert not wrong["verified"] and not wrong["weights_equal_reference"] and HEAD in wrong["mismatched_tensors"]

    swapped = dict(ref.oracle)  # experts 0 and 1 exchanged (an expert-order bug)
    swapped[GATE_UP] = ref.oracle[GATE_UP][[1, 0, 2, 3]]
    wrong = verdict(ref, swapped, _tokens(engine, swapped), 3)
    assert not wrong["verified"] and wrong["mismatched_tensors"] == [GATE_UP], wrong


def test_the_token_rule_accepts_only_the_runner_up_within_the_bound():
    decode = OracleDecode(tokens=(5, 6, 7), runner_up=(9, 8, 1), gaps=(1.0, 0.01, 0.0), top_logits=(2.0, 4.0, 1.0))
    bound = token_bound(torch.bfloat16, bitwise=False)  # 4 · 2^-7 relative: 0.125 at |logit| 4
    assert compare_tokens([decode], [[5, 6, 7]], bound).identical
    assert compare_tokens([decode], [[5, 8, 3]], bound).near_ties[0].step == 1  # the rest after a flip is not compared
    assert compare_tokens([decode], [[9, 6, 7]], bound).mismatched == (0,)  # a flip at a gap of 1.0: a real difference
    assert compare_tokens([decode], [[5, 2, 7]], bound).mismatched == (0,)  # not the runner-up
    assert compare_tokens([decode], [[5, 6]], bound).mismatched == (0,)  # shorter
    assert not compare_tokens([decode], [[5, 8, 3]], token_bound("bfloat16", bitwise=True)).ok
    # the vLLM paths: the bound follows the push's accumulation dtype (float64: the oracle's cast, bit for bit)
    flipped = dict(expected_version=2, dtype="bfloat16")
    assert token_verdict([decode], [[5, 8, 3]], 2, accumulate_dtype="float32", **flipped)["verified"]
    assert not token_verdict([decode], [[5, 8, 3]], 2, accumulate_dtype="float64", **flipped)["verified"]
    assert not token_verdict([decode], [[5, 6, 7]], 1, accumulate_dtype="float64", **flipped)["verified"]
