"""The failure table and the one place failures are classified."""

from __future__ import annotations

import pytest

from pdproxy.base.roles import Role
from pdproxy.http.upstream import Transport, UpstreamError
from pdproxy.proxy.failures import LegFailed, classify, is_local, leg_failed
from pdproxy.reliability.failures import FAILURES, RETRIED_KINDS, FailureKind, Origin

RETRY_AFTER = ((b"retry-after", b"2"),)


def test_every_kind_has_a_policy() -> None:
    assert set(FAILURES) == set(FailureKind)


@pytest.mark.parametrize(
    "kind",
    [
        "connect",
        "connect_timeout",
        "reset",
        "protocol",
        "timeout",
        "status_5xx",
        "no_kv_transfer_params",
    ],
)
def test_failures_of_the_instance_are_retried_and_blamed(kind: str) -> None:
    policy = FAILURES[FailureKind(kind)]
    assert policy.retried and policy.blames_instance and policy.origin is Origin.UPSTREAM
    assert kind in RETRIED_KINDS


@pytest.mark.parametrize("kind", ["saturated", "too_large", "status_other"])
def test_failures_that_are_not_the_instances_are_neither(kind: str) -> None:
    policy = FAILURES[FailureKind(kind)]
    assert not policy.retried and not policy.blames_instance


def test_only_saturated_is_the_proxys_own() -> None:
    local = {kind for kind, policy in FAILURES.items() if policy.origin is Origin.LOCAL}
    assert local == {FailureKind.SATURATED}


def test_every_transport_error_has_a_kind_of_the_same_name() -> None:
    for transport in Transport:
        assert classify(UpstreamError(transport, "x")) == FailureKind(transport.value)


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (200, None),
        (204, None),
        (400, None),
        (422, None),
        (500, FailureKind.STATUS_5XX),
        (503, FailureKind.STATUS_5XX),
        (302, FailureKind.STATUS_OTHER),
        (101, FailureKind.STATUS_OTHER),
    ],
)
def test_statuses(status: int, kind: FailureKind | None) -> None:
    assert classify(status) is kind


def test_a_deadline_is_a_timeout_and_other_exceptions_are_not_leg_failures() -> None:
    assert classify(TimeoutError()) is FailureKind.TIMEOUT
    assert classify(ValueError()) is None
    assert is_local(UpstreamError(Transport.SATURATED, "busy"))
    assert not is_local(UpstreamError(Transport.CONNECT, "refused"))
    assert not is_local(TimeoutError())


def test_client_statuses_and_codes_follow_the_table() -> None:
    timeout = leg_failed(FailureKind.TIMEOUT, Role.DECODE, "d1", "late", False, RETRY_AFTER)
    assert (timeout.status, timeout.code, timeout.retryable) == (504, "decode_timeout", True)
    assert timeout.headers == ()
    reset = leg_failed(FailureKind.RESET, Role.PREFILL, "p1", "gone", True, RETRY_AFTER)
    assert (reset.status, reset.code) == (502, "prefill_reset")
    assert not reset.retryable  # some of the answer had arrived
    assert reset.message == "prefill instance p1 failed: gone"


def test_saturated_is_503_with_retry_after_and_names_no_instance() -> None:
    failure = leg_failed(FailureKind.SATURATED, Role.PREFILL, "p1", "all busy", False, RETRY_AFTER)
    assert isinstance(failure, LegFailed)
    assert (failure.status, failure.code, failure.retryable) == (503, "saturated", False)
    assert failure.headers == RETRY_AFTER
    assert failure.message == "pdproxy is saturated: all busy"
