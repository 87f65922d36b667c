"""The oracle the engine tests compare with: PEFT's ``merge_and_unload`` in float64, cast once
(``sync_service.verify.peft_oracle``), never weightsync's own merge.

``OracleCache`` computes it once per (base, adapter values): tests that replay the same training steps
from the same adapter (one version reached by several test cases) share one merge. ``our_merge`` is
weightsync's merge of the unsharded base — not an oracle: only for bitwise checks between weightsync's
own modes (factor streaming vs merged mode), which test determinism, never correctness.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import ray
import torch

from sync_service.entrypoints.local import AdapterReplay
from sync_service.verify.peft_oracle import compare_state, peft_merged_state


def adapter_digest(state: Mapping[str, torch.Tensor] | None) -> str:
    """A content hash of an adapter state dict (names, dtypes, shapes, bytes); ``""`` for no adapter."""
    if state is None:
        return ""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class OracleCache:
    """PEFT's merge (``peft_merged_state``: hf-fused names, the serving dtype) of a base + an adapter
    state, kept for the ``max_entries`` most recent (base, adapter values) pairs."""

    def __init__(self, max_entries: int = 16) -> None:
        self.max_entries = max_entries
        self._merged: OrderedDict[tuple[str, str], dict[str, torch.Tensor]] = OrderedDict()

    def state(self, base_dir: str | Path, replay: AdapterReplay | None) -> dict[str, torch.Tensor]:
        """The oracle for ``replay``'s current adapter state on ``base_dir`` (``None``: the base itself).
        The returned tensors are shared between callers: do not modify them."""
        key = (str(Path(base_dir).resolve()), adapter_digest(None if replay is None else replay.state))
        if key in self._merged:
            self._merged.move_to_end(key)
            return self._merged[key]
        with tempfile.TemporaryDirectory(prefix="wsoracle") as tmp:
            adapter_dir = None if replay is None else replay.save(Path(tmp) / "adapter")
            merged = peft_merged_state(base_dir, adapter_dir)
        self._merged[key] = merged
        while len(self._merged) > self.max_entries:
            self._merged.popitem(last=False)
        return merged


def assert_engines_match(engines, oracle: Mapping[str, torch.Tensor], *, what: str, timeout_s: float = 120) -> None:
    """Every engine actor serves ``oracle``'s names, each tensor within the rounding of an fp32-accumulated
    merge (``peft_oracle.values_match``: 8 fp32 eps relative to the terms, plus one ulp for bf16)."""
    for engine in engines:
        check = compare_state(ray.get(engine.state.remote(), timeout=timeout_s), oracle)
        assert check.ok, (f"{what}: {len(check.mismatched)} parameter(s) differ from PEFT's merge (max |diff| "
                          f"{check.max_abs_diff:.3g}), e.g. {list(check.mismatched[:3])}")


def assert_engines_bitwise(engines, expected: Mapping, *, what: str, timeout_s: float = 120) -> None:
    """Every engine actor serves exactly ``expected`` (name → tensor or numpy array; bf16 is compared widened
    to fp32, as engines report it), same names, bit for bit: for checks between weightsync's own modes or
    engines (a peer copy, an engine's earlier state), never for correctness."""
    want = {n: np.asarray(t.float() if t.dtype == torch.bfloat16 else t) if torch.is_tensor(t) else t
            for n, t in expected.items()}
    for engine in engines:
        state = ray.get(engine.state.remote(), timeout=timeout_s)
        assert set(state) == set(want), f"{what}: names differ {sorted(set(state) ^ set(want))[:4]}"
        bad = [n for n, t in want.items() if not np.array_equal(state[n], t)]
        assert not bad, f"{what}: {len(bad)} parameter(s) not bitwise equal, e.g. {bad[:3]}"


def our_merge(base_dir: str | Path, replay: AdapterReplay) -> dict[str, torch.Tensor]:
    """weightsync's merge (``MergedSource``, fp32 accumulation) of the whole base + ``replay``'s adapter,
    hf-fused names: what merged mode serves. For bitwise checks between weightsync's modes only."""
    from sync_service.merge.adapter import adapter_from_state_dict
    from sync_service.merge.base import SafetensorsBase
    from sync_service.merge.source import MergeConfig, MergedSource

    base = SafetensorsBase(base_dir, as_loaded=True)
    adapter = adapter_from_state_dict(replay.peft_config, dict(replay.state), base.layout, base.metas(),
                                      tied_aliases=base.tied_aliases)
    return materialize(MergedSource(base, adapter, config=MergeConfig()))


def materialize(source) -> dict[str, torch.Tensor]:
    """Every tensor a ``MergedSource`` serves, filled whole (its out dtype, full box)."""
    from protocols.params import full_box

    out = {}
    for m in source.param_metas():
        out[m.name] = torch.empty(m.shape, dtype=source.out_dtype(m.name))
        source.fill(m.name, full_box(m.shape), out[m.name])
    return out
