"""Transports behind one interface (``protocols.interfaces.TransportSender`` / ``TransportReceiver``).

Whoever makes a ``TransportSpec`` hosts what the channel needs first (``host_channel``: the
authenticated rendezvous store of ``torch_dist``; nothing for ``shm`` and ``ray``), ships
``host.spec`` to every side, and closes the host with the channel. ``open_sender(spec, sender)`` /
``open_receiver(spec, receiver)`` build a side; each kind is imported lazily (``shm`` needs neither
Ray nor torch.distributed).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass

from sync_service.transports.spec import KINDS, TRANSPORTS, TransportChoice, TransportSpec


@dataclass(kw_only=True, slots=True)
class ChannelHost:
    """What the maker of a channel runs for it: the spec to ship, and the store it serves (if any)."""

    spec: TransportSpec
    """The spec every side opens (``torch_dist``: with the store's address and port)."""
    server: object | None = None
    """``torch_dist``: the ``store.StoreServer``; ``None`` for the other kinds."""

    def close(self) -> None:
        """Stop serving the channel (its sides then fail at their next store use). Idempotent."""
        if self.server is not None:
            self.server.close()


def host_channel(spec: TransportSpec, *, bind_host: str = "127.0.0.1",
                 port_range: tuple[int, int] | None = None) -> ChannelHost:
    """Start what ``spec``'s channel needs in this process: for ``torch_dist`` an authenticated
    rendezvous store (``store.StoreServer``, key ``spec.auth_key``) listening on ``bind_host`` only,
    on the first free port of ``port_range`` (inclusive; ``None``: one the OS picks).

    Raises: TransportError: no free port there.
    """
    if spec.kind != "torch_dist":
        return ChannelHost(spec=spec)
    from sync_service.transports.store import StoreServer

    server = StoreServer(bind_host, spec.auth_key, port_range)
    return ChannelHost(spec=dataclasses.replace(spec, address=bind_host, port=server.port), server=server)


def open_sender(spec: TransportSpec, sender: int = 0):
    """The sender side of ``spec`` for trainer shard ``sender`` (blocks up to ``spec.connect_timeout_s``)."""
    module, cls, _ = KINDS[spec.kind]
    return getattr(importlib.import_module(module), cls)(spec, sender)


def open_receiver(spec: TransportSpec, receiver: int = 0):
    """The receiver side of ``spec`` for rollout engine ``receiver`` (blocks up to ``spec.connect_timeout_s``)."""
    module, _, cls = KINDS[spec.kind]
    return getattr(importlib.import_module(module), cls)(spec, receiver)


__all__ = ["KINDS", "TRANSPORTS", "ChannelHost", "TransportChoice", "TransportSpec", "host_channel", "open_receiver",
           "open_sender"]
