"""Which local address this host reaches a peer from: the address to advertise to it.

A UDP socket `connect` only asks the kernel for a route (no packet is sent), and the socket's
own name is then the source address of that route: 127.0.0.1 towards a registry on loopback,
the pod's address towards a registry in the cluster. vLLM's `get_ip` instead names the host's
first interface address, which a server listening on 127.0.0.1 does not answer on.
"""

from __future__ import annotations

import socket


def local_address_towards(host: str, port: int) -> str | None:
    """The local address of the route to `host:port`, or None when there is none (unknown
    name, no route)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, kind, proto, _name, peer in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(peer)
                return str(probe.getsockname()[0])
        except OSError:
            continue
    return None
