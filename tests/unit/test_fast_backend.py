"""The benchmark backend's streams: with `return_token_ids` they carry ids where vLLM puts them,
so pdproxy's migrating relay does the work it does in front of vLLM."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from pdproxy.proxy.migration_stream import StreamLedger
from tests.harness.benchmark_scripts import benchmark_script


@pytest.fixture(scope="module")
def backend() -> Iterator[Any]:
    with benchmark_script("fast_backend") as module:
        yield module


@pytest.mark.parametrize("chat", [False, True])
def test_streams_carry_token_ids_only_when_asked(backend: Any, chat: bool) -> None:
    plain = b"".join(backend._stream_events(chat, "m", 4))
    assert b"token_ids" not in plain
    events = backend._stream_events(chat, "m", 4, token_ids=True)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    first = chunks[0] if chat else chunks[0]["choices"][0]
    assert first["prompt_token_ids"] == [1, 2]
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[100], [101], [102], [103]]
    # Read as pdproxy reads a vLLM stream: ids kept, then taken out for the client.
    ledger = StreamLedger(chat, False, False, 1 << 20)
    relayed = ledger.feed(b"".join(events))
    assert ledger.prompt_ids == [1, 2] and ledger.generated == [100, 101, 102, 103]
    assert ledger.migratable and ledger.done and b"token_ids" not in relayed
