"""``sync_service.bench.rss.RssSampler`` on real processes: growth of allocated bytes, and a process that is
gone before sampling named by its group (a bench row whose actor was killed, e.g. out of memory)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sync_service.bench.rss import RssSampler

GROW = "import sys, time; sys.stdin.readline(); b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); " \
       "print('grown', flush=True); sys.stdin.readline()"


def test_sampler_sees_a_process_allocate_64_mib():
    proc = subprocess.Popen([sys.executable, "-c", GROW], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with RssSampler({"trainer": [proc.pid]}, interval_s=0.005) as rss:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "grown"
        assert 64 << 20 <= rss.max_extra_bytes("trainer") < 96 << 20
        assert rss.peak_bytes("trainer") >= 64 << 20 and rss.max_extra_bytes("engine") == 0
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_process_gone_before_sampling_is_named_by_its_group():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    with pytest.raises(RuntimeError, match=rf"^engine process {proc.pid} exited before its memory was sampled"):
        RssSampler({"trainer": [], "engine": [proc.pid]})
