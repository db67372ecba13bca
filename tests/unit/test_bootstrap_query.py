"""The engine id in a mooncake bootstrap server's /query answer (pdproxy.proxy.bootstrap)."""

from __future__ import annotations

import orjson
import pytest

from pdproxy.proxy.bootstrap import BootstrapError, engine_id_from_query


def query(answer: object) -> bytes:
    return orjson.dumps(answer)


def test_the_lowest_data_parallel_ranks_engine_is_named() -> None:
    # vLLM's MooncakeBootstrapServer.query: {dp rank: {"engine_id", "worker_addr": {tp: {pp}}}}.
    answer = {
        "1": {"engine_id": "engine-b", "worker_addr": {"0": {"0": "10.0.0.5:7001"}}},
        "0": {"engine_id": "engine-a", "worker_addr": {"0": {"0": "10.0.0.5:7000"}}},
    }
    assert engine_id_from_query(query(answer)) == "engine-a"


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"<html>", "not JSON"),
        (query([1]), "not a JSON object"),
        (query({}), "no prefill worker has registered"),
        (query({"zero": {"engine_id": "e"}}), "not an integer"),
        (query({"0": {"worker_addr": {}}}), "no engine_id"),
        (query({"0": {"engine_id": ""}}), "no engine_id"),
        (query({"0": "e"}), "no engine_id"),
    ],
)
def test_an_answer_without_a_usable_engine_id_is_refused(body: bytes, why: str) -> None:
    with pytest.raises(BootstrapError, match=why):
        engine_id_from_query(body)
