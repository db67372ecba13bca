"""The NIXL-style handshake in the request bodies (vLLM's kv_transfer_params). Pure.

The prefill leg asks the prefill instance to keep the prompt's KV for a remote decode; its
answer says where that KV is (engine, blocks, host, port), and the decode leg hands that object,
unchanged, to the decode instance, which reads the KV from there. Connectors using these fields
(NIXL, Mooncake-style) ignore the request-id tag; pdproxy still sends it so logs correlate.

pdproxy's own connector pushes KV from the prefill to the decode named in the tag, so it needs
no answer back, but its prefill must know how the decode splits heads: the prefill leg tells it
the decode's TP size (`{"pdproxy": {"decode_tp_size": N}}`; pdproxy.vllm_side.kv_schedule reads
it). Clients may not send kv_transfer_params, so only the proxy's pairing decides this.
"""

from __future__ import annotations

from typing import Any

import orjson

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
