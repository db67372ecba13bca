"""What the registry process tells the HTTP workers, and what they ask of it (`--workers` > 1).

The registry process owns the table and the drained set; every HTTP worker holds a copy it
replaces with each published `SharedState`. Each prefill's announced work is forwarded on its own
as a `WorkReport` the moment it arrives: the table's copy comes far too seldom to place prompts
by it. Operator actions (the admin API) reach the owner as
a `ControlRequest` and are answered by a `ControlReply` naming the revision that shows them.

Both travel as pickles over ipc sockets inside a directory only the proxy's own user can enter
(created 0700 by the supervisor): the peers are this program's own processes, so the bytes are
as trusted as the process itself. Nothing from the network is ever unpickled.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import TypeVar

from pdproxy.ids import Address
from pdproxy.registry.operator import AdminState, ControlReply, ControlRequest
from pdproxy.registry.table import Registration


@dataclass(frozen=True, slots=True)
class SharedState:
    revision: int  # rises with every change, across restarts of the registry process
    entries: tuple[Registration, ...]
    drained: frozenset[str]


@dataclass(frozen=True, slots=True)
class WorkReport:
    """A prefill's announced work (`Load.prefill_tokens`), as the registry process heard it."""

    address: Address  # the prefill's HTTP address
    prefill_tokens: int


_T = TypeVar("_T")


def encode(value: SharedState | WorkReport | ControlRequest | ControlReply | AdminState) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes, kind: type[_T]) -> _T:
    value = pickle.loads(data)  # our own processes only (see the module's doc)
    if not isinstance(value, kind):
        raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
    return value
