"""The bench's memory plan: a row that would not fit the memory available is skipped with its reason, before
it starts (``sync_service/bench/memory_plan.py``, ``run._fits``); rows outside the plan always run."""

from __future__ import annotations

from types import SimpleNamespace

from sync_service.bench.memory_plan import PROCESS_BYTES, ROW_MEMORY, memory_needed, skip_reason
from sync_service.bench.run import _fits

GIB = 1 << 30


def test_need_is_model_copies_plus_processes():
    copies, processes = ROW_MEMORY["live_hsdp"]
    assert memory_needed("live_hsdp", 2 * GIB) == int(copies * 2 * GIB + processes * PROCESS_BYTES)
    assert memory_needed("delta", 2 * GIB) is None and skip_reason("delta", 100 * GIB, available_bytes=0) is None


def test_a_row_that_does_not_fit_is_skipped_with_its_reason():
    need = memory_needed("live_hsdp", 2 * GIB)
    assert skip_reason("live_hsdp", 2 * GIB, available_bytes=need) is None
    reason = skip_reason("live_hsdp", 2 * GIB, available_bytes=need - 1)
    assert reason.startswith(f"needs ~{need / GIB:.1f} GiB (4.5 x the 2.00 GiB model + 5 processes)"), reason
    assert "available" in reason and "--*-max-size" in reason


def test_fits_records_the_skip(monkeypatch):
    import psutil

    model = SimpleNamespace(shape=SimpleNamespace(bf16_bytes=lambda: 2 * GIB))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=4 * GIB))
    skipped, said = [], []
    assert _fits("delta", 2, model, skipped, said.append) and skipped == []
    assert not _fits("live_hsdp", 2, model, skipped, said.append)
    assert [(s["row"], s["size"]) for s in skipped] == [("live_hsdp", 2)] and "4.0 GiB available" in skipped[0]["reason"]
    assert said == [f"  2x live_hsdp SKIPPED: {skipped[0]['reason']}"]
