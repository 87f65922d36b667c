"""Staging memory: buffers reserved ahead of a sync are reused, so no sync pays first-touch or
copy-on-write page faults; loaded parameters never stay in the checkpoint file's mapping."""

from __future__ import annotations

import resource

import torch

from sync_service.engines.hf import HFEngine
from sync_service.engines.memory import MemoryEngine
from tests.engines.test_hf_engine import tiny_model

N = 8 << 20  # float32 elements: 32 MiB, 8192 pages of 4 KiB


def _file_mapped(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names whose memory lies in a file-backed mapping of this process (``/proc/self/maps``, inode != 0)."""
    rows = [line.split(maxsplit=5) for line in open("/proc/self/maps")]
    spans = [(int(a, 16), int(b, 16)) for r in rows if r[4] != "0" for a, b in [r[0].split("-")]]
    return [n for n, t in tensors.items() if any(a <= t.data_ptr() < b for a, b in spans)]


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_reserved_staging_takes_no_page_fault_inside_a_sync():
    engine = MemoryEngine({"w": torch.zeros(N), "b": torch.zeros(4)})
    assert engine.reserve_staging(["w", "b", "not.a.name"]) == N * 4 + 16
    assert engine.reserve_staging(["w"]) == 0  # already held
    values = {v: torch.full((N,), float(v)) for v in (1, 2, 3)}  # allocated (and touched) before measuring
    for version, value in values.items():
        before = _minor_faults()
        engine.begin_update(version, ["w"])
        engine.apply("w", ((0, N),), value)
        engine.finish_update()
        engine.commit(version)
        faults = _minor_faults() - before
        assert faults < 512, f"v{version}: {faults} page faults (a first touch of the buffer takes 8192)"
    version, served = engine.served()
    assert version == 3 and torch.equal(served["w"], values[3]) and torch.equal(served["b"], torch.zeros(4))


def test_loaded_parameters_own_private_memory(tmp_path):
    model = tiny_model(5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    engine = HFEngine.from_pretrained(tmp_path)
    params = dict(engine._model.named_parameters())
    assert _file_mapped(params) == []  # transformers leaves unconverted tensors in the file's mapping
    want = model.state_dict()
    got = engine.state_dict()
    assert set(got) <= set(want) and all(torch.equal(got[n], want[n]) for n in got)
    names = [m.name for m in engine.param_metas()]
    assert engine.reserve_staging(names) == sum(p.nbytes for p in engine.export_tensors().values())
    target = {n: p.detach().clone() for n, p in tiny_model(6).named_parameters() if n in got}
    engine.begin_update(1, list(target))
    for n, v in target.items():
        engine.apply(n, tuple((0, s) for s in v.shape), v)
    engine.finish_update()
    engine.commit(1)
    assert all(torch.equal(v, target[n]) for n, v in engine.state_dict().items() if n in target)
