"""Checks of ``SyncConfig``'s fields kept out of ``api.py``: field kinds, listen address and port range (each
raises ``ValueError`` naming the field, its value and the fix)."""

from __future__ import annotations


def check_listen(bind_host: str, port_range: tuple[int, int] | None) -> None:
    """Raises ValueError unless ``bind_host`` is a local address and ``port_range`` two ports, first <= last."""
    import socket

    if bind_host in ("", "0.0.0.0", "::"):
        raise ValueError(f"SyncConfig.bind_host={bind_host!r} would listen on every interface; give this host's "
                         "address that the trainers and engines reach (default 127.0.0.1)")
    try:
        socket.getaddrinfo(bind_host, None)
    except OSError as exc:
        raise ValueError(f"SyncConfig.bind_host={bind_host!r} does not resolve ({exc}); give an address of this host") from None
    if port_range is not None and not (len(port_range) == 2 and all(type(p) is int and 1 <= p <= 65535 for p in port_range)
                                       and port_range[0] <= port_range[1]):
        raise ValueError(f"SyncConfig.port_range={port_range!r} must be (first, last) ports in [1, 65535] with "
                         "first <= last, or None for a free port the OS picks")


def is_kind(value, kinds: tuple) -> bool:
    """Whether ``value`` is one of ``kinds`` (``None`` allows None; a bool counts only where ``bool`` is listed)."""
    if value is None:
        return None in kinds
    if isinstance(value, bool):
        return bool in kinds
    return any(k is not None and isinstance(value, k) for k in kinds)


def short_repr(value, limit: int = 80) -> str:
    """``repr(value)``, cut at ``limit`` characters (error messages stay one line)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"
