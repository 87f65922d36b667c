"""Test hosts, not on the sync path (the tests and ``bench --link`` use them): hosts on one machine
(network namespaces, a shaped trainers' uplink) and a Ray cluster across them.

``hosts``: ``NamespaceHosts`` builds the namespaces and tears them down; ``ray_nodes``: ``RayHosts``
runs one Ray node per namespace host. See each module's docstring for an example.
"""

from sync_service.netns.hosts import (Host, HostsConfig, HostsError, Listener, NamespaceHosts, WireBytes, available,
                                      cleanup_stale, host_from_dict, listeners, parse_rate, set_link, wire_bytes)
from sync_service.netns.ray_nodes import RayHosts, RayHostsConfig, wait_for_nodes

__all__ = ["Host", "HostsConfig", "HostsError", "Listener", "NamespaceHosts", "WireBytes", "available",
           "RayHosts", "RayHostsConfig",
           "cleanup_stale", "host_from_dict", "listeners", "parse_rate", "set_link", "wait_for_nodes", "wire_bytes"]
