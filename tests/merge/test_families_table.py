"""The README's families table, generated from what the tests verify (and checked here).

Rows: every family of the golden layout rows; layout columns from the derived rows; a format column is
ticked only where ``test_oracle_matrix`` runs that adapter kind for the family (exact vs PEFT, fp32 and
bf16), the sync column only where ``test_sync_families`` syncs it (EP=2, full + delta), the CLI column where
it runs ``weightsync sync`` on it (``cli_families``: one family per distinct layout row), the FP8 column where
``tests/e2e/test_fp8_families.py`` / ``test_fp8_engine.py`` sync it into a block-FP8 engine. Rewrite with::

    python -m tests.merge.test_families_table --write
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sync_service.merge.derive import layout_for
from sync_service.synthetic import build_config
from tests.e2e.test_fp8_families import fp8_engine_families
from tests.merge.test_golden_layouts import GOLDEN
from tests.merge.test_oracle_matrix import CASES as MERGE_CASES
from tests.merge.test_sync_families import FAMILIES as SYNCED
from tests.merge.test_sync_families import cli_families

README = Path(__file__).parents[2] / "README.md"
BEGIN, END = "<!-- families-table:begin (tests/merge/test_families_table.py) -->", "<!-- families-table:end -->"
_KINDS = ("dense", "target_parameters", "legacy")


def _memory(row: dict) -> str:
    shape = "[E, 2I, H]" if row["orientation"] == "out_in" else "[E, H, 2I]"
    order = " interleaved" if row["gate_up_order"] == "interleaved" else ""
    return f"`{row['experts_module']}.gate_up_proj` {shape}{order}"


def _disk(family: str, row: dict) -> str:
    layout = layout_for(build_config(family))
    prefix = "model.layers.0."
    if row["disk"] == "per_expert":
        experts = layout.to_disk(f"{prefix}{row['experts_module']}.0.x.weight").removeprefix(prefix)
        return f"`{experts.removesuffix('.0.x.weight')}.N.{'/'.join(row['per_expert_names'])}`"
    name = layout.to_disk(f"{prefix}{row['experts_module']}.gate_up_proj").removeprefix(prefix)
    how = {"never": "", "always": ", transposed", "by_shape": ", either orientation"}[row["disk_transpose"]]
    return f"fused `{name}`{how}"


def table() -> str:
    """The markdown table (no markers), after a line naming the version sets its layout rows were derived with
    (``test_golden_layouts`` runs in ``.venv`` and in ``.ci/run``'s ``.venv-newest``)."""
    from tests.merge.families_census import pinned_sets

    rows = json.loads(GOLDEN.read_text())
    kinds: dict[str, set[str]] = {}
    for case in MERGE_CASES:
        family, kind = case.values[0], case.values[1]
        kinds.setdefault(family, set()).add(kind)
    lines = [f"Layout rows derived with {' and with '.join(pinned_sets())} (constraints/cpu.txt, constraints/newest.txt): "
             f"the same rows, checked against tests/merge/golden_layouts.json in each.", "",
             "| family | experts in memory | on disk (`save_pretrained`) | dense LoRA | `target_parameters` | "
             "legacy per-expert | sync EP=2 | `weightsync sync` | FP8 engine |", "|---|---|---|---|---|---|---|---|---|"]
    by_cli, fp8 = cli_families(), fp8_engine_families()
    for family, row in sorted(rows.items()):
        name = family + (" (hand row)" if row["source"] == "hand" else "")
        ticks = ["✓" if k in kinds.get(family, ()) else "—" for k in _KINDS]
        synced = "✓" if family in SYNCED else "—"
        cli = "✓" if family in by_cli else "—"
        quantized = "✓" if family in fp8 else "—"
        lines.append(f"| {name} | {_memory(row)} | {_disk(family, row)} | {' | '.join(ticks)} | {synced} | {cli} | "
                     f"{quantized} |")
    return "\n".join(lines)


def _section(text: str) -> str:
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()


def test_readme_families_table_is_generated():
    text = README.read_text()
    assert BEGIN in text and END in text, f"README lacks the {BEGIN} ... {END} markers"
    assert _section(text) == table(), "README families table is stale: python -m tests.merge.test_families_table --write"


if __name__ == "__main__" and "--write" in sys.argv:
    text = README.read_text()
    README.write_text(text[:text.index(BEGIN) + len(BEGIN)] + "\n" + table() + "\n" + text[text.index(END):])
    print(f"wrote the families table of {README}")
