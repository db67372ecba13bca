"""PdproxyConnector: a vLLM KV connector (KVConnectorBase_V1) loaded with
`"kv_connector": "PdproxyConnector", "kv_connector_module_path": "pdproxy.worker.connector"`.

Today it moves no KV: a decode instance recomputes the prompt. What it already does:
- announces its instance to the pdproxy registry (v1, with the geometry read from the real
  VllmConfig and the load the scheduler shows it), and says goodbye on shutdown;
- optionally records the engine-internal request ids and token counts it is shown
  (`record_path`), which is how the tests see what real vLLM made of the proxy's ids.

vLLM builds one instance in the scheduler (engine core) and one per worker; only the scheduler's
announces, so a TP group registers once.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from pdproxy.worker.announcement import WorkerIdentity
from pdproxy.worker.announcer import Announcer, LoadSample
from pdproxy.worker.connector_settings import ConnectorSettings, connector_settings
from pdproxy.worker.load_tracker import LoadTracker
from pdproxy.worker.registry_client import RegistryClient
from pdproxy.worker.request_log import RequestLog
from pdproxy.worker.secret import read_secret_file
from pdproxy.worker.vllm_geometry import geometry_from_vllm_config

log = logging.getLogger("pdproxy.worker")


class PdproxyConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Nothing crosses from scheduler to workers yet."""


class PdproxyConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self._settings: ConnectorSettings = connector_settings(
            transfer.kv_role,
            getattr(transfer, "kv_ip", None),  # gone since vLLM 0.32
            transfer.kv_port,
            transfer.kv_connector_extra_config,
            default_host=_host_address(),
        )
        self._is_scheduler = role == KVConnectorRole.SCHEDULER
        path = self._settings.record_path
        self._log = None if path is None else RequestLog(path)
        self._load = LoadTracker()
        self._announcer: Announcer | None = None
        if self._is_scheduler and self._settings.announces:
            self._announcer = self._start_announcer(vllm_config)

    def _start_announcer(self, vllm_config: Any) -> Announcer:
        settings = self._settings
        assert settings.role is not None and settings.http_address is not None
        assert settings.registry is not None
        identity = WorkerIdentity(
            role=settings.role,
            http_address=settings.http_address,
            zmq_address=settings.zmq_address,
            model=_served_model_name(vllm_config),
            connector=settings.connector_kind,
            geometry=geometry_from_vllm_config(vllm_config),
        )
        self._record(
            "announcing",
            http_address=identity.http_address,
            zmq_address=identity.zmq_address,
            model=identity.model,
            geometry=None if identity.geometry is None else identity.geometry.as_map(),
        )
        secret_file = settings.registry_secret_file
        # Read before anything connects: a missing or short secret fails the engine's start.
        secret = None if secret_file is None else read_secret_file(secret_file)
        client = RegistryClient(settings.registry, identity=settings.zmq_address)
        announcer = Announcer(
            client, identity, self._sample, settings.announce_interval_s, secret=secret
        )
        announcer.start()
        log.info("pdproxy connector: announcing %s to %s", identity.http_address, settings.registry)
        return announcer

    def _sample(self) -> LoadSample:
        manager = self._kv_cache_manager
        usage = None if manager is None else min(1.0, max(0.0, float(manager.usage)))
        return LoadSample(self._load.load(kv_usage=usage))

    def _record(self, event: str, **fields: Any) -> None:
        if self._log is not None:
            self._log.write(event, role=self._settings.role, **fields)

    # -- worker side: no KV moves yet --------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._record(
            "kv_caches",
            layers=len(kv_caches),
            shapes=sorted({str(tuple(t.shape)) for t in kv_caches.values()}),
            dtypes=sorted({str(t.dtype) for t in kv_caches.values()}),
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # -- scheduler side ----------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self._load.arrived(request.request_id)
        params = request.sampling_params
        self._record(
            "new",
            request_id=request.request_id,
            prompt_tokens=request.num_prompt_tokens,
            max_tokens=None if params is None else params.max_tokens,
            kv_transfer_params=request.kv_transfer_params,
        )

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False  # nothing to load: the prompt is computed here

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._load.scheduled(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return PdproxyConnectorMetadata()

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._load.finished(request.request_id)
        self._record(
            "finished",
            request_id=request.request_id,
            output_tokens=request.num_output_tokens,
            status=str(getattr(request, "status", "")),
        )
        return False, None

    def shutdown(self) -> None:
        if self._announcer is not None:
            self._announcer.stop()
            self._announcer = None
        if self._log is not None:
            self._log.close()
            self._log = None


def _host_address() -> str:
    from vllm.utils.network_utils import get_ip

    return str(get_ip())


def _served_model_name(vllm_config: Any) -> str:
    model = vllm_config.model_config
    served = getattr(model, "served_model_name", None)
    if isinstance(served, list | tuple) and served:
        return str(served[0])
    return str(served or model.model)
