"""The ``"links"`` part of a bench report: per link rate its rows, ratios and goals, and its table."""

from __future__ import annotations

from sync_service.bench.rows import Row
from sync_service.coordinator.metrics import STAGES

__all__ = ["LINK_GOALS", "build_links", "goal", "links_table"]

# ratio -> ((numerator row, field), (denominator row, field), goal as (op, bound)); names as the one-host ratios
LINK_GOALS = {
    "delta_vs_floor": (("delta", "median_s"), ("floor", "median_s"), ("<=", 1.2)),
    "factors_bytes_share": (("factors", "wire_bytes"), ("delta", "wire_bytes"), ("<=", 0.1)),
    "factors_vs_delta_s": (("factors", "median_s"), ("delta", "median_s"), ("<=", 0.2)),
    "fanout2_vs_fanout1": (("delta_fanout2", "median_s"), ("delta", "median_s"), ("<=", 1.2)),
    "disk_vs_delta": (("disk", "median_s"), ("delta", "median_s"), (">=", 10.0)),
}


def goal(value: float | None, op: str, bound: float) -> dict:
    """``{"goal": "<= 1.2", "value": value, "met": True | False | None}`` (``None``: not run)."""
    met = None if value is None else (value <= bound if op == "<=" else value >= bound)
    return {"goal": f"{op} {bound}", "value": value, "met": met}


def _ratios(rows: list[Row], size: int) -> dict[str, float | None]:
    by = {r.kind: r for r in rows if r.size == size}
    out = {}
    for name, ((num, a), (den, b), _) in LINK_GOALS.items():
        x, y = by.get(num), by.get(den)
        out[name] = getattr(x, a) / getattr(y, b) if x and y and getattr(y, b) else None
    return out


def build_links(rows: list[Row]) -> dict:
    """``{rate: {"reference_size", "ratios", "ratios_by_size", "goals", "rows"}}`` of the link rows
    (``Row.link`` set). Ratios and goals at the smallest size that ran; rows with ``ratio_to_floor``
    against the link's floor at their size."""
    out = {}
    for link in dict.fromkeys(r.link for r in rows if r.link):
        mine = [r for r in rows if r.link == link]
        sizes = sorted({r.size for r in mine})
        floor_s = {r.size: r.median_s for r in mine if r.kind == "floor"}
        ratios = _ratios(mine, sizes[0])
        out[link] = {
            "reference_size": sizes[0],
            "ratios": ratios,
            "ratios_by_size": {str(s): _ratios(mine, s) for s in sizes},
            "goals": {name: goal(ratios[name], *g[2]) for name, g in LINK_GOALS.items()},
            "rows": [r.to_json(floor_s.get(r.size)) for r in mine],
        }
    return out


def links_table(links: dict) -> str:
    """One line per link, size and row: seconds, payload and wire bytes, x floor, engine extra memory,
    stage seconds."""
    head = ("| link | size | row | engines | payload GB | wire GB (uplink tx) | median s | x floor | "
            f"engine extra MB | {' / '.join(k.removesuffix('_s') for k in STAGES)} s |")
    lines = [head, "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for link, part in links.items():
        for r in part["rows"]:
            st = r["stages"]
            stages = " / ".join(f"{st[k]:.2f}" if k in st else "-" for k in STAGES)
            ratio = f"{r['ratio_to_floor']:.2f}" if r["ratio_to_floor"] else "-"
            lines.append(f"| {link} | {r['size']}x | {r['kind']} | {r['engines']} | {r['bytes'] / 1e9:.3f} | "
                         f"{r['wire_bytes'] / 1e9:.3f} | {r['median_s']:.3f} | {ratio} | "
                         f"{r['engine_peak_extra_bytes'] / 1e6:.0f} | {stages} |")
    return "\n".join(lines)
