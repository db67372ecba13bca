"""The registry's I/O shell: a ZMQ ROUTER socket feeding the pure RegistryTable and the pure KV
transfer aggregator (kv_stats), plus the sweep that expires silent instances and settles
transfers even when no message ever arrives again (not right after the proxy itself stalled:
pdproxy.registry.stall).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import zmq
import zmq.asyncio

from pdproxy.base.roles import Role
from pdproxy.config import Settings
from pdproxy.ids import Address, AddressError, parse_address
from pdproxy.metrics import Metrics
from pdproxy.pairing.consistency import contradiction
from pdproxy.registry.auth import RegistryGate, Verifier, parse_cidrs
from pdproxy.registry.kv_stats import KvTransferStats, RankReport, TransferRecord
from pdproxy.registry.messages import Announcement, Leave, Reason, Rejected, Stats
from pdproxy.registry.stall import StallGuard
from pdproxy.registry.table import Change, Instance, RegistryTable, Source

log = logging.getLogger("pdproxy.registry")

# How much registry work to do back to back before yielding to the HTTP side: a flood of
# frames must not starve request handling (pyzmq returns ready frames without yielding). Bounded
# by time and bytes, not by a count of messages: one frame may cost far more than another.
TURN_SECONDS = 0.002
TURN_BYTES = 256 * 1024
_MAX_LOGGED_SENDERS = 1024
_QUEUED_MESSAGES_PER_PEER = 256
# A registry message is [identity, payload]; anything past that is counted, never kept.
_FRAMES_KEPT = 2
_DRAIN_BATCH = 1024


class RejectionLog:
    """Log each (sender, reason) once, and at most `burst` lines per `window` seconds overall:
    a sender that changes identity for every frame must not flood the log either."""

    def __init__(
        self, capacity: int = _MAX_LOGGED_SENDERS, burst: int = 20, window: float = 10.0
    ) -> None:
        self._seen: OrderedDict[tuple[bytes, Reason], None] = OrderedDict()
        self._capacity = capacity
        self._burst = burst
        self._window = window
        self._window_start = float("-inf")
        self._logged = 0
        self.suppressed = 0

    def should_log(self, sender: bytes, reason: Reason, now: float) -> bool:
        key = (sender[:128], reason)
        if key in self._seen:
            self._seen.move_to_end(key)
            return False
        self.flush(now)
        if self._logged >= self._burst:
            self.suppressed += 1  # not remembered: it may be logged once the budget allows
            return False
        self._logged += 1
        self._seen[key] = None
        if len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
        return True

    def flush(self, now: float) -> None:
        """Start a new window once the old one is over, reporting what it left unlogged."""
        if now - self._window_start < self._window:
            return
        if self.suppressed:
            log.warning("registry: %d more rejections were not logged", self.suppressed)
        self._window_start, self._logged, self.suppressed = now, 0, 0


class TurnBudget:
    """How much work one turn of the event loop may take: `spend` says when it is used up
    (then yield, and `restart`). Time is counted from the restart, so a wait for a frame
    counts too: at worst one yield more than needed."""

    def __init__(
        self,
        seconds: float = TURN_SECONDS,
        max_bytes: int = TURN_BYTES,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._seconds = seconds
        self._max_bytes = max_bytes
        self._clock = clock
        self._started = clock()
        self._bytes = 0

    def restart(self) -> None:
        self._started = self._clock()
        self._bytes = 0

    def spend(self, size: int) -> bool:
        """Count `size` bytes handled; True once the turn's time or bytes are used up."""
        self._bytes += size
        return self._bytes >= self._max_bytes or self._clock() - self._started >= self._seconds


class RegistryServer:
    def __init__(
        self,
        settings: Settings,
        table: RegistryTable,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        kv_stats: KvTransferStats | None = None,
    ) -> None:
        self._settings = settings
        self._table = table
        self._metrics = metrics
        self._kv_stats = kv_stats if kv_stats is not None else KvTransferStats()
        self._clock = clock
        self._wall_clock = wall_clock  # signed timestamps are wall-clock seconds
        self._gate = gate_from_settings(settings)
        self._rejections = RejectionLog()
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # Told each prefill's announced work as it arrives (control.WorkSink), if set.
        self.work_listener: Callable[[Address, int], None] | None = None

    @property
    def sweep_interval(self) -> float:
        return min(1.0, self._table.ttl / 4)

    def start(self) -> None:
        """Bind and start the receive and sweep loops (raises if the address is taken)."""
        self._context = zmq.asyncio.Context()
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._settings.registry_max_message_bytes)
        # Messages queued per peer before ZMQ drops more. This bounds ordinary floods; it does
        # not bound one huge multipart message (libzmq holds it whole): only network isolation
        # or authenticated transport can.
        sock.setsockopt(zmq.RCVHWM, _QUEUED_MESSAGES_PER_PEER)
        if "[" in self._settings.registry_bind:  # an IPv6 literal, bracketed
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.bind(self._settings.registry_bind)
        except zmq.ZMQError as exc:
            sock.close()
            self._context.term()
            raise OSError(
                f"cannot bind the registry on {self._settings.registry_bind} "
                f"(registry_bind, --registry-bind): {exc}"
            ) from exc
        self._socket = sock
        self._tasks = [
            asyncio.create_task(self._receive_loop(sock), name="registry-receive"),
            asyncio.create_task(self._sweep_loop(), name="registry-sweep"),
        ]
        log.info(
            "registry listening on %s (ttl %.1fs, %s)",
            self._settings.registry_bind,
            self._table.ttl,
            _auth_summary(self._settings),
        )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._context is not None:
            self._context.term()
            self._context = None

    async def _receive_loop(self, sock: zmq.asyncio.Socket) -> None:
        plain: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        budget = TurnBudget()
        while True:
            frames, peer = await _receive_message(sock, plain)
            try:
                self.handle(frames, peer)
            except Exception:  # a bug here must not kill the registry
                log.exception("registry: unexpected error handling a frame")
            if budget.spend(sum(len(frame) for frame in frames)):
                await asyncio.sleep(0)
                budget.restart()

    def handle(self, frames: list[bytes], peer: str | None = None) -> None:
        """Process one ROUTER message: [sender identity, payload]; `peer` is the IP address
        the message came from, when the transport tells it."""
        sender = frames[0] if frames else b""
        try:
            if len(frames) != 2:
                raise Rejected(Reason.FRAMING, "expected exactly one payload frame")
            admitted = self._gate.admit(frames[1], self._wall_clock(), peer)
            message = admitted.message
            now = self._clock()
            if isinstance(message, Announcement):
                change, instance = self._table.announce(message, now, signed=admitted.signed)
                self._on_announced(change, instance)
            elif isinstance(message, Leave):
                gone = self._table.remove(message.http_address, signed=admitted.signed)
                if gone is not None:
                    log.info("registry: %s %s left", _role_name(gone), gone.name)
                    self._on_departed(gone)
            else:
                self._on_stats(message, now)
        except Rejected as exc:
            self._metrics.registry_messages.labels("rejected", exc.reason.value).inc()
            if self._rejections.should_log(sender, exc.reason, self._clock()):
                log.warning("registry: rejected a message from %r: %s", sender[:128], exc)
            return
        self._metrics.registry_messages.labels("accepted", "ok").inc()

    def _on_announced(self, change: Change, instance: Instance) -> None:
        load = instance.load
        if (
            self.work_listener is not None
            and change is not Change.REFRESHED
            and load is not None
            and load.prefill_tokens is not None
        ):
            self.work_listener(instance.http_address, load.prefill_tokens)
        if change is Change.REGISTERED:
            log.info(
                "registry: %s %s registered (zmq %s, %s%s)",
                _role_name(instance),
                instance.name,
                instance.zmq_address,
                instance.source.value,
                f", model {instance.model}" if instance.model else "",
            )
            self._metrics.instance_joined(instance.name)
        if change in (Change.REGISTERED, Change.UPDATED):
            self.publish_counts()
            others = (entry.instance for entry in self._table.registrations())
            problem = contradiction(instance, others)
            if problem is not None:
                log.warning("registry: %s", problem)

    def _on_stats(self, stats: Stats, now: float) -> None:
        """Feed one rank's transfer reports to the aggregator. Only a registered instance may
        report (so every label value is one the registry bounds); its TTL is not refreshed:
        only announcements say an instance is alive."""
        sender = self._table.get(stats.http_address)
        if sender is None or sender.role is not stats.role:
            raise Rejected(
                Reason.UNKNOWN_INSTANCE,
                f"{stats.http_address} is not registered as {stats.role}",
            )
        other = stats.role.other
        for transfer in stats.transfers:
            peer = self._table.lookup(transfer.peer, other)
            report = RankReport(
                transfer_id=transfer.transfer_id,
                role=stats.role,
                instance=sender.name,
                peer=None if peer is None else peer.name,
                rank=stats.rank,
                ranks=stats.ranks,
                bytes=transfer.bytes,
                blocks=transfer.blocks,
                seconds=transfer.seconds,
                outcome=transfer.outcome,
            )
            self._count_transfers(self._kv_stats.report(report, now))

    def _count_transfers(self, records: list[TransferRecord]) -> None:
        for record in records:
            self._metrics.kv_transfer_counted(record, self._registered_pair(record))

    def _registered_pair(self, record: TransferRecord) -> tuple[str, str] | None:
        """(prefill, decode) if both are registered now in those roles: a transfer counted
        after one of them left adds to no per-pair label set."""
        if record.prefill is None or record.decode is None:
            return None
        for name, role in ((record.prefill, Role.PREFILL), (record.decode, Role.DECODE)):
            try:
                instance = self._table.get(parse_address(name))
            except AddressError:
                return None
            if instance is None or instance.role is not role:
                return None
        return record.prefill, record.decode

    def _on_departed(self, instance: Instance) -> None:
        self._metrics.instance_left(instance.name)
        self.publish_counts()

    def add_static(self, instance: Instance) -> None:
        """An operator's registration (admin API); Rejected when the registry is full."""
        known = any(
            e.instance.http_address == instance.http_address for e in self._table.registrations()
        )
        self._table.add_static(instance, self._clock())
        log.info("registry: %s %s registered by an admin", _role_name(instance), instance.name)
        if not known:
            self._metrics.instance_joined(instance.name)
        self.publish_counts()

    def discovered(self, pod: Instance) -> None:
        """Kubernetes discovery saw a pod added or changed (pdproxy.registry.kubernetes)."""
        try:
            change = self._table.discovered(pod, self._clock())
        except Rejected as exc:
            log.warning("registry: discovered pod %s not registered: %s", pod.name, exc)
            return
        if change is Change.REFRESHED:
            return
        instance = self._table.get(pod.http_address)
        assert instance is not None
        if change is Change.REGISTERED:
            self._metrics.instance_joined(instance.name)
        log.info(
            "registry: %s pod %s %s (zmq %s, %s%s)",
            instance.role,
            instance.name,
            change.value,
            instance.zmq_address,
            "ready" if instance.ready else "not ready",
            ", drained by its annotation" if instance.pod_drained else "",
        )
        self.publish_counts()

    def undiscovered(self, http_address: Address) -> None:
        """Kubernetes discovery saw a pod deleted: it leaves the table at once."""
        gone = self._table.undiscovered(http_address, self._clock())
        if gone is not None:
            log.info("registry: %s pod %s deleted", gone.role, gone.name)
            self._on_departed(gone)

    def remove(self, http_address: Address) -> bool:
        """An operator's removal (admin API), static instances included."""
        gone = self._table.remove(http_address, by_operator=True)
        if gone is None:
            return False
        log.info("registry: %s %s removed by an admin", _role_name(gone), gone.name)
        self._on_departed(gone)
        return True

    def publish_counts(self) -> None:
        for role in Role:
            self._metrics.registry_instances.labels(role).set(self._table.count(role))

    def sweep(self) -> list[Instance]:
        now = self._clock()
        self._rejections.flush(now)
        expired = self._table.expire(now)
        for instance in expired:
            log.warning(
                "registry: %s %s expired (no message for %.1fs)",
                _role_name(instance),
                instance.name,
                self._table.ttl,
            )
            self._on_departed(instance)
        self._count_transfers(self._kv_stats.expire(now))
        return expired

    async def _sweep_loop(self) -> None:
        guard = StallGuard(self.sweep_interval, self._clock())
        while True:
            await asyncio.sleep(self.sweep_interval)
            if not guard.may_judge(self._clock()):
                self._metrics.registry_stalls.inc()
                log.warning(
                    "registry: %.1fs since the last sweep (the proxy did not run); instances are "
                    "judged once it ran a whole sweep period and read what their workers sent",
                    guard.stalled_for,
                )
                continue
            try:
                self.sweep()
            except Exception:
                log.exception("registry: sweep failed")


async def _receive_message(
    sock: zmq.asyncio.Socket, plain: zmq.Socket[bytes]
) -> tuple[list[bytes], str | None]:
    """One multipart message. Only the first frames are copied out. libzmq hands over a
    multipart message only once all of it arrived, so the rest is drained without awaiting
    (through `plain`, a synchronous shadow of the same socket: an asyncio recv per frame costs
    tens of microseconds), yielding now and then so a huge message cannot stall HTTP."""
    first = await sock.recv(copy=False)
    peer = _peer_address(first)
    kept = [first.bytes]
    more = first.more
    extra = 0
    while more:
        frame = plain.recv(zmq.NOBLOCK, copy=False)
        more = frame.more
        if len(kept) < _FRAMES_KEPT:
            kept.append(frame.bytes)
        else:
            extra += 1
            if extra % _DRAIN_BATCH == 0:
                await asyncio.sleep(0)
    # One empty frame stands for all the extra ones: `handle` sees the count, not the payloads.
    return kept + [b""] * min(extra, 1), peer


def _peer_address(frame: zmq.Frame) -> str | None:
    """The sender's IP as libzmq saw the connection (TCP only)."""
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    return address if isinstance(address, str) and address else None


def gate_from_settings(settings: Settings) -> RegistryGate:
    secret = settings.registry_key
    verifier = (
        None
        if secret is None
        else Verifier(secret.get_secret_value().encode(), settings.registry_max_skew_seconds)
    )
    return RegistryGate(
        verifier,
        allow_unsigned_v0=settings.registry_allow_unsigned_v0,
        v0_cidrs=parse_cidrs(settings.registry_v0_cidrs),
        address_cidrs=parse_cidrs(settings.registry_address_cidrs),
    )


def _auth_summary(settings: Settings) -> str:
    """What the registry admits, for the startup log line (never the secret itself)."""
    if not settings.registry_signed:
        parts = ["unauthenticated"]
    else:
        v0 = (
            f"unsigned v0 allowed (at most {settings.unsigned_instance_cap} instances)"
            if settings.registry_allow_unsigned_v0
            else "v0 refused"
        )
        parts = [f"v1 must be signed, {v0}"]
    if settings.registry_v0_cidrs:
        parts.append("v0 from " + " ".join(settings.registry_v0_cidrs))
    if settings.registry_address_cidrs:
        parts.append("addresses in " + " ".join(settings.registry_address_cidrs))
    return "; ".join(parts)


def _role_name(instance: Instance) -> str:
    kind = "static " if instance.source is Source.STATIC else ""
    return kind + instance.role
