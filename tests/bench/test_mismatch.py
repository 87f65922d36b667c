"""``python -m sync_service.bench.mismatch``: the KL table of each way of serving, on short sequences."""

from __future__ import annotations


def test_mismatch_rows(tmp_path):
    from sync_service.bench.mismatch import measure

    rows = dict(measure(tmp_path, sequences=2, tokens=16))
    floor = rows.pop("floor: KL(fp32 unmerged || bf16 unmerged)")
    assert floor > 0 and len(rows) == 5 and all(kl > 0 for kl in rows.values()), rows
    fp32 = rows["merged, float32 accumulation, cast once"]
    assert rows["factor mode (the engine merges the streamed factors)"] == fp32  # the merged mode's bytes
    assert rows["block-FP8 engine (16x16 blocks, float64 accumulation)"] > rows["merged, float64 accumulation, cast once"]
