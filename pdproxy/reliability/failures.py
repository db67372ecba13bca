"""Which failures of a leg are the instance's, and which may be retried elsewhere. Pure."""

from __future__ import annotations

# Failures before any answer: the instance is down, overloaded, hung or broke the exchange.
# Another instance may well succeed, and each counts against the instance's health.
RETRYABLE_KINDS = frozenset(
    (
        "connect",
        "connect_timeout",
        "reset",
        "protocol",
        "timeout",
        "status_5xx",
        "no_kv_transfer_params",
    )
)
# saturated: the proxy's own congestion, no instance's fault; too_large: the answer itself is
# the problem, another instance would produce it too; status_other: an odd status (1xx/3xx)
# that says nothing about health.


def is_retryable(kind: str) -> bool:
    return kind in RETRYABLE_KINDS


def counts_against_instance(kind: str) -> bool:
    return kind in RETRYABLE_KINDS
