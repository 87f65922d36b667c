"""Transports behind one interface (``protocols.interfaces.TransportSender`` / ``TransportReceiver``).

``open_sender(spec, sender)`` / ``open_receiver(spec, receiver)`` build a side from a
``TransportSpec``; each kind is imported lazily (``shm`` needs neither Ray nor torch.distributed).
"""

from __future__ import annotations

import importlib

from sync_service.transports.spec import KINDS, TRANSPORTS, TransportChoice, TransportSpec


def open_sender(spec: TransportSpec, sender: int = 0):
    """The sender side of ``spec`` for trainer shard ``sender`` (blocks up to ``spec.connect_timeout_s``)."""
    module, cls, _ = KINDS[spec.kind]
    return getattr(importlib.import_module(module), cls)(spec, sender)


def open_receiver(spec: TransportSpec, receiver: int = 0):
    """The receiver side of ``spec`` for rollout engine ``receiver`` (blocks up to ``spec.connect_timeout_s``)."""
    module, _, cls = KINDS[spec.kind]
    return getattr(importlib.import_module(module), cls)(spec, receiver)


__all__ = ["KINDS", "TRANSPORTS", "TransportChoice", "TransportSpec", "open_receiver", "open_sender"]
