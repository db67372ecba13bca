"""A leg is a lease: the rotation counted it in flight when it chose the instance, and it goes
back exactly once, with at most one outcome (success, or a failure of some kind) recorded.

    pair = rotation.plan(features, avoid) or await rotation.wait_for_pair(features, avoid)
    lease = lease_pair(rotation, pair)
    with lease:                                    # gives back whatever is still held
        with lease.decode.watch("answer", limit):  # stamps the start; failures -> LegFailed
            ...
        lease.decode.succeeded()

(Classes with __slots__ and a hand-written __init__, no contextlib: three objects per request
on the hot path; docs/performance.md, "Context managers as classes".)
"""

from __future__ import annotations

from types import TracebackType

from pdproxy.base.roles import Role
from pdproxy.pairing.features import RequestFeatures
from pdproxy.pairing.planner import Pair
from pdproxy.proxy.failures import LegFailed, classify, leg_failed
from pdproxy.proxy.rotation import Rotation
from pdproxy.registry.messages import Connector
from pdproxy.registry.table import Instance
from pdproxy.reliability.failures import FAILURES, FailureKind


class LegLease:
    """One leg on one instance. `with leg.watch(waiting, limit):` around sending it and reading
    its answer; `waiting`/`limit` say what it waits for now (a timeout's message), `answered`
    whether any answer arrived (after that it is never retried)."""

    __slots__ = (
        "_held",
        "_rotation",
        "_settled",
        "answered",
        "began",
        "instance",
        "limit",
        "role",
        "tokens",
        "waiting",
    )

    def __init__(self, rotation: Rotation, role: Role, instance: Instance, tokens: int) -> None:
        self._rotation = rotation
        self.role = role
        self.instance = instance
        self.tokens = tokens  # the work the planner counts in flight until released
        # On the rotation's clock: outcomes of legs begun before an ejection are moot.
        self.began = 0.0
        self.waiting = ""
        self.limit = 0.0
        self.answered = False
        self._held = True
        self._settled = False

    def watch(self, waiting: str, limit: float) -> LegLease:
        self.waiting = waiting
        self.limit = limit
        return self

    def __enter__(self) -> LegLease:
        self.began = self._rotation.now()
        self._rotation.metrics.leg_started(self.role, self.instance.name)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._rotation.metrics.leg_finished(self.role, self.instance.name)
        if exc is None:
            return
        kind = classify(exc)
        if kind is None:
            return  # not the leg's failure (a cancellation, the client gone...)
        if kind is FailureKind.TIMEOUT:
            detail = f"no {self.waiting} within {self.limit:g}s"
        else:
            detail = str(exc)
        raise self.failed(kind, detail) from None

    def succeeded(self) -> None:
        """The answer proved usable (or was the instance's own 4xx refusal)."""
        if not self._settled:
            self._settled = True
            self._rotation.succeeded(self.role, self.instance, self.began)

    def failed(self, kind: FailureKind, detail: str) -> LegFailed:
        """Count and blame (per FAILURES) the leg's first outcome; the error to raise."""
        rotation = self._rotation
        if not self._settled:
            self._settled = True
            rotation.metrics.leg_failed(self.role, kind)
            if FAILURES[kind].blames_instance:
                rotation.failed(self.role, self.instance, self.began)
        return leg_failed(
            kind, self.role, self.instance.name, detail, self.answered, rotation.retry_after
        )

    def release(self) -> None:
        """Give the leg's place back (idempotent): an early release frees the instance for
        others while the request goes on."""
        if self._held:
            self._held = False
            self._rotation.release(self.instance.http_address, self.tokens)


class PairLease:
    """The legs of one attempt; `with lease:` releases those still held. No prefill leg when
    the decode instance computes a short prompt itself (`lease_direct`)."""

    __slots__ = ("connector", "decode", "prefill")

    def __init__(
        self, prefill: LegLease | None, decode: LegLease, connector: Connector | None
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.connector = connector

    def __enter__(self) -> PairLease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if self.prefill is not None:
                self.prefill.release()
        finally:
            self.decode.release()


def lease_pair(rotation: Rotation, pair: Pair) -> PairLease:
    """The legs of a pair the rotation chose, taken over before any await (a plain function,
    not a coroutine wrapping the choice: docs/performance.md, "Context managers as
    classes")."""
    return PairLease(
        LegLease(rotation, Role.PREFILL, pair.prefill, pair.prefill_tokens),
        LegLease(rotation, Role.DECODE, pair.decode, pair.decode_tokens),
        pair.connector,
    )


def lease_direct(
    rotation: Rotation, features: RequestFeatures, avoid: frozenset[str]
) -> PairLease | None:
    """A decode leg alone, if an instance is free now; None: use a pair."""
    direct = rotation.choose_direct(features, avoid)
    if direct is None:
        return None
    return PairLease(
        None, LegLease(rotation, Role.DECODE, direct.decode, direct.decode_tokens), None
    )


def lease_one(rotation: Rotation, role: Role, instance: Instance) -> LegLease:
    """The leg of a request served by one instance alone (`rotation.choose_one`'s choice);
    `with` it, and `release()` it once done."""
    return LegLease(rotation, role, instance, 0)
