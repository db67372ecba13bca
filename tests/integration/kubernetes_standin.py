"""A stand-in for the Kubernetes API server, for the discovery tests: NOT Kubernetes. It serves
only what pdproxy's discovery asks of the real one, in the real API's shapes:

- GET /api/v1/namespaces/NS/pods?labelSelector=...: a PodList with its resourceVersion;
- the same with watch=true&resourceVersion=N: a chunked stream of JSON lines, one watch event
  each ({"type": ADDED|MODIFIED|DELETED, "object": pod}) for every change after N, held open
  until timeoutSeconds; a watch from a version older than the retained history gets one ERROR
  event with a 410 Status, as the API server does once it compacted that version away.

A test changes pods (put, delete) and misbehaves on purpose: `drop_watches` cuts every open
watch mid-stream, `compact` forgets the history. Selectors are equality ones only (k=v,...).
It runs on 127.0.0.1, on a loop and thread of its own, inside a `with` block; every request is
recorded (path and query) so a test can see the client list again or resume a watch.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self, TypeVar

from aiohttp import web

Pod = dict[str, Any]
T = TypeVar("T")
WATCH_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class Seen:
    path: str
    query: dict[str, str]

    @property
    def watch(self) -> bool:
        return self.query.get("watch", "").lower() in ("true", "1")


def pod(
    name: str,
    namespace: str,
    labels: dict[str, str],
    annotations: dict[str, str],
    ip: str = "127.0.0.1",
    ready: bool = True,
) -> Pod:
    """A Pod object as the API serves it (the fields discovery reads, and a few more)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{namespace}-{name}",
            "labels": dict(labels),
            "annotations": dict(annotations),
        },
        "spec": {"containers": [{"name": "vllm", "image": "stand-in"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def _selected(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class KubernetesStandIn:
    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.requests: list[Seen] = []
        self._pods: dict[str, Pod] = {}
        self._version = 100
        self._history: list[tuple[int, str, Pod]] = []
        self._oldest = self._version  # watches from before this get 410 Gone
        self._cut = 0  # moves on drop_watches: watches opened before it end abruptly
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self) -> str:
        """A kubeconfig pointing the client at the stand-in (YAML is a superset of JSON)."""
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
                "users": [{"name": "tester", "user": {"token": "stand-in-token"}}],
                "contexts": [
                    {
                        "name": "standin",
                        "context": {
                            "cluster": "standin",
                            "user": "tester",
                            "namespace": self.namespace,
                        },
                    }
                ],
                "current-context": "standin",
            }
        )

    # ---- what a test does ----------------------------------------------------------------

    def put(self, new: Pod) -> None:
        """Create or replace a pod (ADDED or MODIFIED)."""
        self._call(lambda: self._change(new))

    def set_ready(self, name: str, ready: bool) -> None:
        def change() -> None:
            updated = copy.deepcopy(self._pods[name])
            updated["status"]["conditions"] = [
                {"type": "Ready", "status": "True" if ready else "False"}
            ]
            self._change(updated)

        self._call(change)

    def annotate(self, name: str, key: str, value: str | None) -> None:
        def change() -> None:
            updated = copy.deepcopy(self._pods[name])
            annotations = updated["metadata"]["annotations"]
            if value is None:
                annotations.pop(key, None)
            else:
                annotations[key] = value
            self._change(updated)

        self._call(change)

    def delete(self, name: str, *, compact_and_drop: bool = False) -> None:
        """Delete a pod (DELETED). With compact_and_drop, at the same instant forget the history
        and cut every watch: the client can only learn of the deletion by listing again."""

        def change() -> None:
            gone = self._pods.pop(name)
            self._record("DELETED", gone)
            if compact_and_drop:
                self._history.clear()
                self._oldest = self._version
                self._cut += 1

        self._call(change)

    def drop_watches(self) -> None:
        """Cut every open watch mid-stream (the chunked body never ends properly)."""

        def cut() -> None:
            self._cut += 1

        self._call(cut)

    def watches_opened(self) -> list[Seen]:
        return [seen for seen in list(self.requests) if seen.watch]

    def lists(self) -> list[Seen]:
        return [seen for seen in list(self.requests) if not seen.watch]

    # ---- the server ----------------------------------------------------------------------

    def __enter__(self) -> Self:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods_endpoint)

        async def start() -> int:
            self._runner = web.AppRunner(app, handle_signals=False)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", 0).start()
            port: int = self._runner.addresses[0][1]
            return port

        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            self._cut += 1
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def _call(self, change: Callable[[], T]) -> T:
        async def run() -> T:
            return change()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def _change(self, new: Pod) -> None:
        name = new["metadata"]["name"]
        kind = "MODIFIED" if name in self._pods else "ADDED"
        self._pods[name] = new
        self._record(kind, new)

    def _record(self, kind: str, changed: Pod) -> None:
        self._version += 1
        stamped = copy.deepcopy(changed)
        stamped["metadata"]["resourceVersion"] = str(self._version)
        if kind != "DELETED":
            self._pods[stamped["metadata"]["name"]] = stamped
        self._history.append((self._version, kind, stamped))

    async def _pods_endpoint(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append(Seen(request.path, query))
        if request.headers.get("Authorization") != "Bearer stand-in-token":
            return web.json_response(_status(401, "Unauthorized", "no token"), status=401)
        if request.match_info["namespace"] != self.namespace:
            return web.json_response({"kind": "PodList", "items": [], "metadata": {}})
        selector = query.get("labelSelector", "")
        if query.get("watch", "").lower() in ("true", "1"):  # Go ParseBool: True too
            return await self._watch(request, selector, int(query.get("resourceVersion", "0")))
        items = [
            p for p in self._pods.values() if _selected(selector, p["metadata"].get("labels", {}))
        ]
        return web.json_response(
            {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self._version)},
                "items": items,
            }
        )

    async def _watch(self, request: web.Request, selector: str, since: int) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if since < self._oldest:
            gone = _status(410, "Expired", f"too old resource version: {since} ({self._oldest})")
            await response.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
            await response.write_eof()
            return response
        cut = self._cut
        deadline = self._loop.time() + float(request.query.get("timeoutSeconds", "60"))
        cursor = since
        while self._loop.time() < deadline:
            if self._cut != cut:
                # Cut mid-stream: no last chunk, the connection just goes.
                if request.transport is not None:  # None: the client went first
                    request.transport.abort()
                return response
            for version, kind, changed in list(self._history):
                labels = changed["metadata"].get("labels", {})
                if version > cursor and _selected(selector, labels):
                    line = json.dumps({"type": kind, "object": changed}).encode() + b"\n"
                    await response.write(line)
            cursor = max([cursor, *(version for version, _, _ in self._history)])
            await asyncio.sleep(WATCH_POLL_SECONDS)
        await response.write_eof()
        return response


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
