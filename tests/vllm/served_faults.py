"""The served check's three faults under ``check_served="enforce"``, on a vLLM engine (in process or a server).

``refuses_faults`` runs them through the Python API on an engine that already serves a version of ``trainers``'
model over ``sync`` (one Ray session, the module's engine, the module's trainers), each fault on its own push:

1. **corrupt**: a bit flipped in the engine's apply after the copy (``engines.faults`` armed in the worker
   that stages: after the bucket's checksum and HMAC passed, after the check recorded what apply was handed);
2. **drop**: a routed expert's box counted as applied but never copied (a missing tensor);
3. **nan**: the trainers send a NaN (a base tensor set by ``update_base``): bytes as sent, not finite.

Each push raises ``SyncError`` naming the tensor; the engine still serves the previous version — its version, its
read back (every tensor's xxh3_64) and its greedy tokens equal those before the faults; then a clean push of the
same version commits with no finding. ``logs_a_finding``: the corrupt fault under ``"log"`` commits, one finding.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import ray

CORRUPT = "model.layers.0.self_attn.q_proj.weight"
DROP = "model.layers.1.mlp.experts.2.down_proj.weight"  # a routed expert (the checkpoint naming the worker stages in)
NAN = "model.layers.1.self_attn.o_proj.weight"  # replicated on every EP rank: each sends the same NaN
FAULTS = (
    ("corrupt", CORRUPT, r"box .*corrupted after the transport's checksum"),
    ("drop", DROP, r"box .*not applied"),
    ("nan", NAN, r"holds NaN/Inf"),
)


def logs_a_finding(trainers: Sequence, engine, arm: Callable[[dict | None], None], *, version: int,
                   timeout_s: float = 120) -> None:
    """Under ``check_served="log"`` a byte corrupted in the engine's apply (``CORRUPT``) is a finding, not a
    refusal: ``version`` commits and the engine's report carries 1 into ``SyncMetrics.engines[].served_findings``
    (the Prometheus ``weightsync_served_check_findings_total``); a full push over a new channel of the same actors."""
    from sync_service.api import SyncConfig, WeightSync

    sync = WeightSync(trainers=trainers, engines=[engine], config=SyncConfig(
        transport="shm", timeout_s=timeout_s, check_served="log", delta=False))
    arm({"corrupt": [CORRUPT]})
    try:
        (got,) = sync.push(version).engines
    finally:
        arm(None)
        sync.close()
    assert got.committed and got.served_findings == 1, got
    assert ray.get(engine.weight_version.remote(), timeout=timeout_s) == version


def refuses_faults(sync, engine, trainers: Sequence, arm: Callable[[dict | None], None], *, version: int,
                   prompts: Sequence[Sequence[int]], max_new_tokens: int, step: int, timeout_s: float = 120) -> None:
    """The module docstring's three faults, pushed as ``version`` (above the served one) after the trainers'
    training steps ``step``, ``step + 1``, ``step + 2``; ``arm``: arms the engine's fault file (``engines.faults.arm`` on the file its worker
    reads; ``None`` disarms)."""
    from sync_service.api import SyncError

    served = ray.get(engine.served_weights.remote(), timeout=timeout_s)
    tokens = [ray.get(engine.generate.remote(list(p), max_new_tokens), timeout=timeout_s)[0] for p in prompts]
    assert served.version == version - 1 and ray.get(engine.weight_version.remote(), timeout=timeout_s) == version - 1
    original = ray.get(trainers[0].local_base.remote(), timeout=timeout_s)[NAN]
    for i, (kind, name, cause) in enumerate(FAULTS):
        # a training step per fault: a dropped box would otherwise find the previous push's bytes (the same) staged
        ray.get([t.train_step.remote(step + i) for t in trainers], timeout=timeout_s)
        if kind == "nan":
            bad = original.copy()
            bad.reshape(-1)[5] = np.nan
            ray.get([t.update_base.remote({NAN: bad}) for t in trainers], timeout=timeout_s)
        else:
            arm({kind: [name]})
        try:
            with pytest.raises(SyncError, match=f"refused by the served check: .*{re.escape(name)}: {cause}"):
                sync.push(version)
        finally:
            arm(None)
            if kind == "nan":
                ray.get([t.update_base.remote({NAN: original}) for t in trainers], timeout=timeout_s)
        after = ray.get(engine.served_weights.remote(), timeout=timeout_s)
        assert after.version == version - 1 and after.digests() == served.digests(), f"{kind}: the served weights changed"
        got = [ray.get(engine.generate.remote(list(p), max_new_tokens), timeout=timeout_s)[0] for p in prompts]
        assert got == tokens, f"{kind}: the served tokens changed"
    clean = sync.push(version).engines[0]  # nothing left staged: the clean version commits
    assert clean.committed and clean.served_findings == 0  # the check ran on it and found nothing (None: not run)
    assert ray.get(engine.served_weights.remote(), timeout=timeout_s).digests() != served.digests()
