"""The NIXL-style handshake in the request bodies (vLLM's kv_transfer_params). Pure.

The prefill leg asks the prefill instance to keep the prompt's KV for a remote decode; its
answer says where that KV is (engine, blocks, host, port), and the decode leg hands that object,
unchanged, to the decode instance, which reads the KV from there. Connectors using these fields
(NIXL, Mooncake-style) ignore the request-id tag; pdproxy still sends it so logs correlate.

pdproxy's own connector pushes KV from the prefill to the decode named in the tag, so it needs
no answer back, but its prefill must know how the decode splits heads: the prefill leg tells it
the decode's TP size (`{"pdproxy": {"decode_tp_size": N}}`; pdproxy.vllm_side.kv_schedule reads
it). Clients may not send kv_transfer_params, so only the proxy's pairing decides this.

Mooncake (vLLM's MooncakeConnector) needs no answer either: the proxy names the transfer
itself (a fresh transfer id per attempt) in both legs, and tells the decode where the prefill's
bootstrap server is and which engine it runs (the engine id the bootstrap server's /query
answers: pdproxy.proxy.bootstrap), so both legs may go at once. NIXL push
(NixlPushConnector) is the same handshake the other way round: the decode leg carries the
prefill's engine id and NIXL side channel (announced, or declared statically) and registers its
blocks there; the prefill writes the KV into them once computed.
"""

from __future__ import annotations

from typing import Any

import orjson

from pdproxy.ids import Address
from pdproxy.registry.messages import Connector
from pdproxy.registry.table import Instance

PARAMS_FIELD = "kv_transfer_params"
PARAMS_CONNECTORS = frozenset((Connector.NIXL,))


def uses_params(connector: Connector | None) -> bool:
    return connector in PARAMS_CONNECTORS


def prefill_leg_params(connector: Connector | None, decode: Instance) -> dict[str, Any] | None:
    """What the prefill leg's body carries for a pair using `connector`, if anything."""
    if connector in PARAMS_CONNECTORS:
        return prefill_params()
    if connector is Connector.PDPROXY and decode.geometry is not None:
        tp_size = decode.geometry.tp_size
        if tp_size is not None:
            return {"pdproxy": {"decode_tp_size": tp_size}}
    return None


def prefill_params() -> dict[str, Any]:
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def mooncake_prefill_params(transfer_id: str) -> dict[str, Any]:
    """The prefill leg's params: keep the KV for transfer `transfer_id`."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}


def mooncake_decode_params(transfer_id: str, bootstrap: Address, engine_id: str) -> dict[str, Any]:
    """The decode leg's params: pull transfer `transfer_id` from engine `engine_id`, whose
    workers the bootstrap server at `bootstrap` names (vLLM asks it for "<addr>/query")."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
        "remote_bootstrap_addr": f"http://{bootstrap}",
        "remote_engine_id": engine_id,
    }


def nixl_push_decode_params(
    engine_id: str, side_channel: Address, tp_size: int, request_id: str
) -> dict[str, Any]:
    """NixlPushConnector's decode leg: register its blocks with this prefill engine, reached
    at its NIXL side channel, which then writes the KV into them (vLLM matches the two legs by
    their request id, which pdproxy sends alike on both).

    `remote_request_id` is required: vLLM 0.32's NIXL scheduler reads it unguarded when it
    queues the receive (NixlConnectorMetadata.add_new_req_to_recv), and without it the decode's
    engine dies on a KeyError. The prefill's own id (vLLM adds a random suffix) is unknown
    before it answers; vLLM uses this one only to name the prefill request in heartbeats, which
    then extend no lease, so the X-Request-Id both legs carry stands for it."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": side_channel.host,
        "remote_port": side_channel.port,
        "tp_size": tp_size,
    }


def params_from_answer(body: bytes) -> dict[str, Any] | None:
    """The prefill answer's kv_transfer_params object, or None if it has none pdproxy can
    forward."""
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(answer, dict):
        return None
    params = answer.get(PARAMS_FIELD)
    if not isinstance(params, dict) or not params:
        return None
    try:
        orjson.dumps(params)  # what the decode leg must carry: nested deeper than orjson writes?
    except orjson.JSONEncodeError:
        return None
    return params
