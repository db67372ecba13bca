"""What the prefill leg's body carries for each connector kind (pdproxy.proxy.kv_params). Pure."""

from __future__ import annotations

import pytest

from pdproxy.base.roles import Role
from pdproxy.ids import Address
from pdproxy.proxy.kv_params import params_from_answer, prefill_leg_params, prefill_params
from pdproxy.registry.messages import Connector, Geometry
from pdproxy.registry.table import Instance, Source


def decode(geometry: Geometry | None) -> Instance:
    return Instance(
        Role.DECODE,
        Address("10.0.1.1", 8200),
        Address("10.0.1.1", 22001),
        Source.V1,
        model="m",
        geometry=geometry,
    )


def test_pdproxy_tells_the_prefill_the_decodes_tp() -> None:
    params = prefill_leg_params(Connector.PDPROXY, decode(Geometry(tp_size=4)))
    assert params == {"pdproxy": {"decode_tp_size": 4}}


@pytest.mark.parametrize("geometry", [None, Geometry(block_size=16)])
def test_pdproxy_without_a_known_decode_tp_says_nothing(geometry: Geometry | None) -> None:
    # The prefill then assumes its own TP, which is what pairing allows for unknown geometry.
    assert prefill_leg_params(Connector.PDPROXY, decode(geometry)) is None


def test_nixl_asks_for_a_remote_decode() -> None:
    assert prefill_leg_params(Connector.NIXL, decode(Geometry(tp_size=2))) == prefill_params()


@pytest.mark.parametrize("connector", [Connector.P2P_NCCL, None])
def test_push_by_id_connectors_get_nothing(connector: Connector | None) -> None:
    assert prefill_leg_params(connector, decode(Geometry(tp_size=2))) is None


def test_answered_params_are_taken_only_if_the_decode_leg_can_carry_them() -> None:
    assert params_from_answer(b'{"kv_transfer_params": {"remote_port": 5}}') == {"remote_port": 5}
    for answer in (b"{}", b'{"kv_transfer_params": {}}', b'{"kv_transfer_params": 1}', b"[]"):
        assert params_from_answer(answer) is None
    # Readable (orjson reads 1024 levels) but not writable again: no usable params, not a 500.
    deep = b'{"kv_transfer_params": {"x": ' + b"[" * 300 + b"]" * 300 + b"}}"
    assert params_from_answer(deep) is None


def test_mooncake_and_nixl_push_legs_carry_what_vllms_connectors_read() -> None:
    from pdproxy.ids import Address
    from pdproxy.proxy.kv_params import (
        mooncake_decode_params,
        mooncake_prefill_params,
        nixl_push_decode_params,
    )

    # vLLM 0.32 MooncakeConnector: update_state_after_alloc reads these three on the decode.
    assert mooncake_prefill_params("t1") == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": "t1",
    }
    decode = mooncake_decode_params("t1", Address("10.0.0.5", 8998), "engine-a")
    assert decode["remote_bootstrap_addr"] == "http://10.0.0.5:8998"
    assert (decode["transfer_id"], decode["remote_engine_id"]) == ("t1", "engine-a")
    assert decode["do_remote_prefill"] is True and decode["do_remote_decode"] is False
    # NixlPushConnectorScheduler.update_state_after_alloc: remote_engine_id/host/port, tp_size;
    # NixlConnectorMetadata.add_new_req_to_recv: remote_request_id (a KeyError without it
    # killed the decode's engine on real vLLM 0.32).
    push = nixl_push_decode_params("engine-p", Address("10.0.0.6", 5600), 2, "req-1")
    assert push == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "engine-p",
        "remote_request_id": "req-1",
        "remote_host": "10.0.0.6",
        "remote_port": 5600,
        "tp_size": 2,
    }
