"""Sends registry messages over a ZMQ DEALER, never blocking its caller.

Used from a plain thread (inside vLLM's engine process, or by the `pdproxy announce` loop), so it
is synchronous. A registry that is down must not make messages pile up or stall the worker:
the send queue is tiny and a full queue drops the message (the next period sends a fresh one).
"""

from __future__ import annotations

import logging
from typing import Any

import msgpack
import zmq

log = logging.getLogger("pdproxy.vllm_side")

SEND_QUEUE = 4
LINGER_MS = 500  # long enough for a final "leave" to get out, short enough to exit promptly


def registry_socket(context: zmq.Context[Any], endpoint: str, identity: str) -> zmq.Socket[Any]:
    """A DEALER connected to `endpoint` ("tcp://..."): a tiny send queue, a short linger."""
    sock: zmq.Socket[Any] = context.socket(zmq.DEALER)
    # The registry's ROUTER sees this as the identity frame, as with stock vLLM.
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.SNDHWM, SEND_QUEUE)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.IPV6, 1)  # an AAAA address, or a name ZMQ resolves to one
    sock.connect(endpoint)
    return sock


class RegistryClient:
    def __init__(self, registry_address: str, identity: str) -> None:
        self._context: zmq.Context[Any] = zmq.Context()
        self._socket = registry_socket(self._context, f"tcp://{registry_address}", identity)
        self._registry = registry_address

    def send(self, message: dict[str, Any]) -> bool:
        """Queue one message; False (and nothing queued) when the queue is full."""
        try:
            self._socket.send(msgpack.packb(message), flags=zmq.NOBLOCK)
        except zmq.Again:
            log.debug("registry %s not reachable: %s dropped", self._registry, message.get("op"))
            return False
        return True

    def close(self) -> None:
        self._socket.close(LINGER_MS)
        self._context.term()
