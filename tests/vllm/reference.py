"""Fresh-engine oracle, run as a subprocess: ``python -m tests.vllm.reference SPEC OUT``.

SPEC (JSON): ``{"runs": {key: {"model_dir", "dtype"}}, "batches": [[prompt ids, ...], ...],
"max_new_tokens", "max_model_len", "block_size"}``. For each run a plain ``vllm.LLM`` (no weightsync
code) is started on the checkpoint, each batch is decoded greedily in its own ``generate`` call, and
the engine is shut down before the next run (one engine at a time). OUT (JSON): ``{key: [[{"tokens",
"logprobs"} per prompt] per batch]}``.
"""

from __future__ import annotations

import gc
import json
import sys


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"], logprobs=0)
    out: dict = {}
    for key, run_spec in spec["runs"].items():
        llm = LLM(
            model=run_spec["model_dir"], dtype=run_spec["dtype"], enforce_eager=True, seed=0,
            max_model_len=spec["max_model_len"], block_size=spec["block_size"], kv_cache_memory_bytes=256 << 20,
        )
        batches = []
        for batch in spec["batches"]:
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            batches.append([
                {"tokens": list(o.outputs[0].token_ids),
                 "logprobs": [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]}
                for o in outs
            ])
        out[key] = batches
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        result = run(json.load(f))
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
