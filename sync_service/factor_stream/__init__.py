"""Factor streaming: ship LoRA factors, merge on the receiver, bitwise equal to the trainer-side merge.

See docs/scale.md and the module docstrings:
- ``choose``: ``FactorPolicy`` (``merged`` | ``factors`` | ``auto``), per-tensor ``choose``.
- ``recipes``: LoRA terms ↔ recipe blocks (``protocols.recipe``) on the wire.
- ``plan``: factor plans (pristine bases, recipes, merged rest), validation, delta names.
- ``source``: trainer side ``FactorSource`` (a ``WeightSource``) and ``FactorLedger`` (delta digests).
- ``receiver``: ``FactorEngine`` (an ``EngineAdapter`` wrapper) with resident pristine copies.
- ``rx_fp8``: a target the engine serves in block FP8: merged over the trainers' base and quantized as they would.
- ``local``: the whole path in one process (``LocalSync``; its bench row is ``sync_service/bench/factors.py``).
"""

from sync_service.factor_stream.choose import MODES, FactorChoice, FactorPolicy, TargetCost, choose
from sync_service.factor_stream.receiver import FactorEngine, FactorReceiverConfig, FactorStateError
from sync_service.factor_stream.source import AdapterStructureError, FactorLedger, FactorSource

__all__ = ["MODES", "AdapterStructureError", "FactorChoice", "FactorEngine", "FactorLedger", "FactorPolicy",
           "FactorReceiverConfig", "FactorSource", "FactorStateError", "TargetCost", "choose"]
