"""The ``"links"`` part of a bench report: per link rate its rows, ratios and goals, and its table."""

from __future__ import annotations

from sync_service.bench.goals import FLOOR_COLUMN, STAGE_COLUMN, GoalTable, goals, markdown, number, ratios
from sync_service.bench.rows import Row

__all__ = ["LINK_COLUMNS", "LINK_GOALS", "build_links", "links_table"]

LINK_GOALS: GoalTable = {  # across hosts; named as the one-host ratios (``goals.GoalTable``: the shape)
    "delta_vs_floor": (("delta", "median_s"), ("floor", "median_s"), ("<=", 1.2)),
    "factors_bytes_share": (("factors", "wire_bytes"), ("delta", "wire_bytes"), ("<=", 0.1)),
    "factors_vs_delta_s": (("factors", "median_s"), ("delta", "median_s"), ("<=", 0.2)),
    "fanout2_vs_fanout1": (("delta_fanout2", "median_s"), ("delta", "median_s"), ("<=", 1.2)),
    "disk_vs_delta": (("disk", "median_s"), ("delta", "median_s"), (">=", 10.0)),
}


def build_links(rows: list[Row]) -> dict:
    """``{rate: {"reference_size", "ratios", "ratios_by_size", "goals", "rows"}}`` of the link rows
    (``Row.link`` set). Ratios and goals at the smallest size that ran; rows with ``ratio_to_floor``
    against the link's floor at their size."""
    out = {}
    for link in dict.fromkeys(r.link for r in rows if r.link):
        mine = [r for r in rows if r.link == link]
        sizes = sorted({r.size for r in mine})
        floor_s = {r.size: r.median_s for r in mine if r.kind == "floor"}
        at_ref = ratios(mine, sizes[0], LINK_GOALS)
        out[link] = {
            "reference_size": sizes[0],
            "ratios": at_ref,
            "ratios_by_size": {str(s): ratios(mine, s, LINK_GOALS) for s in sizes},
            "goals": goals(at_ref, LINK_GOALS),
            "rows": [r.to_json(floor_s.get(r.size)) for r in mine],
        }
    return out


LINK_COLUMNS = (("link", "---", lambda r: r["link"]), ("size", "---:", lambda r: f"{r['size']}x"),
                ("row", "---", lambda r: r["kind"]), ("engines", "---:", lambda r: str(r["engines"])),
                ("payload GB", "---:", number("bytes", 1e9)), ("wire GB (uplink tx)", "---:", number("wire_bytes", 1e9)),
                ("median s", "---:", number("median_s")), FLOOR_COLUMN,
                ("engine extra MB", "---:", number("engine_peak_extra_bytes", 1e6, ".0f")), STAGE_COLUMN)


def links_table(links: dict) -> str:
    """One line per link, size and row: seconds, payload and wire bytes, x floor, engine extra memory,
    stage seconds."""
    return markdown(LINK_COLUMNS, [{**r, "link": link} for link, part in links.items() for r in part["rows"]])
