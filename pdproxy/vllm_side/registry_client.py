"""The ZMQ DEALER that carries registry messages to one proxy replica, never blocking its
caller (FanOutClient holds one per replica).

Used from a plain thread (inside vLLM's engine process, or by the `pdproxy announce` loop), so it
is synchronous. A registry that is down must not make messages pile up or stall the worker:
the send queue is tiny and a full queue drops the message (the next period sends a fresh one).
"""

from __future__ import annotations

from typing import Any

import zmq

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
