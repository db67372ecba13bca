"""The fake worker's transfer statistics: every KV failure it can record has an outcome, bytes
split over its ranks add up, and ids follow PdproxyConnector's naming from the request-id tag."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.base.endpoints import Endpoint
from pdproxy.base.roles import Role
from pdproxy.fake_vllm.config import Geometry, WorkerConfig
from pdproxy.fake_vllm.generation import Generation, Prompt
from pdproxy.fake_vllm.kv_stats import OUTCOMES, KvStats, split
from pdproxy.fake_vllm.records import KV_FAILURE_REASONS
from pdproxy.ids import Address
from pdproxy.registry.messages import TransferOutcome, parse_transfer
from pdproxy.vllm_side.announcement import TransferStat

UID = "0123456789abcdef0123456789abcdef"
TAGGED = f"___prefill_addr_127.0.0.1:21001___decode_addr_127.0.0.1:22001_{UID}"
CONFIG = WorkerConfig(
    role=Role.DECODE,
    http=Address("127.0.0.1", 8200),
    kv=Address("127.0.0.1", 22001),
    proxy=None,
    announce="v1",
    announce_interval_s=1.0,
    model="m",
    token_latency_s=0.0,
    prefill_latency_s=0.0,
    kv_timeout_s=1.0,
    max_model_len=4096,
    kv_capacity_tokens=65536,
    connector="pdproxy",
    geometry=Geometry(block_size=16),
)


def generation(tokens: int, chat: bool = False) -> Generation:
    return Generation(chat, (Prompt("x", tokens),), 4, False, False)


def test_every_failure_reason_has_an_outcome() -> None:
    assert set(OUTCOMES) == set(KV_FAILURE_REASONS)
    assert {OUTCOMES["timeout"], OUTCOMES["send_timeout"]} == {"timeout"}
    assert OUTCOMES["missing_transfer"] == "missing"
    assert set(OUTCOMES.values()) <= {o.value for o in TransferOutcome}


@settings(derandomize=True, database=None, deadline=None)
@given(total=st.integers(0, 2**53), ranks=st.integers(1, 64))
def test_bytes_split_over_ranks_add_up(total: int, ranks: int) -> None:
    parts = split(total, ranks)
    assert len(parts) == ranks and sum(parts) == total and min(parts) >= 0


def test_ids_follow_the_connector_naming() -> None:
    stats = KvStats(CONFIG)
    key = stats.key(TAGGED, generation(33))
    assert key is not None and (key.transfer_id, key.blocks) == (f"{UID}-0", 3)
    chat = stats.key(TAGGED, generation(16, chat=True))
    assert chat is not None and (chat.transfer_id, chat.blocks) == (f"{UID}-chat", 1)
    assert stats.key("plain-request-id", generation(5)) is None
    assert stats.key(None, generation(5)) is None
    parse_transfer(TransferStat(key.transfer_id, "127.0.0.1:21001", 1, 3, 0.1).as_map())


class Collected:
    def __init__(self) -> None:
        self.stats: list[TransferStat] = []

    def report(self, stat: TransferStat) -> bool:
        self.stats.append(stat)
        return True

    def stop(self) -> None:
        pass


def test_each_rank_reports_its_share() -> None:
    ranks = [Collected(), Collected(), Collected()]
    cfg = replace(CONFIG, geometry=Geometry(tp_size=3))
    stats = KvStats(cfg, ranks)
    key = stats.key(TAGGED, generation(20))
    stats.report(key, "127.0.0.1:21001", "ok", 100, stats.clock())
    got: list[Any] = [(r.stats[0].bytes, r.stats[0].blocks, r.stats[0].outcome) for r in ranks]
    assert got == [(34, 2, "ok"), (33, 2, "ok"), (33, 2, "ok")]
    stats.failed(key, "127.0.0.1:21001", "payload_mismatch", 100, stats.clock())
    assert [r.stats[1].outcome for r in ranks] == ["error"] * 3
    stats.report(None, "127.0.0.1:21001", "ok", 100, stats.clock())  # untagged: nothing
    assert [len(r.stats) for r in ranks] == [2, 2, 2]


@pytest.mark.parametrize(("proxy", "announce"), [(None, "v1"), (Endpoint("127.0.0.1", 1), "v0")])
def test_no_reporting_without_a_v1_registry(proxy: Endpoint | None, announce: Any) -> None:
    stats = KvStats.connect(replace(CONFIG, proxy=proxy, announce=announce))
    assert not stats.reporting  # stock vLLM (v0) reports nothing, nor does a worker on its own
    stats.stop()
