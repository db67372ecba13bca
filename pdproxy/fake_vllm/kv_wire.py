"""The fake workers' KV messages: one msgpack map per ZMQ frame, versioned, bounded in size.

Internal to the fake worker (a real vLLM speaks NCCL or NIXL here). Every worker binds a ROUTER
on its KV port; a peer's DEALER sends one frame:

    {"v": 1, "op": "push", "request_id": str, "sender": zmq address, "kv": payload}
        p2p_nccl: a prefill hands a request's KV to the decode named in the request id; no reply.
    {"v": 1, "op": "pull", "transfer_id": str, "engine_id": str, "block_ids": [int],
     "requester": zmq address}
        nixl/pdproxy: a decode asks the prefill for the KV it holds under transfer_id
        (kv_transfer_params' remote_request_id), expecting engine_id and block_ids from them.
    {"v": 1, "op": "pull_reply", "transfer_id": str, "engine_id": the answering prefill's,
     "kv": payload | null, "error": null | "engine_id_mismatch" | "missing_transfer" |
     "block_ids_mismatch"}
        the prefill's answer to a pull, sent back on the same connection.
    {"v": 1, "op": "register", "request_id": str, "engine_id": str, "sender": zmq address}
        nixl_push: a decode asks the prefill engine engine_id (at its side channel) to write
        the KV of request_id (the id vLLM matches both legs by) to sender; no reply: the KV
        comes as a push.

payload = {"digest": 32 bytes (sha256 of the prompt), "connector": str,
           "geometry": {"tp_size", "block_size", "num_layers", "num_kv_heads", "head_dim",
                        "kv_dtype", "is_mla", "kv_layout"}}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from pdproxy.fake_vllm.kv_payload import KvPayload, PayloadError, payload_from_map

WIRE_VERSION = 1
# Far above any real message (a pull lists at most max_model_len block ids); also the sockets'
# ZMQ_MAXMSGSIZE, so an oversized frame is dropped by ZMQ before it is read.
MAX_KV_MESSAGE_BYTES = 1 << 20
PULL_ERRORS = ("engine_id_mismatch", "missing_transfer", "block_ids_mismatch")


class WireError(ValueError):
    """A KV frame that is not one of the messages above."""


@dataclass(frozen=True, slots=True)
class Push:
    request_id: str
    sender: str
    payload: KvPayload


@dataclass(frozen=True, slots=True)
class Pull:
    transfer_id: str
    engine_id: str
    block_ids: tuple[int, ...]
    requester: str


@dataclass(frozen=True, slots=True)
class PullReply:
    transfer_id: str
    engine_id: str
    payload: KvPayload | None
    error: str | None  # one of PULL_ERRORS; payload is None exactly when this is set


@dataclass(frozen=True, slots=True)
class Register:
    request_id: str
    engine_id: str
    sender: str


Message = Push | Pull | PullReply | Register


def as_map(message: Message) -> dict[str, Any]:
    if isinstance(message, Push):
        body: dict[str, Any] = {
            "op": "push",
            "request_id": message.request_id,
            "sender": message.sender,
            "kv": message.payload.as_map(),
        }
    elif isinstance(message, Pull):
        body = {
            "op": "pull",
            "transfer_id": message.transfer_id,
            "engine_id": message.engine_id,
            "block_ids": list(message.block_ids),
            "requester": message.requester,
        }
    elif isinstance(message, Register):
        body = {
            "op": "register",
            "request_id": message.request_id,
            "engine_id": message.engine_id,
            "sender": message.sender,
        }
    else:
        kv = None if message.payload is None else message.payload.as_map()
        body = {
            "op": "pull_reply",
            "transfer_id": message.transfer_id,
            "engine_id": message.engine_id,
            "kv": kv,
            "error": message.error,
        }
    return {"v": WIRE_VERSION, **body}


def encode(message: Message) -> bytes:
    frame: bytes = msgpack.packb(as_map(message))
    if len(frame) > MAX_KV_MESSAGE_BYTES:
        raise WireError(f"a {len(frame)}-byte KV message exceeds {MAX_KV_MESSAGE_BYTES} bytes")
    return frame


def text(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str):
        raise WireError(f"{name} must be a string")
    return value


def block_ids(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        raise WireError("block_ids must be a list of integers")
    return tuple(value)


def reply_from_map(body: dict[str, Any]) -> PullReply:
    error, kv = body.get("error"), body.get("kv")
    if error is not None and error not in PULL_ERRORS:
        raise WireError(f"unknown pull error {error!r}")
    if (error is None) == (kv is None):
        raise WireError("a pull reply carries either kv or an error")
    try:
        payload = None if kv is None else payload_from_map(kv)
    except PayloadError as err:
        raise WireError(str(err)) from None
    return PullReply(text(body, "transfer_id"), text(body, "engine_id"), payload, error)


def decode(frame: bytes) -> Message:
    if len(frame) > MAX_KV_MESSAGE_BYTES:
        raise WireError(f"a {len(frame)}-byte KV message exceeds {MAX_KV_MESSAGE_BYTES} bytes")
    try:
        body = msgpack.unpackb(frame)
    # ValueError covers truncated or extra data and bad UTF-8; TypeError an unhashable map key.
    except (ValueError, TypeError, msgpack.UnpackException) as err:
        raise WireError(f"not msgpack: {err}") from None
    if not isinstance(body, dict):
        raise WireError("a KV message is a map")
    if body.get("v") != WIRE_VERSION:
        raise WireError(f"unsupported KV message version {body.get('v')!r}")
    op = body.get("op")
    if op == "push":
        try:
            payload = payload_from_map(body.get("kv"))
        except PayloadError as err:
            raise WireError(str(err)) from None
        return Push(text(body, "request_id"), text(body, "sender"), payload)
    if op == "pull":
        return Pull(
            text(body, "transfer_id"),
            text(body, "engine_id"),
            block_ids(body.get("block_ids")),
            text(body, "requester"),
        )
    if op == "pull_reply":
        return reply_from_map(body)
    if op == "register":
        return Register(text(body, "request_id"), text(body, "engine_id"), text(body, "sender"))
    raise WireError(f"unknown KV message op {op!r}")
