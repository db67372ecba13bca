"""The one place a leg's failure is named: what the transport raised, or what the instance
answered, becomes a FailureKind; what that kind means is reliability/failures.py's table.

Classifying has no side effects: counting, blaming and retrying are the lease's and the
dispatcher's jobs.
"""

from __future__ import annotations

from pdproxy.base.roles import Role
from pdproxy.http.upstream import Transport, UpstreamError
from pdproxy.proxy.errors import ProxyError
from pdproxy.reliability.failures import FAILURES, FailureKind, Origin

_TRANSPORT: dict[Transport, FailureKind] = {
    Transport.CONNECT: FailureKind.CONNECT,
    Transport.CONNECT_TIMEOUT: FailureKind.CONNECT_TIMEOUT,
    Transport.RESET: FailureKind.RESET,
    Transport.PROTOCOL: FailureKind.PROTOCOL,
    Transport.TOO_LARGE: FailureKind.TOO_LARGE,
    Transport.SATURATED: FailureKind.SATURATED,
}


def classify(failure: BaseException | int) -> FailureKind | None:
    """The kind of a leg's failure: an exception out of the exchange, or the instance's HTTP
    status. None: not a failure of the leg (a 2xx or 4xx answer, a cancellation...)."""
    if isinstance(failure, int):
        if 200 <= failure < 300 or 400 <= failure < 500:
            return None
        return FailureKind.STATUS_5XX if failure >= 500 else FailureKind.STATUS_OTHER
    if isinstance(failure, TimeoutError):  # a leg's deadline (Deadline turns it into this)
        return FailureKind.TIMEOUT
    if isinstance(failure, UpstreamError):
        return _TRANSPORT[failure.kind]
    return None


def is_local(failure: BaseException) -> bool:
    """Whether `failure` is the proxy's own limit (nobody's health is in question)."""
    kind = classify(failure)
    return kind is not None and FAILURES[kind].origin is Origin.LOCAL


class LegFailed(ProxyError):
    """A leg failed; `retryable` if another pair may serve the request instead."""

    def __init__(
        self, error: ProxyError, role: Role, instance: str, kind: FailureKind, retryable: bool
    ) -> None:
        super().__init__(
            error.status, error.message, code=error.code, param=error.param, headers=error.headers
        )
        self.role = role
        self.instance = instance
        self.kind = kind
        self.retryable = retryable


def leg_failed(
    kind: FailureKind,
    role: Role,
    instance: str,
    detail: str,
    answered: bool,
    retry_after: tuple[tuple[bytes, bytes], ...],
) -> LegFailed:
    """What the client hears about a failed leg (if it is the last failure), per FAILURES;
    `answered`: some of the answer had arrived, so the leg is not retried."""
    policy = FAILURES[kind]
    headers = retry_after if policy.status == 503 else ()
    if policy.origin is Origin.LOCAL:
        error = ProxyError(
            policy.status, f"pdproxy is {kind}: {detail}", code=kind.value, headers=headers
        )
    else:
        error = ProxyError(
            policy.status,
            f"{role} instance {instance} failed: {detail}",
            code=f"{role}_{kind}",
            headers=headers,
        )
    return LegFailed(error, role, instance, kind, policy.retried and not answered)
