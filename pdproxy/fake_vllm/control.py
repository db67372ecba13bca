"""The /_fake/ endpoints: tests read what the worker saw and inject how it misbehaves."""

from __future__ import annotations

import json

from aiohttp import web
from aiohttp.typedefs import Handler

from pdproxy.fake_vllm.behaviour import Behaviour, parse_behaviour
from pdproxy.fake_vllm.http_json import ApiError, json_response, parse_json_object
from pdproxy.fake_vllm.load import LoadTracker, parse_forced_load
from pdproxy.fake_vllm.records import Records, stamp


class Control:
    """The records, the injected behaviour and the load, and the routes that expose them."""

    def __init__(self, records: Records, load: LoadTracker) -> None:
        self.records = records
        self.load = load
        self.behaviour = Behaviour()

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/_fake/requests", self.fake_requests)
        router.add_get("/_fake/events", self.fake_events)
        router.add_get("/_fake/behaviour", self.get_behaviour)
        router.add_post("/_fake/behaviour", self.set_behaviour)
        router.add_post("/_fake/reset", self.fake_reset)
        router.add_get("/_fake/load", self.get_load)
        router.add_post("/_fake/load", self.set_load)

    @web.middleware
    async def record_request(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.path.startswith("/_fake/"):
            raw = await request.read() if request.can_read_body else b""
            try:
                body = json.loads(raw) if raw else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                body = None
            headers = {name.lower(): value for name, value in request.headers.items()}
            entry = {"path": request.path, "method": request.method, "headers": headers}
            self.records.requests.append({**entry, "body": body, **stamp()})
        return await handler(request)

    async def fake_requests(self, request: web.Request) -> web.StreamResponse:
        return json_response(list(self.records.requests))

    async def fake_events(self, request: web.Request) -> web.StreamResponse:
        return json_response(self.records.events_snapshot())

    async def get_behaviour(self, request: web.Request) -> web.StreamResponse:
        return json_response(self.behaviour.as_json())

    async def set_behaviour(self, request: web.Request) -> web.StreamResponse:
        try:
            self.behaviour = parse_behaviour(parse_json_object(await request.read()))
        except ApiError as err:
            return err.response()
        return json_response(self.behaviour.as_json())

    async def get_load(self, request: web.Request) -> web.StreamResponse:
        return json_response(self.load.as_json())

    async def set_load(self, request: web.Request) -> web.StreamResponse:
        """Force the announced load from the next announcement on; {} goes back to measured."""
        try:
            self.load.forced = parse_forced_load(parse_json_object(await request.read()))
        except ApiError as err:
            return err.response()
        return json_response(self.load.as_json())

    async def fake_reset(self, request: web.Request) -> web.StreamResponse:
        self.records.clear()
        return json_response({"ok": True})
