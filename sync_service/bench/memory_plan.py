"""Whether a bench row fits this machine's memory before it starts: a row that would not is recorded as skipped
with its reason (``report["skipped"]``) instead of being killed by the kernel or Ray's memory monitor halfway
(which took the whole ``weightsync bench`` down with it on a 24 GB host at ``live_hsdp`` 2x).

``ROW_MEMORY``: row kind -> (model copies, processes). A row needs about ``copies`` x the bf16 model bytes
held at once over all its processes (trainer shards, engine served + staging copies, a rank loading the
base) plus ``PROCESS_BYTES`` per process (a Ray worker with torch and transformers imported); measured at 1x
on this 2-core, 24 GB machine (2026-12-05: 4 HSDP ranks peaked at 3.0 + 3 x 1.1 GiB of a 1.07 GB base while
loading; each had reached ~2.5 GiB when every rank loaded the whole base), rounded up. Rows without an entry are
small next to these and always run.
"""

from __future__ import annotations

__all__ = ["PROCESS_BYTES", "ROW_MEMORY", "memory_needed", "skip_reason"]

PROCESS_BYTES = 700 << 20
"""Resident bytes of one Ray actor process with torch, transformers and PEFT imported, before any model."""

ROW_MEMORY: dict[str, tuple[float, int]] = {
    "ours": (3.0, 3),           # delta + full: the engine's served + staging copies, the trainers' shards; not
                                # counted: the 4-engine row's 3 more engines (~9 GB at 1x, --fanout-max-size 1)
    "live_fsdp2": (4.0, 3),     # rank 0 reads the base (1) and keeps its shard (0.5), rank 1 its shard; engine 2
    "live_hsdp": (4.5, 5),      # rank 0: 1 + 0.5, three ranks 0.5 each; engine 2; 4 ranks + engine
    "live_fsdp2_tp": (6.0, 5),  # every rank reads the whole base (TP's parallelize_module scatters from it); engine 2
    "live_fsdp2_ep": (6.0, 5),  # every ep rank reads the whole base before sharding it (example_ep); engine 2
    "gather": (5.0, 3),         # the merged state dict in a trainer, the object store, the engine's copy + params
}


def memory_needed(kind: str, model_bytes: int) -> int | None:
    """Bytes row ``kind`` needs at once for a model of ``model_bytes`` (bf16), None for rows not in ``ROW_MEMORY``."""
    if kind not in ROW_MEMORY:
        return None
    copies, processes = ROW_MEMORY[kind]
    return int(copies * model_bytes + processes * PROCESS_BYTES)


def skip_reason(kind: str, model_bytes: int, available_bytes: int | None = None) -> str | None:
    """Why row ``kind`` cannot run now (``available_bytes``, default psutil's available memory), or None if it fits."""
    need = memory_needed(kind, model_bytes)
    if need is None:
        return None
    if available_bytes is None:
        import psutil

        available_bytes = psutil.virtual_memory().available
    if need <= available_bytes:
        return None
    return (f"needs ~{need / 2**30:.1f} GiB ({ROW_MEMORY[kind][0]:g} x the {model_bytes / 2**30:.2f} GiB model + "
            f"{ROW_MEMORY[kind][1]} processes), {available_bytes / 2**30:.1f} GiB available; run it on a larger machine "
            f"or lower its --*-max-size")
