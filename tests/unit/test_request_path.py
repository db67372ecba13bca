"""The dispatcher's retry, blame and re-pair rules, leases, the rotation and the admission,
in-process: the real CompletionsEndpoint, Dispatcher, Admission, Rotation, RegistryTable,
Planner and OutlierDetector over a scripted upstream.

The scripted upstream has the Upstream's three calls and answers per a script for each
instance: it fakes the transport (what came back over the socket), never a decision. The
process-fleet tests (tests/integration) cover the same rules over real sockets.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, cast

import orjson
import pytest

from pdproxy.config import Settings
from pdproxy.http.alarms import Alarms
from pdproxy.http.upstream import Reply, Transport, UpstreamClient, UpstreamError
from pdproxy.ids import Address
from pdproxy.metrics import Metrics
from pdproxy.proxy.admission import Admission
from pdproxy.proxy.completions import CompletionsEndpoint
from pdproxy.proxy.dispatch import Dispatcher
from pdproxy.proxy.lease import lease_pair
from pdproxy.proxy.rotation import Rotation
from pdproxy.proxy.state import outlier_policy, planner_from
from pdproxy.registry.table import Instance, RegistryTable
from pdproxy.reliability.failures import FAILURES, FailureKind
from pdproxy.reliability.outlier import OutlierDetector
from pdproxy.tracing.spans import build_tracing
from tests.pairing_builders import NIXL, dec, pre

PATH = "/v1/completions"
BODY = {"model": "m", "prompt": "tell me a story", "max_tokens": 4}
CHUNK = b'data: {"choices": [{"text": "once"}]}\n\n'


def in_loop(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test on a fresh event loop (pytest sees the test's own parameters)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(test(*args, **kwargs), 30))

    return run


async def until(condition: Callable[[], bool]) -> None:
    """Let the other tasks run until `condition` holds (bounded)."""
    for _ in range(5000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the condition never held")


class Step:
    """What one call to an instance gets back."""

    def __init__(
        self,
        status: int = 200,
        body: bytes = b'{"choices": [{"text": "ok"}]}',
        error: Transport | None = None,
        gate: asyncio.Event | None = None,
        chunks: tuple[bytes, ...] = (CHUNK, b"data: [DONE]\n\n"),
        cut: Transport | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.error = error  # raised before any answer
        self.gate = gate  # the answer waits for it (an unset one: the instance hangs)
        self.chunks = chunks
        self.cut = cut  # raised after the first chunk of a stream

    async def wait(self) -> None:
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise UpstreamError(self.error, f"scripted {self.error}")


def fails(kind: Transport) -> Step:
    return Step(error=kind)


def hangs() -> Step:
    return Step(gate=asyncio.Event())


class _Stream:
    def __init__(self, step: Step) -> None:
        self.status = step.status
        self.content_type = b"application/json"
        self._step = step
        self._chunks = list(step.chunks)
        self._sent = 0

    async def read_all(self, limit: int) -> bytes:
        return self._step.body

    async def next_chunk(self) -> bytes:
        if self._step.cut is not None and self._sent == 1:
            raise UpstreamError(self._step.cut, "scripted cut")
        self._sent += 1
        return self._chunks.pop(0) if self._chunks else b""


class ScriptedUpstream:
    """Upstream's post/get/stream; each instance answers its script's steps in order, then
    200 OK. `calls` records (instance, method) in order."""

    def __init__(self) -> None:
        self.script: dict[str, list[Step]] = {}
        self.calls: list[str] = []
        self.congested = False

    def answer(self, instance: Instance, *steps: Step) -> None:
        self.script.setdefault(instance.name, []).extend(steps)

    def _next(self, address: Address) -> Step:
        name = str(address)
        self.calls.append(name)
        steps = self.script.get(name)
        return steps.pop(0) if steps else Step()

    async def post(
        self, address: Address, path: str, body: bytes, headers: dict[str, str], limit: int
    ) -> Reply:
        step = self._next(address)
        await step.wait()
        return Reply(step.status, b"application/json", step.body)

    async def get(self, address: Address, path: str, headers: dict[str, str], limit: int) -> Reply:
        return await self.post(address, path, b"", headers, limit)

    @asynccontextmanager
    async def stream(
        self, method: str, address: Address, path: str, body: bytes, headers: dict[str, str]
    ) -> AsyncIterator[_Stream]:
        step = self._next(address)
        await step.wait()
        yield _Stream(step)


class Proxy:
    """The request path as build_state assembles it, minus sockets."""

    def __init__(self, instances: list[Instance], **options: Any) -> None:
        options = {"retry_backoff_base_seconds": 0.0, "retry_backoff_max_seconds": 0.0} | options
        self.settings = settings = Settings(**options)
        self.metrics = Metrics()
        self.table = RegistryTable(settings.ttl, settings.max_instances)
        for instance in instances:
            self.table.add_static(instance, time.monotonic())
        self.planner = planner_from(settings)
        self.outliers = OutlierDetector(outlier_policy(settings))
        self.admission = Admission(
            settings.max_inflight_requests,
            settings.max_queued_requests,
            settings.queue_timeout,
            settings.retry_after_seconds,
            self.metrics,
        )
        self.rotation = Rotation(
            settings,
            self.table,
            self.planner,
            self.outliers,
            self.admission,
            self.metrics,
            time.monotonic,
        )
        self.upstream = ScriptedUpstream()
        self.alarms = Alarms(asyncio.get_running_loop())
        tracing = build_tracing("none", lambda: "0" * 16)
        upstream = cast(UpstreamClient, self.upstream)  # the transport is scripted, nothing else
        self.dispatcher = Dispatcher(
            settings, self.rotation, upstream, self.metrics, tracing, self.alarms
        )
        self.endpoint = CompletionsEndpoint(
            PATH, settings, self.dispatcher, self.admission, self.metrics, self.alarms
        )

    async def post(self, body: dict[str, Any] = BODY) -> Answer:
        answer = Answer()
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": orjson.dumps(body), "more_body": False}
            await asyncio.Event().wait()  # the client never leaves
            raise AssertionError("unreachable")

        scope = {"type": "http", "method": "POST", "path": PATH, "headers": []}
        await self.endpoint(scope, receive, answer.send)
        return answer

    def count(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def consecutive_failures(self, instance: Instance) -> int:
        return self.outliers.status(instance.name, time.monotonic()).consecutive_failures

    def assert_all_released(self) -> None:
        """Every leg's lease went back (the planner counts none in flight), every admission
        slot too."""
        assert self.planner.inflight.total_requests() == 0
        assert self.planner.full == frozenset()
        assert (self.admission.active, self.admission.waiting) == (0, 0)
        assert self.count("pdproxy_admitted_requests") == 0


class Answer:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.body = b""

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = dict(message["headers"])
        else:
            self.body += message.get("body", b"")

    def code(self) -> str | None:
        code: str | None = orjson.loads(self.body)["error"]["code"]
        return code


P1, P2, D1, D2 = pre(1), pre(2), dec(1), dec(2)


@in_loop
async def test_a_failed_prefill_is_retried_on_another_prefill_and_blamed() -> None:
    proxy = Proxy([P1, P2, D1])
    proxy.upstream.answer(P1, *[fails(Transport.CONNECT)] * 4)
    tried_p1 = 0
    for _ in range(4):
        proxy.upstream.calls.clear()
        answer = await proxy.post()
        assert answer.status == 200, answer.body
        prefills = [c for c in proxy.upstream.calls if c != D1.name]
        if prefills[0] == P1.name:
            tried_p1 += 1
            assert prefills == [P1.name, P2.name]  # the new pair passes over the failed one
        else:
            assert prefills == [P2.name]
        proxy.assert_all_released()
    assert tried_p1 >= 1
    assert proxy.consecutive_failures(P1) == tried_p1
    assert proxy.count("pdproxy_retries_total", role="prefill", reason="connect") == tried_p1


@in_loop
async def test_a_decode_that_fails_before_answering_gets_a_new_pair_without_it() -> None:
    proxy = Proxy([P1, D1, D2])
    proxy.upstream.answer(D1, *[Step(status=500)] * 4)
    for _ in range(4):
        proxy.upstream.calls.clear()
        answer = await proxy.post()
        assert answer.status == 200, answer.body
        decodes = [c for c in proxy.upstream.calls if c != P1.name]
        assert decodes in ([D2.name], [D1.name, D2.name])
        # A new pair means a new prefill leg too (its KV went to the failed decode).
        assert proxy.upstream.calls.count(P1.name) == len(decodes)
    proxy.assert_all_released()


@pytest.mark.parametrize(
    ("step", "kind"),
    [
        (lambda: fails(Transport.CONNECT), FailureKind.CONNECT),
        (lambda: fails(Transport.CONNECT_TIMEOUT), FailureKind.CONNECT_TIMEOUT),
        (lambda: fails(Transport.RESET), FailureKind.RESET),
        (lambda: fails(Transport.PROTOCOL), FailureKind.PROTOCOL),
        (lambda: fails(Transport.TOO_LARGE), FailureKind.TOO_LARGE),
        (lambda: fails(Transport.SATURATED), FailureKind.SATURATED),
        (lambda: Step(status=502), FailureKind.STATUS_5XX),
        (lambda: Step(status=302), FailureKind.STATUS_OTHER),
        (hangs, FailureKind.TIMEOUT),
    ],
)
@in_loop
async def test_each_kind_is_answered_blamed_and_retried_per_the_table(
    step: Callable[[], Step], kind: FailureKind
) -> None:
    policy = FAILURES[kind]
    proxy = Proxy([P1, D1], max_attempts=2, connect_timeout=0.01, prefill_timeout=0.05)
    proxy.upstream.answer(P1, step(), step())
    answer = await proxy.post()
    assert answer.status == policy.status, answer.body
    local = kind is FailureKind.SATURATED
    assert answer.code() == (kind.value if local else f"prefill_{kind.value}")
    assert (b"retry-after" in answer.headers) == (policy.status == 503)
    attempts = 2 if policy.retried else 1
    assert proxy.upstream.calls == [P1.name] * attempts  # no decode leg after a failed prefill
    assert proxy.consecutive_failures(P1) == (attempts if policy.blames_instance else 0)
    # Each failure counted once: the proxy's own (local) in its family, else as an upstream's.
    errors = proxy.count("pdproxy_upstream_errors_total", role="prefill", reason=kind)
    saturated = proxy.count("pdproxy_saturated_legs_total", role="prefill")
    assert (errors, saturated) == ((0, attempts) if local else (attempts, 0))
    proxy.assert_all_released()


@in_loop
async def test_a_prefill_without_kv_transfer_params_is_blamed_and_retried() -> None:
    p1, d1 = pre(1, connector=NIXL), dec(1, connector=NIXL)
    proxy = Proxy([p1, d1], max_attempts=2)
    answer = await proxy.post()  # the scripted prefill answers without kv_transfer_params
    assert (answer.status, answer.code()) == (502, "prefill_no_kv_transfer_params")
    assert proxy.upstream.calls == [p1.name, p1.name]
    assert proxy.consecutive_failures(p1) == 2
    proxy.assert_all_released()


@in_loop
async def test_saturated_is_503_and_blames_nobody() -> None:
    proxy = Proxy([P1, P2, D1])
    proxy.upstream.answer(D1, fails(Transport.SATURATED))
    answer = await proxy.post()
    assert (answer.status, answer.code()) == (503, "saturated")
    assert answer.headers[b"retry-after"] == str(proxy.settings.retry_after_seconds).encode()
    assert proxy.upstream.calls.count(D1.name) == 1  # not retried
    assert all(proxy.consecutive_failures(i) == 0 for i in (P1, P2, D1))
    # Counted as the proxy's own saturation, never as an upstream error.
    assert proxy.count("pdproxy_saturated_legs_total", role="decode") == 1
    errors = proxy.metrics.registry.get_sample_value(
        "pdproxy_upstream_errors_total", {"role": "decode", "reason": "saturated"}
    )
    assert errors is None
    assert proxy.count("pdproxy_upstream_errors_total", role="decode", reason="connect") == 0
    proxy.assert_all_released()


@in_loop
async def test_no_retry_once_the_client_got_bytes() -> None:
    proxy = Proxy([P1, D1, D2])
    for decode in (D1, D2):
        proxy.upstream.answer(decode, Step(cut=Transport.RESET))
    answer = await proxy.post(BODY | {"stream": True})
    assert answer.status == 200
    assert answer.body.startswith(CHUNK)  # what the client already had stays
    assert b'"code":"decode_reset"' in answer.body and answer.body.endswith(b"data: [DONE]\n\n")
    decodes = [c for c in proxy.upstream.calls if c != P1.name]
    assert len(decodes) == 1  # the stream had begun: no second pair
    assert proxy.count("pdproxy_retries_total", role="decode", reason="reset") == 0
    # The failure still counts against the instance: it broke a stream under way.
    assert proxy.consecutive_failures({D1.name: D1, D2.name: D2}[decodes[0]]) == 1
    proxy.assert_all_released()


@in_loop
async def test_a_client_that_leaves_mid_leg_releases_both_legs() -> None:
    proxy = Proxy([P1, D1])
    proxy.upstream.answer(D1, hangs())
    request = asyncio.create_task(proxy.post())
    await until(lambda: D1.name in proxy.upstream.calls)
    assert proxy.planner.inflight.total_requests() == 1  # the prefill went back early
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    assert proxy.consecutive_failures(D1) == 0  # a cancellation is nobody's failure
    proxy.assert_all_released()


@in_loop
async def test_a_lease_goes_back_once_however_often_it_is_released() -> None:
    proxy = Proxy([P1, D1])
    features = proxy.dispatcher.features(_request())
    pair = proxy.rotation.plan(features, frozenset())
    assert pair is not None  # both instances are idle
    lease = lease_pair(proxy.rotation, pair)
    assert proxy.planner.inflight.total_requests() == 2
    with lease:
        assert lease.prefill is not None
        lease.prefill.release()
        lease.prefill.release()
        assert proxy.planner.inflight.total_requests() == 1
    lease.decode.release()
    proxy.assert_all_released()


@in_loop
async def test_a_legs_first_outcome_is_the_one_recorded() -> None:
    proxy = Proxy([P1, D1])
    features = proxy.dispatcher.features(_request())
    pair = proxy.rotation.plan(features, frozenset())
    assert pair is not None  # both instances are idle
    lease = lease_pair(proxy.rotation, pair)
    with lease:
        with lease.decode.watch("answer", 1.0):
            pass
        lease.decode.succeeded()
        lease.decode.failed(FailureKind.RESET, "after the fact")
    assert proxy.consecutive_failures(D1) == 0
    assert proxy.count("pdproxy_upstream_errors_total", role="decode", reason="reset") == 0
    proxy.assert_all_released()


@in_loop
async def test_a_request_waits_for_an_instance_at_its_cap_then_is_served() -> None:
    proxy = Proxy([P1, D1], instance_max_inflight=1, queue_timeout=5.0)
    gate = asyncio.Event()
    proxy.upstream.answer(D1, Step(gate=gate))
    first = asyncio.create_task(proxy.post())
    await until(lambda: D1.name in proxy.upstream.calls)
    second = asyncio.create_task(proxy.post())
    await until(lambda: proxy.admission.waiting > 0)
    gate.set()
    answers = await asyncio.gather(first, second)
    assert [a.status for a in answers] == [200, 200]
    assert proxy.upstream.calls == [P1.name, D1.name, P1.name, D1.name]
    proxy.assert_all_released()


@in_loop
async def test_admission_serves_waiting_requests_in_arrival_order() -> None:
    proxy = Proxy([P1, D1], max_inflight_requests=1, queue_timeout=5.0)
    gate = asyncio.Event()
    proxy.upstream.answer(D1, Step(gate=gate))
    bodies = [BODY | {"prompt": f"request {n}"} for n in range(4)]
    order: list[int] = []

    async def post(n: int) -> Answer:
        answer = await proxy.post(bodies[n])
        order.append(n)
        return answer

    first = asyncio.create_task(post(0))
    await until(lambda: D1.name in proxy.upstream.calls)
    waiting = []
    for n in (1, 2, 3):
        waiting.append(asyncio.create_task(post(n)))
        await until(functools.partial(lambda count: proxy.admission.waiting >= count, n))
    assert proxy.admission.active == 1
    assert proxy.count("pdproxy_admitted_requests") == 1
    gate.set()
    answers = await asyncio.gather(first, *waiting)
    assert [a.status for a in answers] == [200] * 4
    assert order == [0, 1, 2, 3]
    proxy.assert_all_released()


@in_loop
async def test_admission_times_out_a_waiting_request_and_refuses_beyond_the_queue() -> None:
    proxy = Proxy([P1, D1], max_inflight_requests=1, max_queued_requests=1, queue_timeout=0.2)
    gate = asyncio.Event()
    proxy.upstream.answer(D1, Step(gate=gate))
    first = asyncio.create_task(proxy.post())
    await until(lambda: D1.name in proxy.upstream.calls)
    queued = asyncio.create_task(proxy.post())
    await until(lambda: proxy.admission.waiting > 0)
    refused = await proxy.post()
    assert (refused.status, refused.code()) == (429, "queue_full")
    timed_out = await queued
    assert (timed_out.status, timed_out.code()) == (503, "queue_timeout")
    assert b"retry-after" in timed_out.headers
    assert (proxy.admission.active, proxy.admission.waiting) == (1, 0)
    gate.set()
    assert (await first).status == 200
    assert proxy.count("pdproxy_refused_requests_total", reason="queue_timeout") == 1
    proxy.assert_all_released()


@in_loop
async def test_a_slot_handed_to_a_waiter_that_gave_up_goes_on_to_the_next() -> None:
    proxy = Proxy([P1, D1], max_inflight_requests=1, queue_timeout=5.0)
    assert proxy.admission.try_enter()
    quitter = asyncio.create_task(proxy.post())
    await until(lambda: proxy.admission.waiting >= 1)
    patient = asyncio.create_task(proxy.post())
    await until(lambda: proxy.admission.waiting >= 2)
    proxy.admission.leave()  # hands the slot to the quitter
    quitter.cancel()  # before it could run: it must pass the slot on, not lose it
    with pytest.raises(asyncio.CancelledError):
        await quitter
    assert (await patient).status == 200
    assert proxy.upstream.calls == [P1.name, D1.name]  # the quitter sent no leg
    proxy.assert_all_released()


def _request() -> Any:
    from pdproxy.proxy.request import max_values, parse_completion

    return parse_completion(PATH, orjson.dumps(BODY), max_values(1 << 20))
