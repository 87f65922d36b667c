"""A rank that never calls ``attach_megatron`` (or dies before attach's agreement) fails the others within
``timeout_s``, in one AttachError line naming the fix: gloo connects every rank when a group is created, and torch's
default bound there is 30 minutes. Two gloo processes, no Megatron model needed (~10 s)."""

from __future__ import annotations

import datetime
import os
import socket
import time
import types

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 3.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, where: str, out) -> None:
    from sync_service.live.attach import AttachError
    from sync_service.megatron.attach import _agree, weightsync_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    if rank == 1:  # absent: never calls attach (where="group") or never reaches the agreement (where="agree")
        if where == "agree":
            weightsync_group(TIMEOUT_S)
        time.sleep(4 * TIMEOUT_S)
        return
    t0 = time.monotonic()
    try:
        group = weightsync_group(TIMEOUT_S)
        _agree(0, 2, group, None, 0, TIMEOUT_S)
        out.put(("attached", time.monotonic() - t0, ""))
    except AttachError as exc:
        out.put(("AttachError", time.monotonic() - t0, str(exc)))


@pytest.mark.parametrize("where", ["group", "agree"])
def test_an_absent_rank_fails_attach_within_timeout_s(where):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, where, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        kind, seconds, message = out.get(timeout=20 * TIMEOUT_S)  # without the bound: 30 minutes
    finally:
        for p in procs:
            p.kill()
            p.join(10)
    assert kind == "AttachError" and seconds < 4 * TIMEOUT_S, (kind, seconds, message)
    assert len(message.splitlines()) == 1 and f"timeout_s={TIMEOUT_S:g}" in message
    assert "every rank" in message


def _raise_attribute_error(*args, **kwargs):
    raise AttributeError("'object' object has no attribute 'named_parameters'")


def _failing_rank(rank: int, port: int, out) -> None:
    from sync_service.live.attach import AttachError
    from sync_service.megatron.attach import weightsync_group
    from sync_service.megatron import attach

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    group = weightsync_group(TIMEOUT_S)
    # no Megatron model here: rank 0's state builds, rank 1's raises an error of a type attach did not list
    from sync_service.megatron import state

    attach.expert_fc2_rule = lambda etp: "dense"
    state.MegatronState = (lambda *a, **k: types.SimpleNamespace(terms={})) if rank == 0 else _raise_attribute_error
    t0 = time.monotonic()
    try:
        attach.build_megatron_endpoint([], hf_config={"model_type": "qwen3_moe"}, group=group, rank=rank, world=2,
                                       timeout_s=20 * TIMEOUT_S)
        out.put((rank, "attached", 0.0, ""))
    except AttachError as exc:
        out.put((rank, "AttachError", time.monotonic() - t0, str(exc)))


def test_an_unexpected_error_on_one_rank_fails_every_rank_at_once():
    """Not only the expected error types: an AttributeError on rank 1 reaches rank 0 through attach's agreement
    (before: rank 1 raised alone and rank 0 waited out timeout_s)."""
    pytest.importorskip("megatron.core")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_failing_rank, args=(r, port, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = sorted(out.get(timeout=20 * TIMEOUT_S) for _ in range(2))
    finally:
        for p in procs:
            p.kill()
            p.join(10)
    for rank, kind, seconds, message in got:
        assert kind == "AttachError" and seconds < 10 * TIMEOUT_S, (rank, kind, seconds, message)
        assert "rank 1" in message and "refused" in message and len(message.splitlines()) == 1, message


@pytest.mark.parametrize("text", ["{oops", "[1, 2]", "\udcff"])
def test_an_hf_config_that_is_no_json_object_is_named(tmp_path, text):
    """What every rank reports at attach names the file and the fix (was json's bare 'Expecting property name')."""
    from sync_service.megatron.attach import _config

    (tmp_path / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ValueError, match=r"hf_config '.*config\.json' .*give the HF model directory"):
        _config(tmp_path)


@pytest.mark.parametrize("own,given", [(None, float("nan")), (None, float("inf")), (float("nan"), None)])
def test_an_alpha_that_gives_no_finite_scale_is_refused_at_attach(own, given):
    """Was: a NaN scale that surfaced only at the push, as non-finite merged weights named by tensor."""
    from sync_service.megatron.state import _scale

    module = types.SimpleNamespace(dim=4, alpha=own)
    with pytest.raises(ValueError, match="no finite LoRA scale.*lora_alpha"):
        _scale("decoder.layers.0.self_attention.linear_qkv", module, given)
    assert _scale("x", types.SimpleNamespace(dim=4, alpha=None), 8.0) == 2.0
