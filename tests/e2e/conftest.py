"""End-to-end fixtures: one local Ray per test module (own temp dir, 2 CPUs), real actors."""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest
import torch

import ray



def assert_engines_equal(engines, reference: dict, *, what: str = "", atol: float = 0.0) -> None:
    """Every engine parameter equals the reference tensor (bitwise with ``atol=0``), no name missing."""
    for engine in engines:
        state = ray.get(engine.state.remote(), timeout=120)
        assert set(state) == set(reference), set(state) ^ set(reference)
        bad = {}
        for name, t in reference.items():
            ref = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
            diff = float(np.abs(state[name].astype(np.float64) - ref.astype(np.float64)).max())
            if diff > atol or (atol == 0 and not np.array_equal(state[name], ref)):
                bad[name] = diff
        assert not bad, f"{what}: {len(bad)} parameter(s) differ from the reference (max abs diff), e.g. {list(bad.items())[:3]}"
