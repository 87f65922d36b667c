"""Fault injectors run inside real actor processes through Ray's ``actor.__ray_call__``.

Each injector swaps one collaborator of a ``RolloutEngine`` / ``TrainerShard`` actor (its engine
adapter, its weight source, its sender transport) for a wrapper that delays, raises or tampers,
and can be removed again; the actors themselves carry no test hooks.

    ray.get(engine.__ray_call__.remote(inject.slow_apply, 0.05))
    ray.get(trainer.__ray_call__.remote(inject.tamper_frames, "corrupt"))
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from protocols.wire import BucketHeader
from protocols.wire_check import decode


class FaultyAdapter:
    """An EngineAdapter that delays every ``apply`` and/or raises once on a chosen name."""

    def __init__(self, inner, *, delay_s: float = 0.0, fail_on: str | None = None, message: str = ""):
        self.inner, self.delay_s, self.fail_on, self.message = inner, delay_s, fail_on, message

    def apply(self, name, box, data):
        if self.delay_s:
            time.sleep(self.delay_s)
        if name == self.fail_on:
            self.fail_on = None
            raise RuntimeError(self.message or f"injected engine failure while applying {name}")
        self.inner.apply(name, box, data)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


def _set_adapter(actor, adapter) -> None:
    actor.engine = adapter
    for _, receiver, _ in actor._channels.values():
        receiver.adapter = adapter


def _plain_adapter(actor):
    engine = actor.engine
    return engine.inner if isinstance(engine, FaultyAdapter) else engine


def slow_apply(actor, delay_s: float) -> None:
    """Every ``apply`` of this engine sleeps ``delay_s`` first (keeps a sync in flight)."""
    _set_adapter(actor, FaultyAdapter(_plain_adapter(actor), delay_s=delay_s))


def fail_apply(actor, name: str, message: str) -> None:
    """The next ``apply`` of ``name`` raises ``RuntimeError(message)`` (once)."""
    _set_adapter(actor, FaultyAdapter(_plain_adapter(actor), fail_on=name, message=message))


def heal_engine(actor) -> None:
    _set_adapter(actor, _plain_adapter(actor))


class SlowSource:
    """A WeightSource whose ``fill`` sleeps ``delay_s`` first."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    def param_metas(self):
        return self.inner.param_metas()

    def changed_names(self):
        return self.inner.changed_names()

    def fill(self, name, box, out):
        time.sleep(self.delay_s)
        self.inner.fill(name, box, out)


def slow_fill(actor, delay_s: float) -> None:
    """Every merged box of this trainer takes ``delay_s`` longer (keeps a sync in flight)."""
    state = actor._state()
    plain = type(state).source.__get__(state)
    state.source = lambda version: SlowSource(plain(version), delay_s)


class GatedSource(SlowSource):
    """A WeightSource whose ``fill`` waits until the file ``gate/open`` exists (after creating ``gate/reached``):
    holds a sync in flight, Begin sent, until the test opens the gate. Raises TimeoutError after ``timeout_s``."""

    def __init__(self, inner, gate: str, timeout_s: float):
        super().__init__(inner, 0.0)
        self.gate, self.timeout_s = Path(gate), timeout_s

    def fill(self, name, box, out):
        (self.gate / "reached").touch()
        end = time.monotonic() + self.timeout_s
        while not (self.gate / "open").exists():
            if time.monotonic() > end:
                raise TimeoutError(f"gate {self.gate} was not opened within {self.timeout_s:.0f} s")
            time.sleep(0.05)
        self.inner.fill(name, box, out)


def gate_fill(actor, gate: str, timeout_s: float = 300.0) -> None:
    """This trainer's next syncs wait in their first ``fill`` until ``gate/open`` exists (see ``GatedSource``)."""
    state = actor._state()
    plain = type(state).source.__get__(state)
    state.source = lambda version: GatedSource(plain(version), gate, timeout_s)


def heal_trainer(actor) -> None:
    actor._state().__dict__.pop("source", None)


class TamperedTransport:
    """A TransportSender that tampers with bucket ``seq`` of the next sync once, after sealing
    (the checksum and mac are those of the untampered bucket), then passes frames through."""

    MODES = ("corrupt", "truncate", "duplicate", "reorder")

    def __init__(self, inner, mode: str, seq: int = 1):
        assert mode in self.MODES, mode
        self.inner, self.mode, self.seq, self.done = inner, mode, seq, False
        self._held = None

    @property
    def num_receivers(self) -> int:
        return self.inner.num_receivers

    def poll_reply(self, timeout_s):
        return self.inner.poll_reply(timeout_s)

    def close(self):
        self.inner.close()

    def send(self, header: bytes, payload, timeout_s: float) -> None:
        msg = decode(header)
        if self.done or not isinstance(msg, BucketHeader) or payload is None:
            return self.inner.send(header, payload, timeout_s)
        if self.mode == "reorder" and msg.seq == self.seq - 1:
            self._held = (header, np.array(payload, copy=True))  # send it after bucket `seq`
            return None
        if msg.seq != self.seq:
            return self.inner.send(header, payload, timeout_s)
        self.done = True
        if self.mode == "corrupt":
            bad = np.array(payload, copy=True)
            bad[len(bad) // 2] ^= 0xFF
            return self.inner.send(header, bad, timeout_s)
        if self.mode == "truncate":
            return self.inner.send(header, payload[:-1], timeout_s)
        if self.mode == "duplicate":
            copy = np.array(payload, copy=True)
            self.inner.send(header, copy, timeout_s)
            return self.inner.send(header, copy, timeout_s)
        self.inner.send(header, payload, timeout_s)  # reorder: seq, then the held seq - 1
        held, self._held = self._held, None
        return self.inner.send(held[0], held[1], timeout_s)


def tamper_frames(actor, mode: str, seq: int = 1) -> None:
    """Tamper with bucket ``seq`` of this trainer's next sync on every open channel (see ``TamperedTransport``)."""
    for sender, _ in actor.endpoint.channels.values():
        sender.transport = TamperedTransport(sender.transport, mode, seq)


def delay_receiver_open(actor, delay_s: float) -> None:
    """Every ``open_receiver`` of this engine process sleeps ``delay_s`` first (0: restored), so the
    channel's connect window runs out before it attaches."""
    import sync_service.transports as transports

    original = transports.__dict__.setdefault("_undelayed_open_receiver", transports.open_receiver)
    transports.open_receiver = original if not delay_s else (
        lambda *args, **kw: (time.sleep(delay_s), original(*args, **kw))[1])


def pid(actor) -> int:
    return os.getpid()


def node_ip(actor) -> str:
    """The address of the Ray node the actor runs on."""
    import ray

    return ray.util.get_node_ip_address()


def listening(actor) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket of this process."""
    import psutil

    return sorted((c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN")
