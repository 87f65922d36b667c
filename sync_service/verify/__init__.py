"""Verification: the independent oracles and the commands' "verified" verdicts, shared by the commands and the tests.

``peft_oracle`` (PEFT's own ``merge_and_unload`` in float64, cast once, and the ulp-bounded comparison),
``vllm_oracle`` (greedy tokens and logprobs of a freshly loaded ``vllm.LLM``, in a subprocess), ``hf`` (the
per-engine verdicts of ``weightsync sync`` / ``demo`` / ``run``). Nothing here is on the sync path.
"""
