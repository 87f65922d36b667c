"""Ratios against the goals, the JSON document, the markdown table and the PNG plot of a bench run."""

from __future__ import annotations

import json
from pathlib import Path

from sync_service.bench.goals import FLOOR_COLUMN, STAGE_COLUMN, GoalTable, goals, markdown, number, ratios
from sync_service.bench.link_report import build_links
from sync_service.bench.live import live_goals
from sync_service.bench.rows import LINK_ROW_KINDS, ROW_KINDS, BenchConfig, Row

__all__ = ["GOALS", "build_report", "markdown_table", "write_plot"]

GOALS: GoalTable = {
    "delta_vs_floor": (("delta", "median_s"), ("floor", "median_s"), ("<=", 2.0)),
    "delta_vs_full": (("delta", "median_s"), ("full", "median_s"), ("<=", 1.0)),
    "disk_vs_delta": (("disk", "median_s"), ("delta", "median_s"), (">=", 10.0)),
    "gather_vs_delta": (("gather", "median_s"), ("delta", "median_s"), (">=", 3.0)),
    "fanout4_vs_fanout1": (("delta_fanout4", "median_s"), ("delta", "median_s"), ("<=", 1.5)),
    "vllm_server_vs_vllm": (("vllm_server_delta", "median_s"), ("vllm_delta", "median_s"), ("<=", 1.3)),
    "vllm_server_disk_vs_delta": (("vllm_server_disk", "median_s"), ("vllm_server_delta", "median_s"), (">=", 10.0)),
}
"""Ratios of median seconds (numerator row / denominator row) and their goals (``goals.GoalTable``)."""


def build_report(rows: list[Row], cfg: BenchConfig, *, factor_bytes: dict[int, int], factor_streaming: dict,
                 machine: dict, link_rows: list[Row] = ()) -> dict:
    """The JSON document (see docs/benchmarks.md "End to end" and "Across hosts"). Ratios are taken at
    the smallest size (where every row runs); ``ratios_by_size`` has them wherever both rows ran.
    ``link_rows`` (``Row.link`` set) become ``"links"`` (``link_report.build_links``)."""
    sizes = sorted(set(cfg.sizes))
    ref = sizes[0]
    at_ref = ratios(rows, ref, GOALS)
    all_goals = goals(at_ref, GOALS)

    def extra(kind: str, kinds: tuple[str, ...] | None = None) -> dict[str, int]:
        return {str(s): max(r.trainer_peak_extra_bytes for r in rows if r.size == s and r.kind in (kinds or (kind,)))
                for s in sizes if any(r.size == s and r.kind in (kinds or (kind,)) for r in rows)}

    ours_extra = extra("delta", ("delta", "full"))
    budget = {str(s): 2 * cfg.bucket_bytes + factor_bytes[s] for s in sizes if s in factor_bytes}
    all_goals["trainer_memory"] = {
        "goal": "trainer peak extra <= 2 x bucket + factors, flat in model size",
        "value": ours_extra, "budget": budget,
        "met": all(ours_extra[k] <= budget[k] for k in ours_extra) if ours_extra else None}
    all_goals.update(live_goals(rows, cfg.bucket_bytes))
    floor_s = {r.size: r.median_s for r in rows if r.kind == "floor"}
    return {
        "command": "weightsync bench " + " ".join(machine.get("argv", [])),
        "machine": machine,
        "config": {"sizes": sizes, "bucket_bytes": cfg.bucket_bytes, "repeats": cfg.repeats, "quick": cfg.quick,
                   "ep": cfg.ep, "fanout": cfg.fanout, "full_max_size": cfg.full_max_size, "fanout_max_size": cfg.fanout_max_size,
                   "gather_max_size": cfg.gather_max_size, "disk_max_size": cfg.disk_max_size,
                   "live_max_size": cfg.live_max_size, "live_mesh_max_size": cfg.live_mesh_max_size,
                   "fp8_max_size": cfg.fp8_max_size, "vllm": cfg.vllm, "vllm_max_size": cfg.vllm_max_size,
                   "links": list(cfg.links), "link_max_size": cfg.link_max_size, "link_transport": cfg.link_transport},
        "reference_size": ref,
        "ratios": at_ref,
        "ratios_by_size": {str(s): ratios(rows, s, GOALS) for s in sizes},
        "goals": all_goals,
        "trainer_peak_extra_bytes": ours_extra,
        "trainer_budget_bytes": budget,
        "gather_trainer_peak_extra_bytes": extra("gather"),
        "disk_trainer_peak_extra_bytes": extra("disk"),
        "bucket_bytes": cfg.bucket_bytes,
        "factor_bytes": {str(s): factor_bytes[s] for s in sizes if s in factor_bytes},
        "factor_streaming": factor_streaming,
        "row_kinds": ROW_KINDS,
        "rows": [r.to_json(floor_s.get(r.size)) for r in rows],
        "link_row_kinds": LINK_ROW_KINDS,
        "links": build_links(list(link_rows)),
    }


COLUMNS = (("size", "---:", lambda r: f"{r['size']}x"), ("row", "---", lambda r: r["kind"]),
           ("engines", "---:", lambda r: str(r["engines"])), ("GB", "---:", number("bytes", 1e9)),
           ("median s", "---:", number("median_s")), ("GB/s", "---:", number("gb_per_s")), FLOOR_COLUMN,
           ("trainer peak RSS GB", "---:", number("trainer_peak_rss_bytes", 1e9, ".2f")),
           ("trainer extra MB (allocated / RSS)", "---:", lambda r: f"{r['trainer_peak_extra_bytes'] / 1e6:.0f} / "
                                                                    f"{r.get('trainer_peak_extra_rss_bytes', 0) / 1e6:.0f}"),
           ("engine peak RSS GB", "---:", number("engine_peak_rss_bytes", 1e9, ".2f")), STAGE_COLUMN)


def markdown_table(report: dict) -> str:
    """One line per row and size: seconds, GB/s, x floor, memory, stage seconds."""
    return markdown(COLUMNS, report["rows"])


def write_plot(report: dict, path: Path) -> None:
    """Two panels (matplotlib Agg): median seconds per row vs model GB; trainer peak extra memory vs
    model GB (ours, full-gather, disk) with the ``2 x bucket + factors`` budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=80)
    for kind in ROW_KINDS:
        pts = sorted((r["model_bytes"] / 1e9, r["median_s"]) for r in report["rows"] if r["kind"] == kind)
        if pts:
            ax_t.plot(*zip(*pts), marker="o", label=kind)
    ax_t.set(xlabel="model GB (bf16)", ylabel="seconds per sync (median)", yscale="log", title="time")
    ax_t.legend(fontsize=7)
    for kind, label in (("delta", "ours (delta/full)"), ("gather", "full-gather"), ("disk", "disk")):
        key = {"delta": "trainer_peak_extra_bytes", "gather": "gather_trainer_peak_extra_bytes",
               "disk": "disk_trainer_peak_extra_bytes"}[kind]
        pts = sorted((_model_gb(report, s), v / 1e9) for s, v in report[key].items())
        if pts:
            ax_m.plot(*zip(*pts), marker="o", label=label)
    pts = sorted((_model_gb(report, s), v / 1e9) for s, v in report["trainer_budget_bytes"].items())
    ax_m.plot(*zip(*pts), linestyle="--", color="gray", label="2 x bucket + factors")
    ax_m.set(xlabel="model GB (bf16)", ylabel="trainer peak extra allocated (anon + shm), GB", title="memory (one trainer process)")
    ax_m.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _model_gb(report: dict, size: str) -> float:
    """Model GB of ``size`` (NaN when no row ran there, e.g. a size that failed: matplotlib skips it)."""
    return next((r["model_bytes"] for r in report["rows"] if str(r["size"]) == size), float("nan")) / 1e9


def write_json(report: dict, path: Path) -> None:
    path.write_text(json.dumps(report, indent=1) + "\n")
