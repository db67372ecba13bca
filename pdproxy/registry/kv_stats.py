"""KV transfer statistics: per-rank reports in, one record per transfer out. Pure: the caller
passes `now`, and nothing here reads a clock or touches a socket.

Every TP rank of the prefill (P) and of the decode (D) instance of a transfer reports its part
under the transfer's id (the "stats" registry op). A side of a transfer is complete when all of
its `ranks` reported, counted as a set of the ranks seen (as vLLM's KVOutputAggregator counts
them); its view is then the sum of its ranks' bytes and blocks, the longest of their durations
(the ranks move their slices in parallel) and the worst of their outcomes (SEVERITY).

Each transfer id is counted once:
- as soon as its decode side is complete, with the decode's view: the receiver is the one that
  knows whether the KV arrived, and how long it took to arrive;
- otherwise at its deadline, `ttl` after its first report: with the prefill's view if the
  prefill side is complete (failures only the prefill saw: a decode that was unreachable, or
  that never asked because its request never came), else as "incomplete" (a rank never
  reported: nothing about the transfer is certain, so it carries no bytes and no duration).
A counted id is remembered for `ttl` more, so that the other side's reports, which may arrive
later, are ignored instead of counted again. At most `capacity` ids are kept: a new id beyond
that settles the oldest one early, exactly as its deadline would have.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pdproxy.base.roles import Role
from pdproxy.registry.messages import TransferOutcome

INCOMPLETE = "incomplete"
# Least to most severe: a side's outcome is the worst of its ranks'. An error (something broke)
# outranks a timeout (waited, gave up), which outranks missing KV (nothing to move) and dropped
# KV (moved, then freed unused).
SEVERITY: tuple[TransferOutcome, ...] = (
    TransferOutcome.OK,
    TransferOutcome.DROPPED,
    TransferOutcome.MISSING,
    TransferOutcome.TIMEOUT,
    TransferOutcome.ERROR,
)
_RANK = {outcome: index for index, outcome in enumerate(SEVERITY)}
# Every value a record's outcome (and so pdproxy_kv_transfers_total's label) can take.
COUNTED_OUTCOMES: tuple[str, ...] = (*(o.value for o in SEVERITY), INCOMPLETE)
# Longer than PdproxyConnector's default bounded waits (a decode gives up on missing KV after
# 30 s and frees unclaimed KV after 60 s), so the decode's report still arrives in time to be
# the one counted; a failure only the prefill saw shows in the metrics this late.
DEFAULT_TTL_S = 120.0
DEFAULT_CAPACITY = 65536


@dataclass(frozen=True, slots=True)
class RankReport:
    """One rank's report of one transfer, its peer already resolved by the caller."""

    transfer_id: str
    role: Role  # of the reporting instance
    instance: str  # the reporting instance's http address
    peer: str | None  # the other instance's http address; None if it is not registered
    rank: int
    ranks: int
    bytes: int
    blocks: int
    seconds: float
    outcome: TransferOutcome


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """One transfer, counted once."""

    transfer_id: str
    outcome: str  # a TransferOutcome value, or INCOMPLETE
    prefill: str | None  # http addresses; None when neither side could name it
    decode: str | None
    bytes: int
    blocks: int
    seconds: float | None  # None when incomplete
    seen_by: Role | None  # whose view was counted (None: incomplete)


@dataclass(slots=True)
class _Side:
    instance: str
    peer: str | None
    ranks: int
    seen: set[int] = field(default_factory=set)
    bytes: int = 0
    blocks: int = 0
    seconds: float = 0.0
    outcome: TransferOutcome = TransferOutcome.OK

    def add(self, report: RankReport) -> bool:
        """Take one rank's report; False (ignored) if that rank reported already or the report
        disagrees on who this side is (another instance, another TP size)."""
        if (report.instance, report.ranks) != (self.instance, self.ranks):
            return False
        if report.rank in self.seen:
            return False
        self.seen.add(report.rank)
        self.bytes += report.bytes
        self.blocks += report.blocks
        self.seconds = max(self.seconds, report.seconds)
        if _RANK[report.outcome] > _RANK[self.outcome]:
            self.outcome = report.outcome
        return True

    @property
    def complete(self) -> bool:
        return len(self.seen) == self.ranks


@dataclass(slots=True)
class _Transfer:
    deadline: float
    sides: dict[Role, _Side] = field(default_factory=dict)
    counted: bool = False


class KvTransferStats:
    def __init__(self, ttl: float = DEFAULT_TTL_S, capacity: int = DEFAULT_CAPACITY) -> None:
        if ttl <= 0:
            raise ValueError("ttl must be positive")
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._ttl = ttl
        self._capacity = capacity
        # Oldest deadline first: pending ids keep the deadline of their first report, counted
        # ones move to the end with a fresh one (deadlines grow with a non-decreasing `now`).
        self._transfers: OrderedDict[str, _Transfer] = OrderedDict()

    def __len__(self) -> int:
        """Ids held: pending, or counted and remembered."""
        return len(self._transfers)

    def report(self, report: RankReport, now: float) -> list[TransferRecord]:
        """Take one rank's report; the records it completes (at most the report's own transfer,
        plus an older one settled early when the table is full)."""
        records: list[TransferRecord] = []
        transfer = self._transfers.get(report.transfer_id)
        if transfer is None:
            if len(self._transfers) >= self._capacity:
                key, oldest = self._transfers.popitem(last=False)
                if not oldest.counted:
                    records.append(_settled(key, oldest))
            transfer = _Transfer(now + self._ttl)
            self._transfers[report.transfer_id] = transfer
        if transfer.counted:
            return records  # the other side, or a late rank: this id was counted already
        side = transfer.sides.get(report.role)
        if side is None:
            side = transfer.sides[report.role] = _Side(report.instance, report.peer, report.ranks)
        if not side.add(report):
            return records
        if report.role is Role.DECODE and side.complete:
            records.append(_record(report.transfer_id, transfer.sides, Role.DECODE))
            transfer.counted = True
            transfer.sides.clear()  # only the id is remembered
            transfer.deadline = now + self._ttl
            self._transfers.move_to_end(report.transfer_id)
        return records

    def expire(self, now: float) -> list[TransferRecord]:
        """Settle every pending transfer whose deadline passed; forget counted ones as old."""
        records: list[TransferRecord] = []
        while self._transfers:
            key, transfer = next(iter(self._transfers.items()))
            if transfer.deadline > now:
                break
            del self._transfers[key]
            if not transfer.counted:
                records.append(_settled(key, transfer))
        return records


def _settled(transfer_id: str, transfer: _Transfer) -> TransferRecord:
    """A transfer whose decode side never completed: the prefill's view, or incomplete."""
    prefill = transfer.sides.get(Role.PREFILL)
    if prefill is not None and prefill.complete:
        return _record(transfer_id, transfer.sides, Role.PREFILL)
    prefill_name, decode_name = _pair(transfer.sides)
    return TransferRecord(transfer_id, INCOMPLETE, prefill_name, decode_name, 0, 0, None, None)


def _record(transfer_id: str, sides: dict[Role, _Side], seen_by: Role) -> TransferRecord:
    side = sides[seen_by]
    prefill, decode = _pair(sides)
    return TransferRecord(
        transfer_id,
        side.outcome.value,
        prefill,
        decode,
        side.bytes,
        side.blocks,
        side.seconds,
        seen_by,
    )


def _pair(sides: dict[Role, _Side]) -> tuple[str | None, str | None]:
    """(prefill, decode): each side's own word for itself first, else its peer's."""
    prefill, decode = sides.get(Role.PREFILL), sides.get(Role.DECODE)
    return (
        prefill.instance if prefill is not None else decode.peer if decode is not None else None,
        decode.instance if decode is not None else prefill.peer if prefill is not None else None,
    )
