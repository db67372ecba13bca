"""How a leg can fail, and what each kind of failure means: one table. Pure.

Each kind says where it came from (Envoy's distinction between local and upstream failures:
`saturated` is the proxy's own congestion, no instance's fault), whether another instance may
be tried instead, whether it counts against the instance's health, and what the client hears.
The values are metric labels (the `reason` of pdproxy_upstream_errors and pdproxy_retries; a
local kind is counted in pdproxy_saturated_legs instead) and error codes: they are part of the
API.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType


class FailureKind(StrEnum):
    CONNECT = "connect"
    CONNECT_TIMEOUT = "connect_timeout"
    RESET = "reset"
    PROTOCOL = "protocol"
    TIMEOUT = "timeout"
    STATUS_5XX = "status_5xx"
    # A stream answered 200, then failed before its first token: vLLM's error event.
    STREAM_ERROR = "stream_error"
    NO_KV_TRANSFER_PARAMS = "no_kv_transfer_params"
    BOOTSTRAP_QUERY = "bootstrap_query"  # a mooncake prefill's bootstrap /query failed
    STATUS_OTHER = "status_other"
    TOO_LARGE = "too_large"
    SATURATED = "saturated"


class Origin(StrEnum):
    LOCAL = "local"  # the proxy's own limits: nobody is blamed, nothing is retried
    UPSTREAM = "upstream"  # the instance, or the exchange with it


class FailurePolicy:
    """What one kind of failure means. (Not a dataclass: docs/performance.md, "Dataclass
    constructors".)"""

    __slots__ = ("blames_instance", "origin", "retried", "status")

    def __init__(self, origin: Origin, retried: bool, blames_instance: bool, status: int) -> None:
        self.origin = origin
        self.retried = retried  # another pair may serve the request, if no byte reached the client
        self.blames_instance = blames_instance  # feeds the outlier detector
        self.status = status  # what the client hears when it is the last failure

    def __repr__(self) -> str:
        return (
            f"FailurePolicy({self.origin}, retried={self.retried}, "
            f"blames_instance={self.blames_instance}, status={self.status})"
        )


# The instance is down, overloaded, hung or broke the exchange, before any answer: another
# instance may well succeed, and each counts against the instance's health.
_INSTANCE_FAULT = FailurePolicy(Origin.UPSTREAM, retried=True, blames_instance=True, status=502)
# The answer itself is the problem (another instance would produce it too: too_large), or an
# odd status (1xx/3xx) that says nothing about health.
_NOT_HEALTH = FailurePolicy(Origin.UPSTREAM, retried=False, blames_instance=False, status=502)

FAILURES: Mapping[FailureKind, FailurePolicy] = MappingProxyType(
    {
        FailureKind.CONNECT: _INSTANCE_FAULT,
        FailureKind.CONNECT_TIMEOUT: _INSTANCE_FAULT,
        FailureKind.RESET: _INSTANCE_FAULT,
        FailureKind.PROTOCOL: _INSTANCE_FAULT,
        FailureKind.STATUS_5XX: _INSTANCE_FAULT,
        # What a whole answer's 5xx is to a stream (proxy/stream_opening.py).
        FailureKind.STREAM_ERROR: _INSTANCE_FAULT,
        # Without kv_transfer_params the decode cannot know where the KV is.
        FailureKind.NO_KV_TRANSFER_PARAMS: _INSTANCE_FAULT,
        # Without the engine id the decode cannot name the prefill's KV (a prefill restarted
        # or its bootstrap server is down): another prefill may serve.
        FailureKind.BOOTSTRAP_QUERY: _INSTANCE_FAULT,
        # A leg that ran out of time is a gateway timeout (the P2pNccl id-suffix hang of vLLM
        # >= 0.14 shows up as the decode's first byte never coming).
        FailureKind.TIMEOUT: FailurePolicy(
            Origin.UPSTREAM, retried=True, blames_instance=True, status=504
        ),
        FailureKind.STATUS_OTHER: _NOT_HEALTH,
        FailureKind.TOO_LARGE: _NOT_HEALTH,
        # No free upstream slot, or no descriptor/port left: 503 with Retry-After.
        FailureKind.SATURATED: FailurePolicy(
            Origin.LOCAL, retried=False, blames_instance=False, status=503
        ),
    }
)

RETRIED_KINDS = frozenset(kind for kind, policy in FAILURES.items() if policy.retried)
