"""Kubernetes discovery (`--discovery kubernetes`): Pods watched by label selector, one watch per
role, fed to the registry table beside the announcements (pdproxy.registry.table: discovery says
which pods exist and are ready, announcements enrich them).

The client is kubernetes_asyncio (the `kubernetes` extra), imported only here and only when the
setting is on. In a pod it uses the service account (KUBERNETES_SERVICE_HOST is set); elsewhere
the kubeconfig (KUBECONFIG, else ~/.kube/config).

Each role's loop: list the pods (every pod the list lacks and discovery knew is gone), then
watch from the list's resourceVersion. A watch that ends (the server's timeout, a dropped
connection, an error) resumes from the last resourceVersion it saw, after a jittered backoff
doubling from BACKOFF_BASE_SECONDS up to BACKOFF_MAX_SECONDS when it failed; `410 Gone` (that
version is too old) lists again at once. Nothing here stops the proxy: without the API server
the table keeps what it had and announcements still work.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from pdproxy.base.roles import Role
from pdproxy.config import Settings
from pdproxy.ids import Address
from pdproxy.metrics import Metrics
from pdproxy.registry.pods import PodError, PodKeys, instance_from_pod, pod_name, pod_uid
from pdproxy.registry.table import Instance
from pdproxy.reliability.backoff import RetryPolicy

log = logging.getLogger("pdproxy.discovery")

# The server ends each watch after this long (a fresh one starts from where it stopped); the
# client gives up on a connection silent for longer (a peer gone without a FIN).
WATCH_SECONDS = 240
WATCH_READ_SLACK_SECONDS = 30
CONNECT_SECONDS = 10.0
LIST_SECONDS = 30.0
BACKOFF_BASE_SECONDS = 0.5
BACKOFF_MAX_SECONDS = 30.0
# A watch that ends this soon without an event counts as a failure (no busy loop on a server
# that closes every watch at once).
SHORT_WATCH_SECONDS = 1.0
_LOGGED_POD_ERRORS = 4096
_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class PodSink(Protocol):
    """Where discovered pods go (RegistryServer: the table, the metrics, the log)."""

    def discovered(self, instance: Instance) -> None: ...

    def undiscovered(self, http_address: Address) -> None: ...


class WatchExpired(Exception):
    """The API server no longer has the resourceVersion to watch from (410 Gone)."""


def pod_keys(settings: Settings) -> PodKeys:
    return PodKeys(
        http_port=settings.kubernetes_http_port_annotation,
        kv_port=settings.kubernetes_kv_port_annotation,
        connector=settings.kubernetes_connector_annotation,
        geometry=settings.kubernetes_geometry_annotation,
        drain=settings.kubernetes_drain_annotation,
    )


def selectors(settings: Settings) -> dict[Role, str]:
    return {
        Role.PREFILL: settings.kubernetes_prefill_selector,
        Role.DECODE: settings.kubernetes_decode_selector,
    }


def namespace(settings: Settings, namespace_file: Path = _NAMESPACE_FILE) -> str:
    if settings.kubernetes_namespace:
        return settings.kubernetes_namespace
    with contextlib.suppress(OSError):
        own = namespace_file.read_text(encoding="utf-8").strip()
        if own:
            return own
    return "default"


class RoleWatch:
    """One role's pods as discovery knows them (pod uid -> the address fed to the sink), kept
    in step with the API server's list and watch events."""

    def __init__(self, role: Role, keys: PodKeys, sink: PodSink) -> None:
        self.role = role
        self._keys = keys
        self._sink = sink
        self._known: dict[str, Address] = {}
        self._complaints: OrderedDict[str, str] = OrderedDict()  # uid -> last error logged

    def listed(self, pods: list[dict[str, Any]]) -> None:
        """A full list: every pod in it is seen, every known pod not in it is gone."""
        present = set()
        for pod in pods:
            present.add(pod_uid(pod))
            self.event("MODIFIED", pod)
        for uid in [uid for uid in self._known if uid not in present]:
            self._forget(uid)

    def event(self, kind: str, pod: dict[str, Any]) -> None:
        """One watch event: ADDED, MODIFIED or DELETED (BOOKMARK never gets here)."""
        uid = pod_uid(pod)
        if kind == "DELETED":
            self._forget(uid)
            return
        try:
            instance = instance_from_pod(pod, self.role, self._keys)
        except PodError as exc:
            self._complain(uid, f"pod {pod_name(pod)} ({self.role}) is not routed to: {exc}")
            instance = None
        else:
            self._complaints.pop(uid, None)
        old = self._known.get(uid)
        if instance is None:
            if old is not None:
                self._forget(uid)
            return
        if old is not None and old != instance.http_address:
            self._sink.undiscovered(old)  # the same pod under another port: the old one goes
        self._known[uid] = instance.http_address
        self._sink.discovered(instance)

    def _forget(self, uid: str) -> None:
        self._complaints.pop(uid, None)
        address = self._known.pop(uid, None)
        if address is not None:
            self._sink.undiscovered(address)

    def _complain(self, uid: str, message: str) -> None:
        """Log a pod's problem once (again only when it changes)."""
        if self._complaints.get(uid) == message:
            return
        self._complaints[uid] = message
        self._complaints.move_to_end(uid)
        if len(self._complaints) > _LOGGED_POD_ERRORS:
            self._complaints.popitem(last=False)
        log.warning("discovery: %s", message)


class KubernetesDiscovery:
    def __init__(
        self,
        settings: Settings,
        sink: PodSink,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._namespace = namespace(settings)
        self._selectors = selectors(settings)
        self._watches = [RoleWatch(role, pod_keys(settings), sink) for role in Role]
        self._metrics = metrics
        self._clock = clock
        self._backoff = RetryPolicy(1_000_000, BACKOFF_BASE_SECONDS, BACKOFF_MAX_SECONDS)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kubernetes-discovery")
        log.info(
            "discovery: watching pods in namespace %s (prefill: %s; decode: %s)",
            self._namespace,
            self._selectors[Role.PREFILL],
            self._selectors[Role.DECODE],
        )

    async def stop(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None

    async def _run(self) -> None:
        failures = 0
        while True:  # until the API client can be made (a missing config is retried too)
            try:
                api_client = await _api_client()
                break
            except Exception as exc:
                failures += 1
                delay = self._backoff.delay(failures, random.random())
                log.warning("discovery: no Kubernetes client (%s); again in %.1fs", exc, delay)
                await asyncio.sleep(delay)
        try:
            await asyncio.gather(*(self._follow(api_client, watch) for watch in self._watches))
        finally:
            await api_client.close()

    async def _follow(self, api_client: Any, watch: RoleWatch) -> None:
        """List, then watch and resume, forever."""
        from kubernetes_asyncio import client

        api = client.CoreV1Api(api_client)
        selector = self._selectors[watch.role]
        version: str | None = None
        failures = 0
        while True:
            started = self._clock()
            try:
                if version is None:
                    version = await self._list(api, selector, watch)
                    failures = 0
                version, events = await self._watch(api, selector, watch, version)
                if events or self._clock() - started >= SHORT_WATCH_SECONDS:
                    failures = 0
                    continue
                reason = "closed"
            except WatchExpired:
                self._restarted(watch.role, "expired")
                log.info("discovery: %s watch expired (410 Gone): listing again", watch.role)
                version = None
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                reason = "failed"
                log.warning("discovery: %s pods: %s", watch.role, _describe(exc))
            self._restarted(watch.role, reason)
            failures += 1
            await asyncio.sleep(self._backoff.delay(failures, random.random()))

    async def _list(self, api: Any, selector: str, watch: RoleWatch) -> str:
        """List the role's pods into `watch`; the list's resourceVersion."""
        response = await api.list_namespaced_pod(
            self._namespace,
            label_selector=selector,
            _preload_content=False,
            _request_timeout=LIST_SECONDS,
        )
        try:
            body = await response.read()
            if response.status != 200:
                raise RuntimeError(f"listing pods answered {response.status}: {body[:200]!r}")
        finally:
            response.release()
        listing = json.loads(body)
        pods = [p for p in listing.get("items") or [] if isinstance(p, dict)]
        watch.listed(pods)
        version = (listing.get("metadata") or {}).get("resourceVersion")
        if not isinstance(version, str) or not version:
            raise RuntimeError("the pod list has no resourceVersion to watch from")
        return version

    async def _watch(
        self, api: Any, selector: str, watch: RoleWatch, version: str
    ) -> tuple[str, int]:
        """Apply watch events from `version` until the stream ends: (the last
        resourceVersion seen, the events applied). Raises WatchExpired on 410 Gone."""
        from kubernetes_asyncio import watch as k8s_watch
        from kubernetes_asyncio.client.exceptions import ApiException

        stream = k8s_watch.Watch(return_type="object")  # events as the API's JSON, not models
        events = 0
        try:
            async with stream.stream(
                api.list_namespaced_pod,
                self._namespace,
                label_selector=selector,
                resource_version=version,
                allow_watch_bookmarks=True,
                timeout_seconds=WATCH_SECONDS,
                _request_timeout=(CONNECT_SECONDS, WATCH_SECONDS + WATCH_READ_SLACK_SECONDS),
            ) as events_stream:
                async for event in events_stream:
                    kind = event.get("type")
                    pod = event.get("raw_object")
                    if kind in ("ADDED", "MODIFIED", "DELETED") and isinstance(pod, dict):
                        watch.event(kind, pod)
                        events += 1
        except ApiException as exc:
            if exc.status == 410:
                raise WatchExpired from exc
            raise
        return stream.resource_version or version, events

    def _restarted(self, role: Role, reason: str) -> None:
        self._metrics.discovery_watch_restarts.labels(role, reason).inc()


async def _api_client() -> Any:
    from kubernetes_asyncio import client, config

    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        configuration = client.Configuration()
        load_in_cluster: Any = config.load_incluster_config  # untyped in the library
        load_in_cluster(client_configuration=configuration)
        return client.ApiClient(configuration)
    return await config.new_client_from_config()


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().replace("\n", " ")
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
