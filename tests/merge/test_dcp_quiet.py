"""``read_dcp_state`` (``weightsync merge --base <DCP or torch_dist dir>``) reads in one process on purpose, so
torch's "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a single
process" ``UserWarning`` is not shown; torch itself still gives it for the same read (the filter is needed), and
other warnings pass through."""

from __future__ import annotations

import re
import warnings

import torch
import torch.distributed.checkpoint as dcp

from sync_service.merge.dcp import SINGLE_PROCESS_WARNING, read_dcp_state


def test_read_dcp_state_gives_no_single_process_warning(tmp_path):
    want = {"model.w": torch.arange(6.0).reshape(2, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(want, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    with warnings.catch_warnings(record=True) as torch_own:
        warnings.simplefilter("always")
        dcp.load({"model.w": torch.empty(2, 3)}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert any(re.match(SINGLE_PROCESS_WARNING, str(w.message)) for w in torch_own), [str(w.message) for w in torch_own]
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        got = read_dcp_state(tmp_path / "ckpt")
    assert torch.equal(got["model.w"], want["model.w"])
    assert not [str(w.message) for w in ours if "torch.distributed is" in str(w.message)]
    with warnings.catch_warnings(record=True) as after:  # the filter is scoped to the read
        warnings.simplefilter("always")
        warnings.warn("torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load x")
    assert len(after) == 1
