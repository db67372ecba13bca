"""schemathesis against a live proxy: every operation of its OpenAPI document, valid and
invalid inputs, and no 5xx the proxy caused itself."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks
from schemathesis.generation import GenerationMode

from pdproxy.demo.fleet import LocalFleet, WorkerSpec
from pdproxy.demo.processes import http_json
from pdproxy.proxy.openapi import openapi_document


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    # Static instances without a model: any model name reaches an instance, so a 503 for an
    # unknown model cannot hide a real server error; the fake worker then answers 404 itself.
    fleet = LocalFleet(
        tmp_path_factory.mktemp("schemathesis"),
        [WorkerSpec("P", announce="static"), WorkerSpec("D", announce="static")],
        proxy_args=["--max-body-bytes", "65536"],
    ).start()
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def api_schema(fleet: LocalFleet) -> schemathesis.BaseSchema:
    served = http_json(fleet.proxy_url + "/openapi.json")
    assert served == openapi_document()
    return schemathesis.openapi.from_dict(served)


CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
]
EXCLUDED = [
    checks.negative_data_rejection,
    checks.positive_data_acceptance,
    checks.missing_required_header,
    checks.unsupported_method,
    checks.ignored_auth,
    checks.use_after_free,
    checks.ensure_resource_availability,
]


def operations() -> list[tuple[str, str, GenerationMode]]:
    """Every operation with valid inputs; those that take inputs also with invalid ones
    (an operation without parameters or body has no invalid input)."""
    cases = []
    for path, item in openapi_document()["paths"].items():
        for method, operation in item.items():
            if method == "parameters":
                continue
            cases.append((path, method, GenerationMode.POSITIVE))
            if "requestBody" in operation or "parameters" in item:
                cases.append((path, method, GenerationMode.NEGATIVE))
    return cases


@pytest.mark.parametrize(("path", "method", "mode"), operations())
def test_no_server_errors_and_documented_answers(
    api_schema: schemathesis.BaseSchema,
    fleet: LocalFleet,
    path: str,
    method: str,
    mode: GenerationMode,
) -> None:
    """Valid inputs (positive) and inputs that break the schema (negative)."""
    operation = api_schema[path][method.upper()]
    calls = 0

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=50,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def call(case: schemathesis.Case[Any]) -> None:
        nonlocal calls
        calls += 1
        case.call_and_validate(
            base_url=fleet.proxy_url, timeout=30, checks=CHECKS, excluded_checks=EXCLUDED
        )

    call()
    assert calls > 0
