"""Megatron-Core trainers and their checkpoints: Megatron-Bridge LoRA read from a ``torch_dist`` checkpoint
(``weightsync merge --base <torch_dist dir>``), layouts mapped to the HF model the Megatron model was
converted from (``layouts.py``: the installed Megatron-Bridge's mapping for the family, as a table)."""
