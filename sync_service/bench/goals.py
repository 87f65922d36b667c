"""Ratios of bench rows against their goals, and the markdown tables of rows: one home for the one-host report
(``report``) and its links part (``link_report``).

A goal table maps a ratio's name to ``((numerator row kind, Row field), (denominator row kind, Row field),
(op, bound))``: the ratio is the numerator row's field over the denominator row's, both rows at one size; the goal
is ``ratio op bound`` with op ``<=`` or ``>=``. A table of columns maps a header to its markdown alignment and the
cell it writes from one row's JSON (``Row.to_json``)."""

from __future__ import annotations

import operator
from collections.abc import Callable

from sync_service.bench.rows import Row
from sync_service.coordinator.metrics import STAGES

__all__ = ["Column", "GoalTable", "goal", "goals", "markdown", "ratios", "STAGE_COLUMN", "FLOOR_COLUMN", "number"]

GoalTable = dict[str, tuple[tuple[str, str], tuple[str, str], tuple[str, float]]]
Column = tuple[str, str, Callable[[dict], str]]
"""(header, markdown alignment: ``---`` left, ``---:`` right, cell of one row's JSON)."""
_OPS = {"<=": operator.le, ">=": operator.ge}


def goal(value: float | None, op: str, bound: float) -> dict:
    """``{"goal": "<= 1.2", "value": value, "met": True | False | None}`` (``None``: not run)."""
    return {"goal": f"{op} {bound}", "value": value, "met": None if value is None else _OPS[op](value, bound)}


def ratios(rows: list[Row], size: int, table: GoalTable) -> dict[str, float | None]:
    """Every ratio of ``table`` between the rows of ``size`` (``None`` where a row did not run or its
    denominator field is 0)."""
    def find(kind: str) -> Row | None:
        return next((r for r in rows if r.kind == kind and r.size == size), None)

    out = {}
    for name, ((num, a), (den, b), _) in table.items():
        x, y = find(num), find(den)
        out[name] = getattr(x, a) / getattr(y, b) if x and y and getattr(y, b) else None
    return out


def goals(values: dict[str, float | None], table: GoalTable) -> dict[str, dict]:
    """``goal`` of each ratio of ``table`` (``values``: ``ratios``' answer)."""
    return {name: goal(values[name], *bounds) for name, (_, _, bounds) in table.items()}


def number(key: str, scale: float = 1.0, fmt: str = ".3f") -> Callable[[dict], str]:
    """The cell ``row[key] / scale`` formatted by ``fmt``."""
    return lambda row: f"{row[key] / scale:{fmt}}"


STAGE_COLUMN: Column = (f"{' / '.join(k.removesuffix('_s') for k in STAGES)} s", "---",
                        lambda row: " / ".join(f"{row['stages'][k]:.2f}" if k in row["stages"] else "-" for k in STAGES))
FLOOR_COLUMN: Column = ("x floor", "---:", lambda row: f"{row['ratio_to_floor']:.2f}" if row["ratio_to_floor"] else "-")


def markdown(columns: tuple[Column, ...], rows: list[dict]) -> str:
    """A markdown table: a header line, an alignment line, then one line a row."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "|".join(a for _, a, _ in columns) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cell(r) for _, _, cell in columns) + " |" for r in rows])
