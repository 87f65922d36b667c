"""``sync_service.bench.goals``: the ratios and goals of the one-host report and of its links part, and their
markdown tables, from rows made here (no bench run)."""

from __future__ import annotations

import pytest

from sync_service.bench.goals import goals, ratios
from sync_service.bench.link_report import LINK_GOALS, build_links, links_table
from sync_service.bench.report import GOALS, markdown_table
from sync_service.bench.rows import Row


def _row(kind: str, size: int, seconds: float, *, wire_bytes: int = 0, link: str = "") -> Row:
    return Row(kind=kind, size=size, model_bytes=size << 30, bytes=size << 20, engines=1, seconds=[seconds, seconds * 3, 0.0],
               stages={"merge_s": 0.25}, wire_bytes=wire_bytes, link=link)


def test_ratios_goals_and_tables():
    rows = [_row("delta", 1, 2.0), _row("floor", 1, 1.0), _row("full", 1, 4.0), _row("disk", 1, 30.0),
            _row("delta", 2, 3.0), _row("full", 2, 0.0)]
    got = ratios(rows, 1, GOALS)
    assert got["delta_vs_floor"] == 2.0 and got["delta_vs_full"] == 0.5 and got["disk_vs_delta"] == 15.0
    assert got["gather_vs_delta"] is None  # not run
    assert ratios(rows, 2, GOALS)["delta_vs_full"] is None  # a zero denominator
    met = goals(got, GOALS)
    assert met["delta_vs_floor"] == {"goal": "<= 2.0", "value": 2.0, "met": True}
    assert met["disk_vs_delta"]["met"] is True and met["gather_vs_delta"]["met"] is None
    assert goals({**got, "delta_vs_full": 1.5}, GOALS)["delta_vs_full"]["met"] is False

    table = markdown_table({"rows": [r.to_json(1.0) for r in rows[:2]]}).splitlines()
    assert len(table) == 4 and all(line.count("|") == table[0].count("|") for line in table)
    assert table[2].startswith("| 1x | delta | 1 | 0.001 | 2.000 | 0.001 | 2.00 |") and "- / 0.25 / -" in table[2]

    link = [_row("delta", 1, 2.0, wire_bytes=1000, link="1gbit"), _row("floor", 1, 1.5, link="1gbit"),
            _row("factors", 1, 0.2, wire_bytes=50, link="1gbit")]
    part = build_links(link)["1gbit"]
    assert part["ratios"]["factors_bytes_share"] == pytest.approx(0.05)
    assert part["ratios"]["delta_vs_floor"] == pytest.approx(2.0 / 1.5) and part["goals"]["delta_vs_floor"]["met"] is False
    assert set(part["ratios"]) == set(LINK_GOALS)
    lines = links_table(build_links(link)).splitlines()
    assert len(lines) == 5 and lines[2].startswith("| 1gbit | 1x | delta | 1 | 0.001 | 0.000 | 2.000 | 1.33 | 0 |")
