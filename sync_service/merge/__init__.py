"""Exact LoRA → fused-MoE merge core.

Layers (each a small module):
``layouts`` (model-family tables) → ``targets`` (namings: ``hf-fused``, ``hf``, ...) →
``base`` (``BaseProvider``: base tensors in hf-fused naming) → ``adapter`` (``LoraAdapter``:
PEFT adapters normalised to low-rank terms in hf-fused coordinates) → ``source``
(``MergedSource``: a ``WeightSource`` that merges any box out of place) → ``export``
(``merge_checkpoint``: stream a merged checkpoint to safetensors; the ``weightsync merge`` command is
``sync_service/entrypoints/merge_cli.py``).
"""

from sync_service.merge.errors import MergeError

__all__ = ["MergeError"]
