"""The served check's cost row (``sync_service.bench.served_cost``, also a row of ``weightsync bench``) at a tiny
size: push seconds for every mode from one run, the payload of a full push. Not a timed test: it checks what the
row reports, not how fast."""

from __future__ import annotations

from sync_service.bench.served_cost import measure


def test_the_row_reports_every_mode_of_one_run(tmp_path):
    got = measure(tmp_path, hidden=32, intermediate=16, experts=4, repeats=2)
    assert set(got) == {"off", "log", "enforce", "payload_bytes"}
    assert all(got[mode] > 0 for mode in ("off", "log", "enforce"))
    assert got["payload_bytes"] > 4 * 2 * 32 * 16 * 4  # at least the experts' fp32 gate_up_proj of one layer
