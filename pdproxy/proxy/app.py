"""The ASGI application: built once from Settings; its lifespan builds all state.

The two completion endpoints are served by a lean ASGI endpoint (the hot path), vLLM's other
endpoints by pass-through ones (proxy/passthrough.py); everything else (health, readiness,
metrics, models, instances, 404s) goes through FastAPI.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI

from pdproxy.base.roles import Role
from pdproxy.config import Settings
from pdproxy.proxy.completions import CompletionsEndpoint
from pdproxy.proxy.credentials import Credentials
from pdproxy.proxy.exchange import Scope
from pdproxy.proxy.front import COMPLETION_PATHS, FrontDoor
from pdproxy.proxy.passthrough import UNKNOWN_LABEL, PassThroughEndpoint, route_table
from pdproxy.proxy.routes import install_routes
from pdproxy.proxy.state import AppState, build_state
from pdproxy.registry.control import OwnRegistry, RegistrySide

log = logging.getLogger("pdproxy")


class PdproxyApp:
    def __init__(
        self,
        settings: Settings,
        clock: Callable[[], float] = time.monotonic,
        registry_side: RegistrySide | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        self.settings = settings
        self._clock = clock
        # Where the table comes from: this process's own registry, unless the process that
        # builds the app says otherwise (an HTTP worker of a multi-worker proxy).
        self._registry_side = registry_side or OwnRegistry()
        self._state: AppState | None = None
        # Read before anything binds: a missing key file fails the start, not a request.
        self.credentials = credentials or Credentials.from_settings(settings)
        self.api = FastAPI(lifespan=self._lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        install_routes(self.api, lambda: self.state, self.credentials)
        self._startup_failure: str | None = None
        self.front_door = FrontDoor(self._say_startup_failure, self.credentials)

    @property
    def state(self) -> AppState:
        if self._state is None:
            raise RuntimeError("pdproxy state used outside the app's lifespan")
        return self._state

    async def _say_startup_failure(self, scope: Scope, receive: Any, send: Any) -> None:
        """FastAPI, except that a start that failed on an address or a file is said in one
        line: uvicorn logs the text of a failed startup, and Starlette makes that text the
        traceback."""
        if scope["type"] != "lifespan":
            await self.api(scope, receive, send)
            return

        async def said(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "lifespan.startup.failed" and self._startup_failure:
                message = {**message, "message": self._startup_failure}
            await send(message)

        await self.api(scope, receive, said)

    @contextlib.asynccontextmanager
    async def _lifespan(self, _api: FastAPI) -> AsyncIterator[None]:
        try:
            state = await build_state(self.settings, self._clock, self._registry_side)
        except OSError as exc:  # a bind, a resolve, a file: the message names which
            self._startup_failure = f"pdproxy cannot start: {exc}"
            raise
        self._state = state
        self.front_door.metrics = state.metrics
        self.front_door.hot = {
            path: CompletionsEndpoint(
                path,
                self.settings,
                state.dispatcher,
                state.admission,
                state.metrics,
                state.alarms,
            )
            for path in COMPLETION_PATHS
        }
        self.front_door.passthrough = {
            path: self._passthrough(state, path, role)
            for path, role in route_table(self.settings).items()
        }
        if self.settings.passthrough_unknown_paths:
            self.front_door.unknown = self._passthrough(state, UNKNOWN_LABEL, None)
        # Everything built so far lives as long as the process: out of the collector's sight,
        # so the full collections that requests' garbage triggers do not walk it each time;
        # and collections less often (the hot path makes few reference cycles).
        # docs/performance.md, "The garbage collector".
        gc.collect()
        gc.freeze()
        gc.set_threshold(20_000, 20, 20)
        try:
            yield
        finally:
            self.front_door.hot = {}
            self.front_door.passthrough = {}
            self.front_door.unknown = None
            self.front_door.metrics = None
            await state.prober.stop()
            await state.registry_link.stop()
            await state.upstream.close()
            state.tracing.shutdown()
            state.alarms.close()
            self._state = None

    def log_ready(self) -> None:
        """Once the HTTP port is bound too (single_process.py): only then is it true."""
        log.info(
            "pdproxy ready to serve on %s:%d (registry %s, prefill policy %s, decode policy %s)",
            self.settings.host,
            self.settings.port,
            self.settings.registry_bind,
            self.settings.prefill_policy,
            self.settings.decode_policy,
        )

    def _passthrough(self, state: AppState, label: str, role: Role | None) -> PassThroughEndpoint:
        return PassThroughEndpoint(
            label,
            role,
            self.settings,
            state.dispatcher,
            state.rotation,
            state.upstream,
            state.admission,
            state.metrics,
            state.alarms,
        )

    def begin_shutdown(self) -> None:
        """SIGTERM: /ready answers 503 and new requests are refused from now on."""
        if self._state is not None and not self._state.admission.closing:
            self._state.admission.closing = True
            log.info("draining: refusing new requests, waiting for those in flight")

    @property
    def idle(self) -> bool:
        """Nothing in flight or waiting (always true outside the lifespan)."""
        return self._state is None or self._state.admission.idle

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        """For ASGI servers other than pdproxy's own (run_server serves `front_door` itself)."""
        await self.front_door(scope, receive, send)


def create_app(settings: Settings, registry_side: RegistrySide | None = None) -> PdproxyApp:
    return PdproxyApp(settings, registry_side=registry_side)
