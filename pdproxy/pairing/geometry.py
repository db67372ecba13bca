"""KV geometry: may a (prefill, decode) pair exchange KV, and if so, who reads what. Pure.

No torch, no I/O, no clock. `plan_pair` answers with a `PairPlan` (both geometries known and
compatible: TP ratio, block-size ratio, which prefill ranks each decode rank reads and on which
port, KV bytes per token), `Unverified` (allowed on trust: a geometry is unknown) or
`Incompatible` (a `Mismatch` kind, which may label a metric, plus a sentence for an operator).

Each rule mirrors vLLM (files read: `vllm/distributed/kv_transfer/kv_connector/utils.py`
`TpKVTopology` / `TransferTopology`; `.../v1/nixl_connector.py` and `.../v1/nixl/base_worker.py`
`add_remote_agent`, `_validate_remote_agent_handshake`, `compute_nixl_compatibility_hash`,
`NixlConnector.get_required_kvcache_layout`; `.../v1/nixl/tp_mapping.py` `compute_tp_mapping`;
`.../v1/p2p/p2p_nccl_connector.py` and `p2p_nccl_engine.py`;
`vllm/model_executor/layers/linear.py` `QKVParallelLinear`):

- Heads per rank. A rank holds `num_kv_heads // tp` consecutive heads; past `tp ==
  num_kv_heads` every rank holds one head and neighbouring ranks share it (rank r holds head
  `r * num_kv_heads // tp`). vLLM requires `num_kv_heads % tp == 0`, or `tp % num_kv_heads ==
  0` once heads replicate (`QKVParallelLinear`: `divide(...)`, shard rank `tp_rank //
  num_kv_head_replicas`; `_physical_head_range` in utils.py). Any other split is invalid.
- MLA. One latent head (`kv_lora_rank + qk_rope_head_dim` wide) on every rank, no separate K
  and V, so no factor 2 in the bytes; it is never split (`replicates_kv_cache`: "MLA is always
  replicated"). NHD/HND do not apply, so layouts are not compared.
- p2p_nccl. Rank r sends to the peer's KV port + r (`port + self._rank`), and the receiver
  refuses any tensor whose shape differs but for the token axis ("only symmetric TP is
  supported", `check_tensors_except_dim`): same TP, block size, heads, head_dim, dtype,
  layout, layers.
- pdproxy (pdproxy.vllm_side.connector): what that connector does. Its wire is token-major and
  each side reads and writes its own blocks through their logical axes, so layouts may differ
  and the decode's block size may be any multiple of the prefill's. TP sizes may differ when
  one divides the other: the proxy tells the prefill the decode's TP (pdproxy.proxy.kv_params)
  and each prefill rank sends every decode rank the heads it holds (pdproxy.vllm_side.kv
  `plan_reads`; replicated heads are sent once, from the first rank holding them).
- nixl:
  * same model, layers, total KV heads, head_dim, KV dtype and attention kind: the factors of
    `compute_nixl_compatibility_hash`;
  * `tp_ratio` (`TpKVTopology.tp_ratio`, decode being local): `decode_tp // prefill_tp` when
    decode TP >= prefill TP, `-(prefill_tp // decode_tp)` otherwise; one must divide the other;
  * decode rank r reads prefill rank `r // tp_ratio` when tp_ratio > 0, prefill ranks
    `r * |tp_ratio| .. + |tp_ratio| - 1` when < 0 (`get_target_remote_ranks`); MLA reads one
    replica, `r * prefill_tp // decode_tp` (`compute_tp_mapping`);
  * prefill TP > decode TP with prefill heads replicated is refused for non-MLA models
    (`_validate_remote_agent_handshake`: `not (tp_ratio < 0 and is_kv_replicated(...))`);
  * `block_size_ratio = decode_block // prefill_block`, which must divide (`block_size_ratio`);
    non-MLA with prefill TP > decode TP needs equal block sizes ("Different local/remote block
    sizes are not supported when P TP > D TP");
  * non-MLA layouts must be equal ("Heterogeneous TP expects same kv_cache_layout"; vLLM's
    `enable_permute_local_kv` escape hatch is not assumed), and must be HND when the TP sizes
    differ, unless the prefill side replicates heads ("Heterogeneous TP head-dimension
    splitting requires contiguous heads. Use HND layout on the prefill side.").
- nixl_push (NixlPushConnector, `.../v1/nixl/push_worker.py`): the NIXL base worker's
  handshake and topology (`add_remote_agent`, `TransferTopology`), so nixl's rules; the prefill
  writes where the decode registered, `block_size_ratio` mapping the block ids.
- mooncake (`.../v1/mooncake/mooncake_connector.py`): `_get_tp_ratio` asserts one TP divides
  the other (heads re-sharded, replicated heads sent once: `_compute_sender_transfer_plan`);
  block ids map one to one and `_validate_asymmetric_region_lengths` wants each region's bytes
  per block to agree per head, so block sizes must be equal; layouts are not compared, the
  connector sets LBHNC on both sides (`get_required_kvcache_layout`); MLA is replicated.
- KV ports: rank r's KV endpoint is the instance's zmq_address port + r (DESIGN.md section 2;
  P2pNcclEngine binds `kv_port + port_offset`), on the announced host.
- KV bytes per token per rank (DESIGN.md section 4): `2 x layers x heads_per_rank x head_dim x
  dtype bytes`; MLA `layers x head_dim x dtype bytes`.

Instances that announced no model or no connector agree with any (as in compatibility.py); two
known geometries under no known connector get p2p_nccl's rules, the strictest, because v0
announcements come from stock P2pNcclEngine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from pdproxy.registry.messages import Connector, Geometry
from pdproxy.registry.table import Instance

MAX_PORT = 65535
# Connectors whose decode leg names the prefill's connector (its bootstrap server or side
# channel): a pair needs both sides to announce the kind, never one side alone.
NAMES_ITS_PEER = frozenset((Connector.MOONCAKE, Connector.NIXL_PUSH))


class KvLayout(StrEnum):
    NHD = "NHD"  # [blocks, block_size, heads, head_dim]: a head's tokens are strided
    HND = "HND"  # [blocks, heads, block_size, head_dim]: a head is one contiguous run


# Alias -> canonical name. "fp8" is vLLM's e4m3 (on CUDA); e4m3 and e5m2 stay distinct formats.
_DTYPE_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "float16": "float16",
        "half": "float16",
        "fp16": "float16",
        "bfloat16": "bfloat16",
        "bf16": "bfloat16",
        "float32": "float32",
        "float": "float32",
        "fp32": "float32",
        "fp8": "fp8_e4m3",
        "fp8_e4m3": "fp8_e4m3",
        "float8_e4m3fn": "fp8_e4m3",  # torch's name
        "fp8_e5m2": "fp8_e5m2",
        "float8_e5m2": "fp8_e5m2",  # torch's name
    }
)
_DTYPE_BYTES: Mapping[str, int] = MappingProxyType(
    {"float16": 2, "bfloat16": 2, "float32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1}
)


def canonical_dtype(name: str) -> str:
    """The canonical name of a KV dtype; unknown names come back lower-cased, unprefixed."""
    key = name.strip().lower().removeprefix("torch.")
    return _DTYPE_ALIASES.get(key, key)


def dtype_bytes(name: str) -> int | None:
    """Bytes per element, or None for a dtype we do not know (it may still pair on equality)."""
    return _DTYPE_BYTES.get(canonical_dtype(name))


@dataclass(frozen=True, slots=True)
class KvGeometry:
    """One instance's KV cache geometry, every field known."""

    tp_size: int
    block_size: int
    num_layers: int
    num_kv_heads: int  # total, before TP; MLA: 1 (the latent)
    head_dim: int  # MLA: kv_lora_rank + qk_rope_head_dim
    kv_dtype: str
    is_mla: bool = False
    kv_layout: KvLayout | None = None  # only MLA may leave it out: it has no head axis

    def __post_init__(self) -> None:
        for name in ("tp_size", "block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.kv_dtype:
            raise ValueError("kv_dtype must be a non-empty string")
        if not self.is_mla and self.kv_layout is None:
            raise ValueError("a non-MLA geometry needs kv_layout")

    @property
    def dtype(self) -> str:
        return canonical_dtype(self.kv_dtype)

    @property
    def replicated(self) -> bool:
        """Whether ranks hold copies of the same heads rather than disjoint shares."""
        return self.is_mla or self.tp_size > self.num_kv_heads

    @property
    def heads_per_rank(self) -> int:
        return 1 if self.is_mla else max(1, self.num_kv_heads // self.tp_size)

    def rank_heads(self, rank: int) -> range:
        """The global KV head indices rank `rank` holds (MLA: the latent, head 0)."""
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank {rank} outside tp {self.tp_size}")
        if self.is_mla:
            return range(1)
        if self.tp_size <= self.num_kv_heads:
            per = self.num_kv_heads // self.tp_size
            return range(rank * per, (rank + 1) * per)
        head = rank * self.num_kv_heads // self.tp_size
        return range(head, head + 1)

    def problem(self) -> str | None:
        """Why vLLM could not run this geometry at all, or None."""
        heads, tp = self.num_kv_heads, self.tp_size
        if self.is_mla:
            return None
        if tp <= heads and heads % tp:
            return f"{heads} kv heads do not split evenly over tp {tp}"
        if tp > heads and tp % heads:
            return f"tp {tp} is not a multiple of its {heads} kv heads"
        return None

    @property
    def bytes_per_token_per_rank(self) -> int | None:
        size = dtype_bytes(self.kv_dtype)
        if size is None:
            return None
        k_and_v = 1 if self.is_mla else 2  # MLA caches one latent, not separate K and V
        return k_and_v * self.num_layers * self.heads_per_rank * self.head_dim * size


def from_announced(geometry: Geometry | None) -> KvGeometry | None:
    """The full model of an announced geometry, or None when a field it needs is unknown."""
    if geometry is None:
        return None
    g = geometry
    if (
        g.tp_size is None
        or g.block_size is None
        or g.num_layers is None
        or g.num_kv_heads is None
        or g.head_dim is None
        or g.kv_dtype is None
        or g.is_mla is None
    ):
        return None
    if g.kv_layout is None and not g.is_mla:
        return None
    return KvGeometry(
        tp_size=g.tp_size,
        block_size=g.block_size,
        num_layers=g.num_layers,
        num_kv_heads=g.num_kv_heads,
        head_dim=g.head_dim,
        kv_dtype=g.kv_dtype,
        is_mla=g.is_mla,
        kv_layout=None if g.kv_layout is None else KvLayout(g.kv_layout),
    )


class Mismatch(StrEnum):
    """Why a pair may not exchange KV. Fixed set: it labels a metric."""

    CONNECTOR = "connector"
    MODEL = "model"
    UNKNOWN_GEOMETRY = "unknown_geometry"
    INVALID_GEOMETRY = "invalid_geometry"
    LAYERS = "layers"
    HEADS = "heads"  # kv heads, head_dim, MLA or not
    DTYPE = "dtype"
    TP = "tp"
    BLOCK_SIZE = "block_size"
    LAYOUT = "layout"


@dataclass(frozen=True, slots=True)
class Incompatible:
    kind: Mismatch
    detail: str

    def __str__(self) -> str:
        return self.detail


@dataclass(frozen=True, slots=True)
class Unverified:
    """Allowed on trust: a geometry is unknown, so nothing could be checked or derived."""

    detail: str


@dataclass(frozen=True, slots=True)
class RankRead:
    """One read by a decode rank: these heads, from this prefill rank, at its KV port."""

    prefill_rank: int
    port: int
    heads: range  # global KV head indices (MLA: range(1), the latent)


@dataclass(frozen=True, slots=True)
class PairPlan:
    """A compatible pair with both geometries known."""

    connector: Connector | None
    prefill: KvGeometry
    decode: KvGeometry
    tp_ratio: int  # vLLM's sign convention: > 0 when decode TP >= prefill TP
    block_size_ratio: int  # decode block size // prefill block size
    reads: tuple[tuple[RankRead, ...], ...]  # reads[r]: what decode rank r reads

    @property
    def prefill_bytes_per_token_per_rank(self) -> int | None:
        return self.prefill.bytes_per_token_per_rank

    @property
    def decode_bytes_per_token_per_rank(self) -> int | None:
        return self.decode.bytes_per_token_per_rank

    @property
    def bytes_per_token(self) -> int | None:
        """KV bytes moved per token, all decode ranks together.

        Every decode rank fills its own share, so replicated heads and MLA latents cross once
        per decode rank that holds them.
        """
        per_rank = self.decode.bytes_per_token_per_rank
        return None if per_rank is None else per_rank * self.decode.tp_size

    def bytes_per_request(self, n_tokens: int, *, whole_blocks: bool = False) -> int | None:
        """KV bytes moved for a prompt of `n_tokens`.

        `whole_blocks` rounds up to whole prefill blocks, the unit the connectors move.
        """
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        per_token = self.bytes_per_token
        if per_token is None:
            return None
        if whole_blocks:
            block = self.prefill.block_size
            n_tokens = -(-n_tokens // block) * block
        return per_token * n_tokens


Verdict = PairPlan | Unverified | Incompatible


@dataclass(frozen=True, slots=True)
class Side:
    """What pairing needs to know of one instance."""

    model: str | None
    connector: Connector | None
    geometry: KvGeometry | None
    kv_port: int  # port of the zmq_address: TP rank 0's KV endpoint
    # The announced TP size, even when the rest of the geometry is unknown: it alone says
    # which KV ports (kv_port .. kv_port + tp - 1) the instance uses.
    tp_size: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.kv_port <= MAX_PORT:
            raise ValueError(f"kv_port {self.kv_port} outside 1..{MAX_PORT}")


def side_of(instance: Instance) -> Side:
    return Side(
        model=instance.model,
        connector=instance.connector,
        geometry=from_announced(instance.geometry),
        kv_port=instance.zmq_address.port,
        tp_size=None if instance.geometry is None else instance.geometry.tp_size,
    )


def plan_pair(prefill: Side, decode: Side, *, allow_unknown_geometry: bool = False) -> Verdict:
    """Whether `prefill` may hand KV to `decode`, and if both geometries are known, how."""
    if (
        prefill.connector is not None
        and decode.connector is not None
        and prefill.connector != decode.connector
    ):
        return Incompatible(
            Mismatch.CONNECTOR,
            f"connector {prefill.connector.value} vs {decode.connector.value}",
        )
    connector = prefill.connector if prefill.connector is not None else decode.connector
    if connector in NAMES_ITS_PEER and (prefill.connector is None or decode.connector is None):
        assert connector is not None
        return Incompatible(
            Mismatch.CONNECTOR,
            f"only one side announced connector {connector.value}: its decode leg names the "
            "prefill's connector, so both sides must run it",
        )
    if prefill.model is not None and decode.model is not None and prefill.model != decode.model:
        return Incompatible(Mismatch.MODEL, f"model {prefill.model!r} vs {decode.model!r}")

    p, d = prefill.geometry, decode.geometry
    if p is None or d is None:
        if p is None and prefill.tp_size is not None:
            ports = _check_port_range(prefill.kv_port, prefill.tp_size)
            if ports is not None:
                return ports
        if p is None and d is None:
            return Unverified("geometry unknown on both sides")
        unknown = "prefill" if p is None else "decode"
        if allow_unknown_geometry:
            return Unverified(f"{unknown} geometry unknown; allowed by allow_unknown_geometry")
        return Incompatible(
            Mismatch.UNKNOWN_GEOMETRY,
            f"{unknown} geometry unknown (v0), the other side's is known "
            "(set allow_unknown_geometry to pair them)",
        )

    mismatch = _check(p, d, connector) or _check_ports(prefill.kv_port, p)
    if mismatch is not None:
        return mismatch
    return PairPlan(
        connector=connector,
        prefill=p,
        decode=d,
        tp_ratio=tp_ratio(p.tp_size, d.tp_size),
        block_size_ratio=d.block_size // p.block_size,
        reads=tuple(_reads(p, d, rank, prefill.kv_port) for rank in range(d.tp_size)),
    )


def tp_ratio(prefill_tp: int, decode_tp: int) -> int:
    """vLLM's `tp_ratio` seen from decode; raises ValueError unless one size divides the other."""
    if decode_tp >= prefill_tp:
        if decode_tp % prefill_tp:
            raise ValueError(f"decode tp {decode_tp} not a multiple of prefill tp {prefill_tp}")
        return decode_tp // prefill_tp
    if prefill_tp % decode_tp:
        raise ValueError(f"prefill tp {prefill_tp} not a multiple of decode tp {decode_tp}")
    return -(prefill_tp // decode_tp)


def _check(p: KvGeometry, d: KvGeometry, connector: Connector | None) -> Incompatible | None:
    for side, geometry in (("prefill", p), ("decode", d)):
        problem = geometry.problem()
        if problem is not None:
            return Incompatible(Mismatch.INVALID_GEOMETRY, f"{side}: {problem}")
    if p.num_layers != d.num_layers:
        return Incompatible(Mismatch.LAYERS, f"layers {p.num_layers} vs {d.num_layers}")
    if p.is_mla != d.is_mla:
        which = "prefill" if p.is_mla else "decode"
        return Incompatible(Mismatch.HEADS, f"only the {which} side uses MLA")
    if p.num_kv_heads != d.num_kv_heads:
        return Incompatible(Mismatch.HEADS, f"kv heads {p.num_kv_heads} vs {d.num_kv_heads}")
    if p.head_dim != d.head_dim:
        return Incompatible(Mismatch.HEADS, f"head_dim {p.head_dim} vs {d.head_dim}")
    if p.dtype != d.dtype:
        return Incompatible(Mismatch.DTYPE, f"kv dtype {p.kv_dtype} vs {d.kv_dtype}")
    if connector is Connector.NIXL or connector is Connector.NIXL_PUSH:
        return _check_heterogeneous(p, d, connector.value)
    if connector is Connector.MOONCAKE:
        return _check_mooncake(p, d)
    if connector is Connector.PDPROXY:
        return _check_pdproxy(p, d)
    return _check_identical(p, d, "p2p_nccl")


def _check_pdproxy(p: KvGeometry, d: KvGeometry) -> Incompatible | None:
    try:
        tp_ratio(p.tp_size, d.tp_size)
    except ValueError:
        return Incompatible(
            Mismatch.TP,
            f"tp {p.tp_size} vs tp {d.tp_size} (pdproxy's connector needs one tp to divide "
            "the other)",
        )
    if d.block_size % p.block_size:
        return Incompatible(
            Mismatch.BLOCK_SIZE,
            f"decode block size {d.block_size} not a multiple of prefill's {p.block_size}",
        )
    return None


def _check_mooncake(p: KvGeometry, d: KvGeometry) -> Incompatible | None:
    try:
        tp_ratio(p.tp_size, d.tp_size)
    except ValueError:
        return Incompatible(
            Mismatch.TP,
            f"tp {p.tp_size} vs tp {d.tp_size} (mooncake needs one tp to divide the other)",
        )
    if p.block_size != d.block_size:
        # Block ids map one to one and a region's bytes per block must agree (per head).
        return Incompatible(
            Mismatch.BLOCK_SIZE,
            f"block size {p.block_size} vs {d.block_size} (mooncake needs equal block sizes)",
        )
    return None  # layouts: the connector itself sets LBHNC on both sides


def _check_identical(p: KvGeometry, d: KvGeometry, name: str) -> Incompatible | None:
    # P2pNcclConnector ships each rank's tensors to the same rank and refuses any other shape.
    if p.tp_size != d.tp_size:
        return Incompatible(
            Mismatch.TP, f"tp {p.tp_size} vs tp {d.tp_size} ({name} needs equal tp)"
        )
    if p.block_size != d.block_size:
        return Incompatible(
            Mismatch.BLOCK_SIZE,
            f"block size {p.block_size} vs {d.block_size} ({name} needs equal block sizes)",
        )
    if not p.is_mla and p.kv_layout != d.kv_layout:
        return Incompatible(
            Mismatch.LAYOUT, f"kv layout {p.kv_layout} vs {d.kv_layout} ({name} needs the same)"
        )
    return None


def _check_heterogeneous(p: KvGeometry, d: KvGeometry, name: str) -> Incompatible | None:
    try:
        ratio = tp_ratio(p.tp_size, d.tp_size)
    except ValueError:
        return Incompatible(
            Mismatch.TP,
            f"tp {p.tp_size} vs tp {d.tp_size} ({name} needs one tp to divide the other)",
        )
    if ratio < 0 and not p.is_mla and p.tp_size > p.num_kv_heads:
        # A decode rank would have to gather its heads from ranks holding copies: vLLM refuses.
        return Incompatible(
            Mismatch.TP,
            f"prefill tp {p.tp_size} > decode tp {d.tp_size} with prefill heads replicated "
            f"({p.num_kv_heads} kv heads; {name} cannot read them from several ranks)",
        )
    if d.block_size % p.block_size:
        return Incompatible(
            Mismatch.BLOCK_SIZE,
            f"decode block size {d.block_size} not a multiple of prefill's {p.block_size}",
        )
    if ratio < 0 and not p.is_mla and d.block_size != p.block_size:
        return Incompatible(
            Mismatch.BLOCK_SIZE,
            f"decode block size {d.block_size} must equal prefill's {p.block_size} "
            f"when prefill tp {p.tp_size} > decode tp {d.tp_size} ({name})",
        )
    if p.is_mla:
        return None  # one latent per token: no head axis to lay out or split
    if p.kv_layout != d.kv_layout:
        return Incompatible(
            Mismatch.LAYOUT, f"kv layout {p.kv_layout} vs {d.kv_layout} ({name} needs the same)"
        )
    if ratio != 1 and not p.replicated and p.kv_layout != KvLayout.HND:
        # Splitting a block by heads needs each head contiguous, which only HND gives.
        return Incompatible(
            Mismatch.LAYOUT,
            f"tp {p.tp_size} vs tp {d.tp_size} splits heads, which needs HND layout, "
            f"not {p.kv_layout} ({name})",
        )
    return None


def _check_ports(kv_port: int, p: KvGeometry) -> Incompatible | None:
    return _check_port_range(kv_port, p.tp_size)


def _check_port_range(kv_port: int, tp_size: int) -> Incompatible | None:
    last = kv_port + tp_size - 1
    if last > MAX_PORT:
        return Incompatible(
            Mismatch.INVALID_GEOMETRY,
            f"prefill KV ports {kv_port}..{last} (one per tp rank) pass {MAX_PORT}",
        )
    return None


def _reads(p: KvGeometry, d: KvGeometry, rank: int, kv_port: int) -> tuple[RankRead, ...]:
    if d.is_mla or d.tp_size >= p.tp_size:
        # One source: the prefill rank holding this rank's heads (MLA: any replica; vLLM picks
        # rank * p_tp // d_tp, which spreads decode ranks over the replicas). For tp_ratio > 0
        # this is rank // tp_ratio.
        first, count = rank * p.tp_size // d.tp_size, 1
    else:
        # Prefill TP is larger: this rank's heads are spread over |tp_ratio| prefill ranks.
        count = p.tp_size // d.tp_size
        first = rank * count
    wanted = d.rank_heads(rank)
    reads: list[RankRead] = []
    next_head = wanted.start
    for source in range(first, first + count):
        held = p.rank_heads(source)
        # Decode takes from each source only the heads it holds itself (a slice when decode
        # TP is larger, the whole share otherwise), and a replicated head only once.
        heads = range(max(next_head, held.start), min(wanted.stop, held.stop))
        if heads:
            reads.append(RankRead(source, kv_port + source, heads))
            next_head = heads.stop
    return tuple(reads)
