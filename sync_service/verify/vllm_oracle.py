"""Fresh-engine oracle: greedy tokens (and their logprobs) of a plain ``vllm.LLM`` started on each of some checkpoints.

``fresh_outputs(runs, prompts, max_new_tokens)`` runs ``python -m sync_service.verify.vllm_oracle
SPEC OUT`` in a subprocess (vLLM in process there, one engine at a time, each shut down before the
next), so the caller never holds a second vLLM engine. SPEC / OUT are JSON:
``{"runs": {key: [model_dir, dtype]}, "prompts": [[ids]], "max_new_tokens": n, "max_model_len": n}`` →
``{key: [{"tokens": [ids], "logprobs": [float]} per prompt]}``, each prompt decoded in its own
``generate`` call; ``fresh_tokens`` keeps the tokens. With ``"top_logits": true`` in SPEC the engines run
with ``logprobs_mode="raw_logits"`` and each prompt's entry is ``{"tokens", "top2": [[[id, logit], [id,
logit]] per step]}`` instead: ``fresh_decodes`` turns them into ``verify.tokens.OracleDecode`` (the
near-tie rule needs the oracle's top-2 logits). No weightsync code touches the engines it starts.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["fresh_decodes", "fresh_outputs", "fresh_tokens"]


def fresh_decodes(runs: Mapping[str, str | Path], prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                  max_model_len: int = 128, timeout_s: float = 600.0) -> dict:
    """``verify.tokens.OracleDecode`` per prompt (greedy tokens and the top-2 raw logits of each step) of a
    fresh vLLM on each checkpoint of ``runs``: ``{key: [OracleDecode]}``. Raises as ``fresh_outputs``."""
    from sync_service.verify.tokens import OracleDecode

    outputs = fresh_outputs(runs, prompts, max_new_tokens, max_model_len=max_model_len, timeout_s=timeout_s,
                            top_logits=True)
    return {key: [OracleDecode.from_top2(o["tokens"], o["top2"]) for o in outs] for key, outs in outputs.items()}


def fresh_tokens(runs: Mapping[str, str | Path], prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 max_model_len: int = 128, timeout_s: float = 600.0) -> dict[str, list[list[int]]]:
    """Greedy tokens of a fresh vLLM on each checkpoint of ``runs`` (key → directory), in the
    checkpoint's dtype (as ``FusedVLLMEngine``), for each of ``prompts``. Raises as ``fresh_outputs``."""
    outputs = fresh_outputs(runs, prompts, max_new_tokens, max_model_len=max_model_len, timeout_s=timeout_s)
    return {key: [o["tokens"] for o in outs] for key, outs in outputs.items()}


def fresh_outputs(runs: Mapping[str, str | Path], prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                  max_model_len: int = 128, timeout_s: float = 600.0,
                  top_logits: bool = False) -> dict[str, list[dict[str, list]]]:
    """Greedy ``{"tokens": [ids], "logprobs": [natural-log probability of each token]}`` per prompt of
    a fresh vLLM on each checkpoint of ``runs`` (key → directory), in the checkpoint's dtype
    (``top_logits``: ``{"tokens", "top2"}`` instead, module docstring).

    Raises:
        RuntimeError: the subprocess failed (its stderr tail in the message);
        subprocess.TimeoutExpired: it ran longer than ``timeout_s`` seconds.
    """
    from sync_service.engines.vllm.config import VLLM_ENV
    from sync_service.engines.vllm.fused import checkpoint_dtype

    spec = {"runs": {k: [str(v), checkpoint_dtype(v)] for k, v in runs.items()}, "prompts": [list(p) for p in prompts],
            "max_new_tokens": max_new_tokens, "max_model_len": max_model_len, "top_logits": top_logits}
    with tempfile.TemporaryDirectory(prefix="wsoracle") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run([sys.executable, "-m", "sync_service.verify.vllm_oracle", str(spec_path), str(out_path)],
                              env={**os.environ, **VLLM_ENV}, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM oracle failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out_path.read_text())


def _run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    top = bool(spec.get("top_logits"))
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"], logprobs=2 if top else 0)
    mode = {"logprobs_mode": "raw_logits"} if top else {}
    out = {}
    for key, (model_dir, dtype) in spec["runs"].items():
        llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, seed=0, max_model_len=spec["max_model_len"], **mode)
        out[key] = []
        for prompt in spec["prompts"]:  # one call per prompt, as RolloutEngine.generate
            gen = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
            out[key].append({"tokens": list(gen.token_ids), "top2": [_top2(lp) for lp in gen.logprobs]} if top else
                            {"tokens": list(gen.token_ids),
                             "logprobs": [lp[t].logprob for t, lp in zip(gen.token_ids, gen.logprobs)]})
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return out


def _top2(step: dict) -> list[list]:
    """The two best ``[id, raw logit]`` of one step's ``{id: Logprob}`` (best first; ties: lower id first, as argmax)."""
    best = sorted(step.items(), key=lambda kv: (-kv[1].logprob, kv[0]))[:2]
    return [[int(t), float(lp.logprob)] for t, lp in best]


if __name__ == "__main__":  # started by fresh_outputs with VLLM_ENV
    with open(sys.argv[1]) as f:
        result = _run(json.load(f))
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
