"""The NIXL-style handshake in the request bodies (vLLM's kv_transfer_params). Pure.

The prefill leg asks the prefill instance to keep the prompt's KV for a remote decode; its
answer says where that KV is (engine, blocks, host, port), and the decode leg hands that object,
unchanged, to the decode instance, which reads the KV from there. Connectors using these fields
(NIXL, Mooncake-style) ignore the request-id tag; pdproxy still sends it so logs correlate.
"""

from __future__ import annotations

from typing import Any

import orjson

from pdproxy.registry.messages import Connector

PARAMS_FIELD = "kv_transfer_params"
PARAMS_CONNECTORS = frozenset((Connector.NIXL,))


def uses_params(connector: Connector | None) -> bool:
    return connector in PARAMS_CONNECTORS


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
    """The prefill answer's kv_transfer_params object, or None if it has none."""
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(answer, dict):
        return None
    params = answer.get(PARAMS_FIELD)
    return params if isinstance(params, dict) and params else None
