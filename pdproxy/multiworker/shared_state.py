"""What the registry process tells the HTTP workers, and what they ask of it (`--workers` > 1).

The registry process owns the table and the drained set; every HTTP worker holds a copy it
replaces with each published `SharedState`. Operator actions (the admin API) reach the owner as
a `ControlRequest` and are answered by a `ControlReply` naming the revision that shows them.

Both travel as pickles over ipc sockets inside a directory only the proxy's own user can enter
(created 0700 by the supervisor): the peers are this program's own processes, so the bytes are
as trusted as the process itself. Nothing from the network is ever unpickled.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

from pdproxy.ids import Address
from pdproxy.registry.table import Instance, Registration


@dataclass(frozen=True, slots=True)
class SharedState:
    revision: int  # rises with every change, across restarts of the registry process
    entries: tuple[Registration, ...]
    drained: frozenset[str]


class Operation(StrEnum):
    REGISTER = "register"
    REMOVE = "remove"
    DRAIN = "drain"
    UNDRAIN = "undrain"


@dataclass(frozen=True, slots=True)
class ControlRequest:
    operation: Operation
    instance: Instance | None = None  # REGISTER
    address: Address | None = None  # REMOVE, DRAIN, UNDRAIN
    # time.monotonic() (one clock for all processes of the host) past which the worker has
    # answered 503: a request that reaches the registry process later is never applied.
    expires_at: float = math.inf


@dataclass(frozen=True, slots=True)
class ControlReply:
    done: bool  # False: nothing to remove, drain or undrain
    revision: int
    refusal: str | None = None  # REGISTER refused (the registry is full, a static conflict)
    unavailable: str | None = None  # not applied at all, try again later (and why)


@dataclass(frozen=True, slots=True)
class AdminState:
    """What only an operator said, kept in the shared directory so that a registry process
    started again knows it: instances registered through the admin API, the drained set."""

    registered: tuple[Instance, ...]
    drained: frozenset[str]


_T = TypeVar("_T")


def encode(value: SharedState | ControlRequest | ControlReply | AdminState) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes, kind: type[_T]) -> _T:
    value = pickle.loads(data)  # our own processes only (see the module's doc)
    if not isinstance(value, kind):
        raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
    return value
