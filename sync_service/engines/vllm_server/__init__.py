"""A running vLLM server as a weightsync rollout engine, through vLLM's weight-transfer API.

- ``backend``: ``WeightsyncTransferEngine``, the backend vLLM runs in its worker (imports vLLM);
  ``plugin.register`` makes it known to vLLM (``vllm.general_plugins`` entry point).
- ``staging``: the worker's ``EngineAdapter``, the in-process vLLM engine's logic (``engines/vllm``).
- ``engine``: ``VLLMServerEngine``, the coordinator's handle on a server URL (HTTP only);
  ``client``: its HTTP calls; ``wire``: what the two sides exchange.
- ``launch``: ``LocalServer``, a server subprocess on this machine (demo, tests).

See ``docs/vllm.md`` ("Updating a running vLLM server"). Importing this package does not import vLLM.
"""

from sync_service.engines.vllm_server.client import (
    ServerError, ServerRequestError, ServerSetupError, ServerUnreachableError,
)
from sync_service.engines.vllm_server.engine import ServerGeneration, VLLMServerConfig, VLLMServerEngine

__all__ = ["ServerError", "ServerGeneration", "ServerRequestError", "ServerSetupError", "ServerUnreachableError",
           "VLLMServerConfig", "VLLMServerEngine"]
