"""Fresh-engine oracle: greedy tokens (and their logprobs) of a plain ``vllm.LLM`` started on each of some checkpoints.

``fresh_outputs(runs, prompts, max_new_tokens)`` runs ``python -m sync_service.verify.vllm_oracle
SPEC OUT`` in a subprocess (vLLM in process there, one engine at a time, each shut down before the
next), so the caller never holds a second vLLM engine. SPEC / OUT are JSON:
``{"runs": {key: [model_dir, dtype]}, "prompts": [[ids]], "max_new_tokens": n, "max_model_len": n}`` →
``{key: [{"tokens": [ids], "logprobs": [float]} per prompt]}``, each prompt decoded in its own
``generate`` call; ``fresh_tokens`` keeps the tokens. With ``"top_logits": true`` in SPEC the engines run
with ``logprobs_mode="raw_logits"`` and each prompt's entry is ``{"tokens", "top2": [[[id, logit], [id,
logit]] per step]}`` instead: ``fresh_decodes`` turns them into ``verify.tokens.OracleDecode`` (the
near-tie rule needs the oracle's top-2 logits). With ``"served": true`` each engine also reads back what it
serves after loading the checkpoint (``engines.vllm.served``, through weightsync's worker extension, which only
reads; nothing is applied): OUT gets ``"_served": {key: [[name, dtype, shape, xxh3_64, source, base64 bytes |
null], ...]}`` (``fresh_reference``). With ``"prompt_logprobs": [[ids]]`` each engine also scores those
sequences teacher-forced over the full vocabulary (``_logprobs: {key: [[[logprob per token id] per position]
per sequence]}``, ``engines.vllm.logprobs``). No weightsync code writes into the engines it starts.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FreshReference", "fresh_decodes", "fresh_outputs", "fresh_reference", "fresh_tokens"]


def fresh_decodes(runs: Mapping[str, str | Path], prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                  max_model_len: int = 128, timeout_s: float = 600.0) -> dict:
    """``verify.tokens.OracleDecode`` per prompt (greedy tokens and the top-2 raw logits of each step) of a
    fresh vLLM on each checkpoint of ``runs``: ``{key: [OracleDecode]}``. Raises as ``fresh_outputs``."""
    from sync_service.verify.tokens import OracleDecode

    outputs = fresh_outputs(runs, prompts, max_new_tokens, max_model_len=max_model_len, timeout_s=timeout_s,
                            top_logits=True)
    return {key: [OracleDecode.from_top2(o["tokens"], o["top2"]) for o in outs] for key, outs in outputs.items()}


@dataclass(frozen=True, slots=True)
class FreshReference:
    """What fresh vLLM engines on the oracle's checkpoints produce, per key of ``runs``.

    Attributes:
        decodes: ``verify.tokens.OracleDecode`` per prompt.
        served: rows ``[name, dtype, shape, xxh3_64, source, bytes]`` of what each serves (``engines.vllm.served``).
        logprobs: per verification sequence a float32 ``[len - 1, vocab]`` tensor of natural-log next-token
            probabilities (teacher-forced), or ``None`` when no sequences were given.
    """

    decodes: dict
    served: dict
    logprobs: dict | None = None


def fresh_reference(runs: Mapping[str, str | Path], prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                    sequences: Sequence[Sequence[int]] | None = None, max_model_len: int = 128,
                    timeout_s: float = 600.0) -> FreshReference:
    """Decodes, served digests (with bytes) and, given ``sequences``, full-vocabulary teacher-forced logprobs of a
    fresh vLLM on each checkpoint of ``runs``, one engine at a time in one subprocess. Raises as ``fresh_outputs``."""
    import base64

    import torch

    from sync_service.verify.tokens import OracleDecode

    outputs = fresh_outputs(runs, prompts, max_new_tokens, max_model_len=max_model_len, timeout_s=timeout_s,
                            top_logits=True, served=True, sequences=sequences)
    served = outputs.pop("_served")
    logprobs = outputs.pop("_logprobs", None)
    return FreshReference(
        decodes={k: [OracleDecode.from_top2(o["tokens"], o["top2"]) for o in outs] for k, outs in outputs.items()},
        served={k: [[*r[:5], None if r[5] is None else base64.b64decode(r[5])] for r in rows] for k, rows in served.items()},
        logprobs=None if logprobs is None else {k: [torch.tensor(s, dtype=torch.float32) for s in seqs]
                                                for k, seqs in logprobs.items()})


def fresh_tokens(runs: Mapping[str, str | Path], prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 max_model_len: int = 128, timeout_s: float = 600.0) -> dict[str, list[list[int]]]:
    """Greedy tokens of a fresh vLLM on each checkpoint of ``runs`` (key → directory), in the
    checkpoint's dtype (as ``FusedVLLMEngine``), for each of ``prompts``. Raises as ``fresh_outputs``."""
    outputs = fresh_outputs(runs, prompts, max_new_tokens, max_model_len=max_model_len, timeout_s=timeout_s)
    return {key: [o["tokens"] for o in outs] for key, outs in outputs.items()}


def fresh_outputs(runs: Mapping[str, str | Path], prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                  max_model_len: int = 128, timeout_s: float = 600.0,
                  top_logits: bool = False, served: bool = False,
                  sequences: Sequence[Sequence[int]] | None = None) -> dict[str, list[dict[str, list]]]:
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
            "max_new_tokens": max_new_tokens, "max_model_len": max_model_len, "top_logits": top_logits,
            "served": served, "prompt_logprobs": None if sequences is None else [list(q) for q in sequences]}
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
    read_back, sequences = bool(spec.get("served")), spec.get("prompt_logprobs")
    if read_back:
        from sync_service.engines.vllm.worker import WORKER_EXTENSION

        mode["worker_extension_cls"] = WORKER_EXTENSION
    if sequences:
        mode["max_logprobs"] = -1  # the full vocabulary
    out: dict = {}
    for key, (model_dir, dtype) in spec["runs"].items():
        llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, seed=0, max_model_len=spec["max_model_len"], **mode)
        if read_back:
            import base64

            llm.collective_rpc("ws_init")
            rows = llm.collective_rpc("ws_served", args=(None, True))[0]
            out.setdefault("_served", {})[key] = [[*r[:5], None if r[5] is None else base64.b64encode(r[5]).decode()]
                                                  for r in rows]
        if sequences:
            from sync_service.engines.vllm.logprobs import prompt_logprobs

            out.setdefault("_logprobs", {})[key] = [t.tolist() for t in prompt_logprobs(llm, sequences)]
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
