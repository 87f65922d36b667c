"""The derived layout rows of every synthetic family, checked against a golden file.

The rows come from the installed transformers (``sync_service/merge/derive.py``); a release that changes a
family's conversion mapping, experts flags or parameter order changes a row and fails here loudly, instead
of merging wrong. After checking the change by hand, rewrite the file::

    python -m tests.merge.test_golden_layouts --write
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from sync_service.merge.derive import layout_for
from sync_service.synthetic import FAMILIES, build_config

GOLDEN = Path(__file__).with_name("golden_layouts.json")


def derived_rows() -> dict[str, dict]:
    """family → its derived ``FamilyLayout`` as JSON-ready fields."""
    rows = {}
    for family in FAMILIES:
        row = dataclasses.asdict(layout_for(build_config(family)))
        rows[family] = json.loads(json.dumps(row))  # tuples → lists, as the file holds them
    return rows


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_derived_row_matches_golden(family):
    golden = json.loads(GOLDEN.read_text())
    assert family in golden, f"no golden row for {family}; run python -m tests.merge.test_golden_layouts --write"
    got = json.loads(json.dumps(dataclasses.asdict(layout_for(build_config(family)))))
    changed = {k: (golden[family].get(k), v) for k, v in got.items() if golden[family].get(k) != v}
    assert not changed, f"{family}: derived row changed (golden, now): {changed}"


def test_golden_covers_exactly_the_families():
    assert sorted(json.loads(GOLDEN.read_text())) == sorted(FAMILIES)


if __name__ == "__main__" and "--write" in sys.argv:
    GOLDEN.write_text(json.dumps(derived_rows(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
