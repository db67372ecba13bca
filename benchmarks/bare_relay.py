"""The floor under the pure build: pdproxy's HTTP server and upstream client with nothing else.

For each POST it does what pdproxy's request path does on the wire and nothing more: it reads
the body, sends the prefill backend the request with ``max_tokens`` 1 and ``stream`` off, reads
that answer whole, sends the decode backend the client's body and relays its answer whole. No
pairing, leases, deadlines, admission, metrics, trace context or request-id tagging: the
difference between this and ``pdproxy serve`` against the same backends is what those cost.
``GET`` of any path answers 200 (the benchmarks' readiness probe).

    .venv/bin/python benchmarks/bench_proxy.py --concurrency 64 --proxy-cmd \
        "{python} benchmarks/bare_relay.py --port {port} --prefill-port {prefill_port} \
        --decode-port {decode_port}"

Not a proxy to run: no bound on a slow client, no error handling beyond a 502.
"""

from __future__ import annotations

import argparse
from typing import Any

import orjson
import uvicorn

from pdproxy.http.server_protocol import HttpProtocol
from pdproxy.http.upstream import Upstream, UpstreamError
from pdproxy.ids import Address

LIMIT = 1 << 20  # answer bytes read from a backend
PATH = "/v1/completions"
REQUEST_ID = "___prefill_addr_127.0.0.1:1___decode_addr_127.0.0.1:2_0123456789abcdef"


class BareRelay:
    """An ASGI application relaying one prefill and one decode per POST."""

    def __init__(self, prefill: Address, decode: Address) -> None:
        self._prefill = prefill
        self._decode = decode
        self._upstream: Upstream | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["method"] != "POST":
            await _answer(send, 200, b"text/plain", b"ok")
            return
        body = b""
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        assert self._upstream is not None
        headers = {"Content-Type": "application/json", "X-Request-Id": REQUEST_ID}
        prefill_body = orjson.loads(body)
        prefill_body["max_tokens"] = 1
        prefill_body["stream"] = False
        try:
            await self._upstream.post(
                self._prefill, PATH, orjson.dumps(prefill_body), headers, LIMIT
            )
            async with self._upstream.stream("POST", self._decode, PATH, body, headers) as answer:
                status, content_type = answer.status, answer.content_type
                relayed = await answer.read_all(LIMIT)
        except UpstreamError as exc:
            await _answer(send, 502, b"text/plain", exc.detail.encode())
            return
        await _answer(send, status, content_type, relayed)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._upstream = Upstream(5.0, 1024, "bare-relay")
                await self._upstream.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._upstream is not None:
                    await self._upstream.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _answer(send: Any, status: int, content_type: bytes, body: bytes) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill-port", type=int, required=True)
    parser.add_argument("--decode-port", type=int, required=True)
    parser.add_argument("--backend-host", default="127.0.0.1")
    args = parser.parse_args()
    relay = BareRelay(
        Address(args.backend_host, args.prefill_port), Address(args.backend_host, args.decode_port)
    )
    uvicorn.run(
        relay,
        interface="asgi3",
        host=args.host,
        port=args.port,
        http=HttpProtocol,
        loop="auto",
        lifespan="on",
        access_log=False,
        log_level="warning",
        server_header=False,
        proxy_headers=False,
    )


if __name__ == "__main__":
    main()
