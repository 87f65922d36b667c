"""Check 3 of ``gpu_check``: a trainer process and an HF engine process, endpoints driven without Ray.

This process plays the coordinator: it calls the endpoint contract (``protocols/endpoints.py``) on a
trainer process (``live.endpoint.TrainerEndpoint`` over ``load_rank``'s checkpoint shard, as the
``TrainerShard`` actor holds it) and an engine process (``HFEngine`` + ``BucketReceiver``, as the
``RolloutEngine`` actor's ``receive`` / ``commit``), each started with ``multiprocessing`` (spawn) and
answering calls over a pipe. One full sync of version 1, a training step, then a delta sync of version 2;
after each commit the engine's parameters are compared with PEFT's float64 merge of that version's adapter
(``verify.peft_oracle``), cast once.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from protocols.endpoints import OpenChannel, SendRequest
from protocols.wire import encode

_STEP_SCALE = 0.02


class _Trainer:
    """The trainer process's objects: the endpoint over rank 0 of a 1 × 1 mesh on ``device``, plus a training step."""

    def __init__(self, base_dir: str, adapter_dir: str, device: str) -> None:
        from sync_service.live.checkpoint import load_rank
        from sync_service.live.endpoint import TrainerEndpoint
        from sync_service.sharding.rules import ShardSpec

        self.state = load_rank(base_dir, adapter_dir, ShardSpec(rank=0, ep=1, tp=1), device=device)  # merges there
        self.endpoint = TrainerEndpoint(self.state, rank=0)

    def train_step(self, step: int) -> None:
        """factor += ``step_delta`` (as ``TrainerShard.train_step``; the coordinator replays it for the oracle)."""
        from sync_service.live.checkpoint import set_factors

        set_factors(self.state, {k: p.param + stepped(k, p.param, step) for k, p in self.state.factors.items()})


class _Engine:
    """The engine process's objects: an HF engine on ``device`` and one channel's receiver."""

    def __init__(self, base_dir: str, device: str) -> None:
        from sync_service.engines.hf import HFEngine

        self.engine = HFEngine.from_pretrained(base_dir, device=device)
        self.channel = None

    def open_transport(self, request: OpenChannel) -> None:
        from protocols.wire_check import decode
        from sync_service.streaming.receiver import BucketReceiver
        from sync_service.transports import TransportSpec, open_receiver

        plan = decode(request.plan)
        transport = open_receiver(TransportSpec.from_bytes(request.spec), receiver=request.index)
        self.channel = (transport, BucketReceiver(self.engine, plan, receiver=request.index, secret=request.secret))
        self.engine.reserve_staging(list(dict.fromkeys(e.name for e in plan.entries)))

    def receive(self, timeout_s: float) -> int:
        transport, receiver = self.channel
        return receiver.receive_sync(transport, timeout_s=timeout_s, commit=False).payload_bytes

    def commit(self, version: int) -> None:
        self.engine.commit(version)

    def served(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().to("cpu", copy=True) for n, t in self.engine.state_dict().items()}

    def param_metas(self):
        return tuple(self.engine.param_metas())

    def close(self) -> None:
        if self.channel is not None:
            self.channel[0].close()


def stepped(key: str, factor: torch.Tensor, step: int) -> torch.Tensor:
    """The change training step ``step`` makes to factor ``key`` (``sharding.training.step_delta``)."""
    from sync_service.sharding.training import step_delta

    return step_delta(key, tuple(factor.shape), step, _STEP_SCALE).to(factor.device, factor.dtype)


def _serve(make, args, conn) -> None:
    """Child process: build ``make(*args)``, then answer ``(path, args)`` calls until ``None``."""
    try:
        obj = make(*args)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while (call := conn.recv()) is not None:
        path, call_args = call
        try:
            target = obj
            for part in path.split("."):
                target = getattr(target, part)
            conn.send(("ok", target(*call_args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class _Process:
    """A spawned process holding one object; ``call("a.b", *args)`` runs ``obj.a.b(*args)`` there."""

    def __init__(self, make, *args) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(make, args, child), daemon=True)
        self.proc.start()
        self._answer(600.0)

    def start(self, path: str, *args) -> None:
        self._conn.send((path, args))

    def answer(self, timeout_s: float = 600.0):
        return self._answer(timeout_s)

    def call(self, path: str, *args, timeout_s: float = 600.0):
        self.start(path, *args)
        return self._answer(timeout_s)

    def _answer(self, timeout_s: float):
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"no answer within {timeout_s:.0f}s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(value.strip().splitlines()[-1] + "\n" + value)
        return value

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


@dataclass(frozen=True, slots=True)
class EndpointsReport:
    ok: bool
    figure: str


def stepped_adapter(adapter_dir: Path, out_dir: Path, step: int) -> Path:
    """``adapter_dir`` after training step ``step`` (what the trainer process did to its factors)."""
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(adapter_dir / "adapter_config.json", out_dir / "adapter_config.json")
    state = load_file(str(adapter_dir / "adapter_model.safetensors"))
    save_file({k: (v + stepped(k, v, step)).contiguous() for k, v in state.items()}, str(out_dir / "adapter_model.safetensors"))
    return out_dir


def _sync(trainer: _Process, engine: _Process, owner: str, version: int, names) -> int:
    """One version, phase 1 (receive + send) then phase 2 (commit); returns the payload bytes."""
    engine.start("receive", 300.0)
    trainer.call("endpoint.send", SendRequest(owner=owner, session=f"{owner}-v{version}", version=version,
                                              names=names, timeout_s=300.0))
    payload = engine.answer()
    engine.call("commit", version)
    return payload


def _check(engine: _Process, base_dir: Path, adapter_dir: Path) -> tuple[bool, float]:
    from sync_service.verify.peft_oracle import compare_state, peft_merged_state

    oracle = peft_merged_state(base_dir, adapter_dir, dtypes={m.name: m.dtype for m in engine.call("param_metas")})
    check = compare_state(engine.call("served"), oracle)
    return check.ok, check.max_abs_diff


def run_endpoints(device: str, files: tuple[Path, Path], workdir: Path) -> EndpointsReport:
    """Full sync of version 1, a training step, delta sync of version 2 over a ``cuda_ipc`` channel with slots on
    ``device``, each checked against PEFT. ``files``: ``(base_dir, adapter_dir)``, a bf16 MoE and its LoRA."""
    from sync_service.coordinator import build_sync_plan
    from sync_service.transports import TransportSpec

    root = workdir / "endpoints"
    base_dir, adapter_dir = files
    trainer = engine = None
    try:
        trainer = _Process(_Trainer, str(base_dir), str(adapter_dir), device)
        engine = _Process(_Engine, str(base_dir), device)
        plan = build_sync_plan([list(trainer.call("endpoint.owned_metas"))], bucket_bytes=1 << 20)
        spec = TransportSpec(kind="cuda_ipc", name="ge" + uuid.uuid4().hex[:8], device=device, bucket_bytes=plan.bucket_bytes,
                             connect_timeout_s=120.0, op_timeout_s=120.0)
        owner, secret = "gpu-check", uuid.uuid4().bytes * 2
        for side in (engine, trainer):
            path = "open_transport" if side is engine else "endpoint.open_transport"
            side.start(path, OpenChannel(owner=owner, spec=spec.to_bytes(), plan=encode(plan), index=0, secret=secret))
        trainer.answer(), engine.answer()
        trainer.call("endpoint.snapshot", 1)
        full = _sync(trainer, engine, owner, 1, None)
        ok1, diff1 = _check(engine, base_dir, adapter_dir)
        trainer.call("train_step", 1)
        changed = trainer.call("endpoint.snapshot", 2).changed
        delta = _sync(trainer, engine, owner, 2, None if changed is None else tuple(sorted(changed)))
        ok2, diff2 = _check(engine, base_dir, stepped_adapter(adapter_dir, root / "lora-step1", 1))
    finally:
        for side in (engine, trainer):
            if side is not None:
                side.close()
    return EndpointsReport(ok=ok1 and ok2 and delta < full, figure=(
        f"full {full / 1e6:.2f} MB max|diff| {diff1:.3g}, delta {delta / 1e6:.2f} MB max|diff| {diff2:.3g} vs PEFT float64 "
        f"({'match' if ok1 and ok2 else 'MISMATCH'})"))
