"""PdproxyConnector: a vLLM KV connector (KVConnectorBase_V1) loaded with
`"kv_connector": "PdproxyConnector", "kv_connector_module_path": "pdproxy.vllm_side.connector"`.

It moves a tagged request's KV from the prefill instance named in its id to the decode
instance named there, over TCP (pdproxy.vllm_side.kv_tcp), keyed by the engine id without
vLLM's random suffix (pdproxy.vllm_side.kv_keys), so it needs no
VLLM_DISABLE_REQUEST_ID_RANDOMIZATION. An untagged request is computed locally. The decisions
are in kv_schedule (scheduler side, pure) and kv_worker (worker side, torch); this class only
wires them to vLLM's connector API. It also:
- announces its instance to the pdproxy registry, at every address proxy_ip resolves to (v1,
  with the geometry read from the real VllmConfig and the load the scheduler shows it), and
  says goodbye on shutdown;
- optionally records the engine-internal request ids, token counts and transfers
  (`record_path`), which is how the tests see what real vLLM did.

vLLM builds one instance in the scheduler (engine core) and one per worker; only the scheduler's
announces, so a TP group registers once.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from pdproxy.base.roles import Role
from pdproxy.base.secret_file import read_secret_file
from pdproxy.pairing.geometry import KvGeometry, KvLayout
from pdproxy.registry.messages import Geometry, known_fields
from pdproxy.vllm_side.announcement import TransferStat, WorkerIdentity, context_length
from pdproxy.vllm_side.announcer import LOAD_REPORT_S, Announcer, LoadSample
from pdproxy.vllm_side.connector_settings import ConnectorSettings, connector_settings
from pdproxy.vllm_side.cpu_format import cpu_isa, format_for_isa
from pdproxy.vllm_side.fanout import FanOutClient, announce_resolver
from pdproxy.vllm_side.kv import CacheFormat
from pdproxy.vllm_side.kv_buffer import TransferBuffer
from pdproxy.vllm_side.kv_keys import transfer_key
from pdproxy.vllm_side.kv_schedule import (
    ConsumerSchedule,
    LoadSpec,
    ProducerSchedule,
    SendSpec,
    decode_tp_size,
)
from pdproxy.vllm_side.kv_tcp import TcpReceiver, TcpSender
from pdproxy.vllm_side.kv_worker import ConsumerWorker, ProducerWorker, TransferRecord
from pdproxy.vllm_side.load_tracker import LoadTracker
from pdproxy.vllm_side.request_log import RequestLog
from pdproxy.vllm_side.stats_reporter import StatsReporter
from pdproxy.vllm_side.vllm_geometry import geometry_from_vllm_config

log = logging.getLogger("pdproxy.vllm_side")
# Under vLLM's logger: vLLM gives it a handler at VLLM_LOGGING_LEVEL, so what an operator must
# see (the address announced) reaches vLLM's log; pdproxy's own loggers have no handler there.
vllm_log = logging.getLogger("vllm.pdproxy_connector")


@dataclass
class PdproxyConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler tells the workers for one step."""

    sends: list[SendSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)


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
        self._load = LoadTracker(counts_prefill_work=self._settings.role is Role.PREFILL)
        self._sampled_work: int | None = None  # the work last sampled for an announcement
        self._announcer: Announcer | None = None
        self._geometry = geometry_from_vllm_config(vllm_config)
        self._block_size = int(vllm_config.cache_config.block_size)
        # None: this backend's page layout is unknown here, so no KV moves in or out.
        self._cache_format = _cache_format(vllm_config, self._geometry.head_dim)
        # Scheduler side: which request sends or loads what.
        self._sending = ProducerSchedule()
        self._loading = ConsumerSchedule(self._block_size)
        # Worker side, built once the caches are known.
        self._producer: ProducerWorker | None = None
        self._consumer: ConsumerWorker | None = None
        self._closers: list[Any] = []  # transport threads and the stats reporter
        self._reporter: StatsReporter | None = None
        if self._settings.on_missing_kv is not None:
            # Read by vLLM's scheduler right after it built this connector.
            transfer.kv_load_failure_policy = self._settings.on_missing_kv
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
            max_model_len=_max_model_len(vllm_config),
        )
        self._record(
            "announcing",
            http_address=identity.http_address,
            zmq_address=identity.zmq_address,
            model=identity.model,
            geometry=None if identity.geometry is None else known_fields(identity.geometry),
        )
        secret_file = settings.registry_secret_file
        # Read before anything connects: a missing or short secret fails the engine's start.
        secret = None if secret_file is None else read_secret_file(secret_file)
        # proxy_ip may name every proxy replica (a headless Service): announce to each.
        client = FanOutClient(
            settings.registry, settings.zmq_address, announce_resolver(settings.announce_interval_s)
        )
        # A prefill's work changes with every step: reported within prefill_work_report.
        report_s = (
            settings.prefill_work_report_s if settings.role is Role.PREFILL else LOAD_REPORT_S
        )
        announcer = Announcer(
            client,
            identity,
            self._sample,
            settings.announce_interval_s,
            secret=secret,
            load_report_s=report_s,
        )
        announcer.start()
        vllm_log.info(
            "pdproxy connector: announcing http %s, zmq %s (host from %s) to %s",
            identity.http_address,
            identity.zmq_address,
            settings.host_origin,
            settings.registry,
        )
        return announcer

    def _sample(self) -> LoadSample:
        manager = self._kv_cache_manager
        usage = None if manager is None else min(1.0, max(0.0, float(manager.usage)))
        load = self._load.load(kv_usage=usage)
        if load.prefill_tokens != self._sampled_work:  # what the announcer is about to tell
            self._sampled_work = load.prefill_tokens
            self._record("work", prefill_tokens=load.prefill_tokens)
        return LoadSample(load)

    def _record(self, event: str, **fields: Any) -> None:
        if self._log is not None:
            self._log.write(event, role=self._settings.role, **fields)

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._record(
            "kv_caches",
            layers=len(kv_caches),
            shapes=sorted({str(tuple(t.shape)) for t in kv_caches.values()}),
            dtypes=sorted({str(t.dtype) for t in kv_caches.values()}),
        )
        role = self._settings.role
        geometry = _kv_geometry(self._geometry)
        cache_format = self._cache_format
        if role is None or geometry is None or cache_format is None:
            log.warning(
                "pdproxy connector: no KV transfer (role %s, geometry %s, cache format %s)",
                role,
                geometry,
                cache_format,
            )
            return
        rank = _tp_rank()
        settings = self._settings
        self._reporter = self._start_reporter(rank, geometry.tp_size)
        if role is Role.PREFILL:
            address = f"{settings.host}:{settings.kv_port + rank}"
            producer = ProducerWorker(rank, geometry, cache_format, address, self._transferred)
            producer.register(kv_caches)
            sender = TcpSender(
                producer.sent,
                max_queued_bytes=settings.kv_send_queue_bytes,
                send_timeout=settings.kv_send_timeout_s,
                delay=settings.kv_send_delay_s,
            )
            producer.attach(sender)
            self._producer = producer
            self._closers.append(sender)
            return
        consumer = ConsumerWorker(
            rank, self._block_size, cache_format, settings.kv_timeout_s, self._transferred
        )
        consumer.register(kv_caches)
        buffer = TransferBuffer(settings.kv_buffer_bytes, settings.kv_buffer_ttl_s)
        receiver = TcpReceiver(settings.host, settings.kv_port + rank, buffer)
        consumer.attach(receiver)
        self._consumer = consumer
        self._closers.append(receiver)
        log.info("pdproxy connector: rank %d receives KV on port %d", rank, settings.kv_port + rank)

    def _start_reporter(self, rank: int, ranks: int) -> StatsReporter | None:
        """Each rank reports its own transfers; the proxy counts a transfer once every rank of
        the receiving side did (as vLLM's KVOutputAggregator counts ranks)."""
        settings = self._settings
        if not settings.announces:
            return None
        assert settings.registry is not None and settings.http_address is not None
        assert settings.role is not None
        secret_file = settings.registry_secret_file
        secret = None if secret_file is None else read_secret_file(secret_file)
        reporter = StatsReporter.connect(
            settings.registry,
            settings.role,
            settings.http_address,
            rank,
            ranks,
            secret,
            refresh_s=settings.announce_interval_s,
        )
        self._closers.append(reporter)
        return reporter

    def _transferred(self, record: TransferRecord) -> None:
        self._record("transfer", **asdict(record))
        if self._reporter is not None:
            self._reporter.report(
                TransferStat(
                    record.transfer,
                    record.peer,
                    record.bytes,
                    record.blocks,
                    record.seconds,
                    record.outcome,
                )
            )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._consumer is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdproxyConnectorMetadata)
        try:
            self._consumer.start(meta.loads, meta.cancelled)
        except Exception:  # a transfer bug must never take the engine down
            log.exception("pdproxy connector: starting KV loads failed")

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete between steps, before vLLM schedules the request

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        if self._producer is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdproxyConnectorMetadata)
        if meta.sends:
            try:
                self._producer.save_layer(layer_name, kv_layer, meta.sends)
            except Exception:  # the decode side times out and fails the request instead
                log.exception("pdproxy connector: sending KV of %s failed", layer_name)

    def wait_for_save(self) -> None:
        return None  # each layer was copied out when saved: the blocks are free to reuse

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._consumer is None:
            return KVConnectorTransferResults()
        try:
            loaded, failed = self._consumer.poll()
        except Exception:
            log.exception("pdproxy connector: receiving KV failed")
            return KVConnectorTransferResults()
        # Failed loads count as finished too: vLLM then fails or recomputes them.
        return KVConnectorTransferResults(finished_recving=loaded | failed, failed_recving=failed)

    # -- scheduler side ----------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self._load.arrived(request.request_id, request.num_prompt_tokens)
        params = request.sampling_params
        key = transfer_key(request.request_id, getattr(request, "external_req_id", None))
        if self._settings.role is Role.PREFILL:
            # The proxy says how the decode splits heads (pdproxy.proxy.kv_params).
            decode_tp = decode_tp_size(request.kv_transfer_params)
            self._sending.arrived(request.request_id, key, request.num_prompt_tokens, decode_tp)
        self._record(
            "new",
            request_id=request.request_id,
            prompt_tokens=request.num_prompt_tokens,
            max_tokens=None if params is None else params.max_tokens,
            kv_transfer_params=request.kv_transfer_params,
            transfer=None if key is None else key.stats_id,
        )

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._settings.role is not Role.DECODE or self._cache_format is None:
            return 0, False  # computed here: this side cannot write received KV
        key = transfer_key(request.request_id, getattr(request, "external_req_id", None))
        tokens = self._loading.matched(
            request.request_id, key, request.num_prompt_tokens, num_computed_tokens
        )
        return tokens, tokens > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._load.scheduled(request.request_id)
        if self._settings.role is Role.DECODE and num_external_tokens:
            block_ids = list(blocks.get_block_ids()[0])
            self._loading.allocated(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = PdproxyConnectorMetadata()
        if self._settings.role is Role.PREFILL:
            self._count_computed(scheduler_output)
            meta.sends = self._sends(scheduler_output)
        elif self._settings.role is Role.DECODE:
            meta.loads, meta.cancelled = self._loading.take()
        return meta

    def _count_computed(self, scheduler_output: Any) -> None:
        """How far each scheduled prompt is computed: the prefill work the load announces."""
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._load.computed(new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            done = cached.num_computed_tokens[index] + scheduled.get(request_id, 0)
            self._load.computed(request_id, done)

    def _sends(self, scheduler_output: Any) -> list[SendSpec]:
        if not len(self._sending):
            return []
        scheduled = scheduler_output.num_scheduled_tokens
        sends = []
        for new in scheduler_output.scheduled_new_reqs:
            spec = self._sending.scheduled(
                new.req_id,
                list(new.block_ids[0]),
                True,
                new.num_computed_tokens,
                scheduled.get(new.req_id, 0),
            )
            if spec is not None:
                sends.append(spec)
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        for index, request_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[index]
            spec = self._sending.scheduled(
                request_id,
                None if new_blocks is None else list(new_blocks[0]),
                request_id in resumed,
                cached.num_computed_tokens[index],
                scheduled.get(request_id, 0),
            )
            if spec is not None:
                sends.append(spec)
        return sends

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._load.finished(request.request_id)
        self._sending.finished(request.request_id)
        self._loading.finished(request.request_id)
        self._record(
            "finished",
            request_id=request.request_id,
            output_tokens=request.num_output_tokens,
            status=str(getattr(request, "status", "")),
        )
        return False, None

    def shutdown(self) -> None:
        for closer in self._closers:
            if isinstance(closer, StatsReporter):
                closer.stop()
            else:
                closer.close()
        self._closers = []
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


def _max_model_len(vllm_config: Any) -> int | None:
    """The context length vLLM runs the model with: the proxy refuses, before any prefill,
    requests for more output tokens than that."""
    return context_length(getattr(vllm_config.model_config, "max_model_len", None))


def _kv_geometry(announced: Geometry) -> KvGeometry | None:
    """The geometry the transfer needs, or None when vLLM did not tell all of it."""
    try:
        return KvGeometry(
            tp_size=announced.tp_size,  # type: ignore[arg-type]
            block_size=announced.block_size,  # type: ignore[arg-type]
            num_layers=announced.num_layers,  # type: ignore[arg-type]
            num_kv_heads=1 if announced.is_mla else announced.num_kv_heads,  # type: ignore[arg-type]
            head_dim=announced.head_dim,  # type: ignore[arg-type]
            kv_dtype=announced.kv_dtype or "",
            is_mla=bool(announced.is_mla),
            kv_layout=None if announced.kv_layout is None else KvLayout(announced.kv_layout),
        )
    except (ValueError, TypeError):
        return None


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _cache_format(vllm_config: Any, head_dim: int | None) -> CacheFormat | None:
    """vLLM 0.32's per-layer cache: [blocks, heads, block_size, 2 * head_dim], filled the way
    the CPU backend's kernels for this model lay out pages on CPU (see pdproxy.vllm_side.kv)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return CacheFormat.BHNC
    if head_dim is None:
        return None
    isa = cpu_isa(vllm_config, head_dim)
    found = format_for_isa(isa)
    if found is None:
        log.error(
            "pdproxy connector: the CPU attention ISA %r lays out KV in a way not checked", isa
        )
    return found
