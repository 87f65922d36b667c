"""``Channel``: the coordinator's one channel between its trainers and its member engines.

Opened with one ``TransportSpec`` sized to the members (``open``), opened again after every
membership change and after a failed push (the transport may be half-used). Every endpoint keeps
it under the coordinator's ``owner`` key (``protocols.endpoints.OpenChannel``), so another
coordinator on the same actors never closes it. What the channel needs served by its maker (the
``"torch"`` transport's authenticated rendezvous store, ``transports.host_channel``) runs here from
``open`` to the next ``open`` or ``close``. An open that fails closes what it opened.
"""

from __future__ import annotations

from collections.abc import Sequence

from protocols.endpoints import OpenChannel
from sync_service.coordinator.calls import call_all, settle
from sync_service.transports import TRANSPORTS, ChannelHost, TransportSpec, host_channel
from sync_service.transports.spec import resolve_backend

__all__ = ["Channel"]

CLOSE_TIMEOUT_S = 30.0
"""Bound of a close round (closing never blocks on a peer; a dead actor fails at once)."""


class Channel:
    """Args: owner: the coordinator's id. plan_bytes: the encoded plan. secret: the HMAC key. config: SyncConfig."""

    def __init__(self, *, owner: str, plan_bytes: bytes, bucket_bytes: int, secret: bytes, config) -> None:
        self.owner, self._plan_bytes, self._bucket_bytes = owner, plan_bytes, bucket_bytes
        self._secret, self._config = secret, config
        self.epoch = 0
        self.open_now = False
        self._host: ChannelHost | None = None

    def open(self, trainers: Sequence, trainer_names: Sequence[str], engines: Sequence,
             engine_names: Sequence[str]) -> None:
        """Open (again) for these members; blocks until every side connected.

        Raises:
            EndpointError: an endpoint failed to open (every side of this channel is closed again).
        """
        self.epoch += 1
        timeout = self._config.timeout_s
        spec = TransportSpec(kind=TRANSPORTS[self._config.transport].push, name=f"ws{self.owner}e{self.epoch}",
                             num_senders=len(trainers), num_receivers=len(engines), bucket_bytes=self._bucket_bytes,
                             connect_timeout_s=timeout, op_timeout_s=timeout, relay=self._config.relay,
                             backend=resolve_backend(self._config.backend, self._config.device), device=self._config.device)
        self._close_host()
        self._host = host_channel(spec, bind_host=self._config.bind_host, port_range=self._config.port_range)
        raw = self._host.spec.to_bytes()
        refs = [a.open_transport.remote(OpenChannel(owner=self.owner, spec=raw, plan=self._plan_bytes, index=i,
                                                    secret=self._secret, check_served=self._config.check_served))
                for group in (trainers, engines) for i, a in enumerate(group)]
        try:
            call_all(refs, [*trainer_names, *engine_names], "open_transport", timeout + 30.0)
        except BaseException:
            self.close([*trainers, *engines])
            raise
        self.open_now = True

    def close_senders(self, trainers: Sequence) -> None:
        """Close the trainers' sides: a send blocked on the channel fails, and receivers waiting for
        frames see the senders gone (shm within ~0.2 s, the object store within its poll)."""
        self.close(trainers)

    def close(self, actors: Sequence) -> None:
        """Close these actors' sides (best effort, bounded; a dead actor is skipped)."""
        settle([a.close_transport.remote(self.owner) for a in actors], [""] * len(actors), "close_transport",
               CLOSE_TIMEOUT_S)
        self.open_now = False

    def close_host(self) -> None:
        """Stop serving the channel (after every side closed)."""
        self._close_host()

    def _close_host(self) -> None:
        if self._host is not None:
            self._host.close()
            self._host = None
