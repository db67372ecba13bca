"""One request's KV, moved between paged vLLM caches of different shapes. Torch only, no I/O.

The wire form
-------------
What crosses the network is one tensor per layer and per read (a decode rank reading some heads
from one prefill rank), contiguous, shaped ``(kv, tokens, heads, head_dim)``:

- ``kv`` is 2, K then V, for ordinary attention; 1 for MLA (the latent, no separate V);
- ``tokens`` are the request's tokens 0 .. num_tokens - 1 in order, never padded to a block;
- ``heads`` are the heads of that read, in head order (``HeadRead.prefill_heads``);
- the dtype is the cache's (``wire_to_bytes`` / ``wire_from_bytes`` carry it as raw bytes,
  without copying it on either side).

Token-major and unpadded, the wire says nothing of either side's block size, layout or cache
format: the sender gathers from its blocks (``gather_kv``), the receiver scatters into its own
(``scatter_kv``), so block sizes, NHD/HND and vLLM versions may all differ between the sides.
vLLM's NIXL connector moves raw blocks instead and must re-lay them in place afterwards
(``kv_postprocess_blksize_on_receive``); a token-major wire never needs that step.

Cache formats
-------------
A layer's cache tensor is read through its logical axes, never its strides, so a tensor whose
memory is head-major but whose shape is token-major (older vLLM GPU backends permute an HND
allocation into NHD shape) is simply ``NHD`` here, and writes reach its memory all the same.

- ``NHD`` ``(2, blocks, block_size, heads, head_dim)``: older vLLM's 5-D per-layer caches;
- ``HND`` ``(2, blocks, heads, block_size, head_dim)``: likewise;
- ``MLA`` ``(blocks, block_size, latent)``, or vLLM 0.32's ``(blocks, 1, block_size, latent)``;
- ``BHNC`` ``(blocks, heads, block_size, 2 * head_dim)``: vLLM 0.32's per-layer view
  (``kv_cache_interface.create_kv_cache_views``, "[B, H, N, C]", RFC #42082) as its GPU
  backends read it: a token's K and V side by side on the last axis (flash_attn and triton
  split it at head_dim). NHD or HND is then only a stride order, invisible here;
- ``BHNC_CPU``: the same tensor as vLLM 0.32's CPU backend fills it. Its kernels treat each
  (block, head) page as K transposed, ``(head_dim, block_size)``, then V, ``(block_size,
  head_dim)``, so the last axis does not hold one token's K and V. Measured by calling the
  backend's own cache-write kernel (ISAs ``vec`` and ``vec16``, x86, every dtype). The page
  must be contiguous, as the backend's only layout (LBHNC) makes it;
- ``BHNC_CPU_AMX``: the same tensor as the CPU backend's ``amx`` ISA fills it (bfloat16 with a
  block size that is a multiple of 32 on x86 with AMX tiles): K in tiles of 16 tokens, each
  ``(head_dim / 2, 16, 2)``, then V in tiles of 16 head_dim values, each ``(block_size / 2,
  16, 2)``; measured the same way. The ARM, RISC-V, s390x and POWER ISAs were not available to
  check, so the connector refuses to move KV there (pdproxy.vllm_side.cpu_format).

Tensor parallelism
------------------
``plan_reads`` says which heads each decode rank reads from which prefill rank, from the
ownership rule of ``pdproxy.pairing.geometry`` (``KvGeometry.rank_heads``) and its choice of
source ranks: decode TP larger, a slice of one prefill rank's heads; prefill TP larger, the
heads of several prefill ranks side by side in rank order; MLA, the latent from one replica.
Where heads replicate, each head is read once, from the first source holding it.

A request's KV usually starts at token 0. A decode side that already holds a prefix of whole
blocks (prefix caching) passes both sides' block ids past it, and the token count past it; that
is block-aligned on both sides because decode's block size is a multiple of prefill's.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

from pdproxy.pairing.geometry import KvGeometry, dtype_bytes, tp_ratio

PLANES_K_AND_V = 2  # ordinary attention caches K and V; MLA one latent


class CacheFormat(StrEnum):
    """How one layer's cache tensor holds its KV (see the module docstring)."""

    NHD = "NHD"
    HND = "HND"
    MLA = "MLA"
    BHNC = "BHNC"
    BHNC_CPU = "BHNC_CPU"
    BHNC_CPU_AMX = "BHNC_CPU_AMX"


# vLLM 0.32's CPU AMX kernels (bfloat16, block_size a multiple of 32, x86 with AMX) tile a
# page for the tile multiply: K in tiles of 16 tokens, V in tiles of 16 head_dim values, each
# holding pairs of bfloat16 values side by side (measured with the backend's own cache-write
# kernel, see the module docstring).
AMX_TOKENS = 16
AMX_DIMS = 16
AMX_PAIR = 2


@dataclass(frozen=True, slots=True)
class HeadRead:
    """Heads one decode rank reads from one prefill rank, as indices into each rank's own cache.

    ``prefill_heads`` and ``decode_heads`` have the same length; the wire carries them in order.
    """

    decode_rank: int
    prefill_rank: int
    prefill_heads: range
    decode_heads: range


def plan_reads(prefill: KvGeometry, decode: KvGeometry) -> tuple[HeadRead, ...]:
    """Every read of a transfer, by decode rank, then prefill rank.

    A decode rank filters on ``decode_rank`` for what to receive, a prefill rank on
    ``prefill_rank`` for what to send. Raises ValueError when the two cannot exchange KV at all.
    """
    _check_same_model_shape(prefill, decode)
    tp_ratio(prefill.tp_size, decode.tp_size)  # raises unless one TP size divides the other
    return tuple(
        read for rank in range(decode.tp_size) for read in _reads_of(prefill, decode, rank)
    )


def wire_shape(geometry: KvGeometry, read: HeadRead, num_tokens: int) -> tuple[int, int, int, int]:
    """The shape of one layer's wire tensor for `read`."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    planes = 1 if geometry.is_mla else PLANES_K_AND_V
    return (planes, num_tokens, len(read.decode_heads), geometry.head_dim)


def wire_bytes(geometry: KvGeometry, read: HeadRead, num_tokens: int) -> int:
    """Bytes one layer's wire tensor for `read` carries.

    A decode rank's reads together carry, per layer, `num_tokens` x the geometry's
    `bytes_per_token_per_rank` / `num_layers`.
    """
    size = dtype_bytes(geometry.kv_dtype)
    if size is None:
        raise ValueError(f"unknown KV dtype {geometry.kv_dtype!r}")
    return size * math.prod(wire_shape(geometry, read, num_tokens))


def gather_kv(
    cache: torch.Tensor,
    cache_format: CacheFormat,
    block_ids: Sequence[int],
    num_tokens: int,
    heads: range | None = None,
) -> torch.Tensor:
    """The wire tensor of a request's first `num_tokens` tokens, held in `block_ids` in order.

    `heads` (default all) are indices into this cache's head axis. Only as many block ids as
    the tokens fill are read; the cache is not written.
    """
    planes = [_head_window(plane, heads) for plane in _planes(cache, cache_format)]
    blocks, offsets = _token_slots(planes[0], block_ids, num_tokens)
    # Indexing each token's slot gives (tokens, heads, head_dim split in two) per plane.
    return torch.stack(
        [
            _at(plane, blocks, offsets).reshape(
                num_tokens, plane.shape[3], plane.shape[4] * plane.shape[5]
            )
            for plane in planes
        ]
    )


def scatter_kv(
    wire: torch.Tensor,
    cache: torch.Tensor,
    cache_format: CacheFormat,
    block_ids: Sequence[int],
    heads: range | None = None,
) -> None:
    """Write a wire tensor's tokens into `block_ids` of `cache`, at head indices `heads`.

    Touches only the wire's tokens and heads: the rest of a partial last block, other heads and
    other blocks keep what they held.
    """
    planes = [_head_window(plane, heads) for plane in _planes(cache, cache_format)]
    _check_wire_fits(wire, planes)
    blocks, offsets = _token_slots(planes[0], block_ids, wire.shape[1])
    wire = wire.to(planes[0].device)  # received on the host; the cache may live elsewhere
    for plane, values in zip(planes, wire, strict=True):
        inner = plane.shape[2]
        split = values.reshape(values.shape[0], plane.shape[3], plane.shape[4], plane.shape[5])
        plane[blocks, offsets // inner, offsets % inner] = split


def _at(plane: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    inner = plane.shape[2]
    return plane[blocks, offsets // inner, offsets % inner]


def wire_to_bytes(wire: torch.Tensor) -> memoryview:
    """The wire tensor's raw bytes (no numpy needed: bfloat16 and fp8 work too).

    Not copied when `wire` is a contiguous CPU tensor that is all of its own memory, as
    `gather_kv`'s result is: the view then shows that memory and keeps the tensor alive, so the
    tensor must not be written while the bytes are in use. Anything else (a view into a larger
    tensor, a cache for one; a tensor on another device) is copied to the host once.
    """
    host = wire.detach()
    if host.device.type != "cpu" or not _whole_and_contiguous(host):
        host = torch.empty(tuple(host.shape), dtype=host.dtype).copy_(host)
    size = host.numel() * host.element_size()
    if size == 0:
        return memoryview(b"")
    raw = (ctypes.c_ubyte * size).from_address(host.data_ptr())
    vars(raw)["tensor"] = host  # the memory lives as long as the view
    return memoryview(raw).cast("B")


def wire_from_bytes(
    data: bytes | bytearray | memoryview, shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """A wire tensor of `shape` and `dtype` from its raw bytes.

    A writable buffer (the transport's own receive buffer) is used in place: the tensor shares
    its memory and keeps it alive. A read-only one (bytes) is copied, as torch wraps only
    writable memory; so is one not aligned for `dtype`.
    """
    view = memoryview(data)
    item_size = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * item_size
    if view.nbytes != expected:
        raise ValueError(f"{view.nbytes} bytes for a wire of shape {tuple(shape)} {dtype}")
    if expected == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    if view.readonly or not view.c_contiguous:
        raw = torch.frombuffer(bytearray(view), dtype=torch.uint8)
    else:
        raw = torch.frombuffer(view.cast("B"), dtype=torch.uint8)
        if raw.data_ptr() % item_size:
            raw = raw.clone()
    return raw.view(dtype).view(tuple(shape))


def _whole_and_contiguous(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is contiguous and is the whole of its storage (not a view into more)."""
    size = tensor.numel() * tensor.element_size()
    return bool(
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == size
    )


def _check_same_model_shape(prefill: KvGeometry, decode: KvGeometry) -> None:
    for side, geometry in (("prefill", prefill), ("decode", decode)):
        problem = geometry.problem()
        if problem is not None:
            raise ValueError(f"{side}: {problem}")
    if prefill.is_mla != decode.is_mla:
        raise ValueError("only one side uses MLA")
    if prefill.dtype != decode.dtype:
        raise ValueError(f"kv dtype {prefill.kv_dtype} vs {decode.kv_dtype}")
    if (prefill.num_kv_heads, prefill.head_dim) != (decode.num_kv_heads, decode.head_dim):
        raise ValueError(
            f"kv heads x head_dim {prefill.num_kv_heads}x{prefill.head_dim} vs "
            f"{decode.num_kv_heads}x{decode.head_dim}"
        )


def _source_ranks(prefill: KvGeometry, decode: KvGeometry, decode_rank: int) -> range:
    # The same sources as pairing.geometry's rank map, so a decode rank reads on the ports the
    # pair plan names: one prefill rank when decode TP is larger (MLA: one replica), else the
    # |tp_ratio| consecutive prefill ranks its heads came from.
    if decode.is_mla or decode.tp_size >= prefill.tp_size:
        first = decode_rank * prefill.tp_size // decode.tp_size
        return range(first, first + 1)
    count = prefill.tp_size // decode.tp_size
    return range(decode_rank * count, (decode_rank + 1) * count)


def _reads_of(prefill: KvGeometry, decode: KvGeometry, decode_rank: int) -> list[HeadRead]:
    wanted = decode.rank_heads(decode_rank)
    reads: list[HeadRead] = []
    next_head = wanted.start  # heads are read in order, each once, from the first holder
    for source in _source_ranks(prefill, decode, decode_rank):
        held = prefill.rank_heads(source)
        start, stop = max(next_head, held.start), min(wanted.stop, held.stop)
        if start >= stop:
            continue  # a replica of heads already read
        reads.append(
            HeadRead(
                decode_rank=decode_rank,
                prefill_rank=source,
                prefill_heads=range(start - held.start, stop - held.start),
                decode_heads=range(start - wanted.start, stop - wanted.start),
            )
        )
        next_head = stop
    if next_head != wanted.stop:
        raise ValueError(f"decode rank {decode_rank}: no prefill rank holds heads from {next_head}")
    return reads


def _planes(cache: torch.Tensor, cache_format: CacheFormat) -> tuple[torch.Tensor, ...]:
    """Views of `cache`, one per stored plane (K and V, or the MLA latent), each shaped
    (blocks, token tiles, tokens per tile, heads, head_dim tiles, head_dim per tile): a token's
    offset in its block is tile * per_tile + index, and so is a head_dim index. Only the AMX
    format tiles; the others have tiles of one token and one tile of head_dim. Views, never
    copies: writes reach `cache`."""
    shape = tuple(cache.shape)
    if cache_format is CacheFormat.NHD or cache_format is CacheFormat.HND:
        if len(shape) != 5 or shape[0] != PLANES_K_AND_V:
            raise ValueError(f"{cache_format} cache must be (2, B, ., ., D), got {shape}")
        if cache_format is CacheFormat.NHD:
            return _untiled(cache[0]), _untiled(cache[1])
        return _untiled(cache[0].transpose(1, 2)), _untiled(cache[1].transpose(1, 2))
    if cache_format is CacheFormat.MLA:
        return (_untiled(_mla_plane(cache)),)
    if len(shape) != 4 or shape[3] % 2:
        raise ValueError(f"{cache_format} cache must be (B, H, N, 2 * D), got {shape}")
    head_dim = shape[3] // 2
    if cache_format is CacheFormat.BHNC:
        keys, values = cache[..., :head_dim], cache[..., head_dim:]
        return _untiled(keys.transpose(1, 2)), _untiled(values.transpose(1, 2))
    if cache_format is CacheFormat.BHNC_CPU_AMX:
        return _amx_planes(cache, head_dim)
    return _cpu_planes(cache, head_dim)


def _untiled(plane: torch.Tensor) -> torch.Tensor:
    """(blocks, block_size, heads, head_dim) as the six axes of `_planes`."""
    return plane.unsqueeze(2).unsqueeze(4)


def _mla_plane(cache: torch.Tensor) -> torch.Tensor:
    shape = tuple(cache.shape)
    if len(shape) == 3:
        return cache[:, :, None, :]
    if len(shape) == 4 and shape[1] == 1:
        return cache.transpose(1, 2)
    raise ValueError(f"MLA cache must be (B, N, D) or (B, 1, N, D), got {shape}")


def _pages(cache: torch.Tensor, cache_format: CacheFormat) -> torch.Tensor:
    """Each (block, head) page of a CPU cache as one run of memory."""
    blocks, heads, block_size, content = cache.shape
    if cache.stride(3) != 1 or cache.stride(2) != content:
        # A strided page cannot be reinterpreted without a copy, and a copy would swallow the
        # writes.
        raise ValueError(f"{cache_format} cache needs contiguous (block, head) pages")
    return cache.view(blocks, heads, block_size * content)


def _cpu_planes(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks, heads, block_size, _ = cache.shape
    pages = _pages(cache, CacheFormat.BHNC_CPU)
    half = block_size * head_dim
    keys = pages[:, :, :half].view(blocks, heads, head_dim, block_size).permute(0, 3, 1, 2)
    values = pages[:, :, half:].view(blocks, heads, block_size, head_dim).transpose(1, 2)
    return _untiled(keys), _untiled(values)


def _amx_planes(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    # K page: tiles of AMX_TOKENS tokens, each (head_dim / 2, AMX_TOKENS, 2): pairs of head_dim
    # values side by side. V page: tiles of AMX_DIMS head_dim values, each (block_size / 2,
    # AMX_DIMS, 2): pairs of tokens side by side.
    blocks, heads, block_size, _ = cache.shape
    if block_size % AMX_TOKENS or head_dim % AMX_DIMS:
        raise ValueError(
            f"{CacheFormat.BHNC_CPU_AMX} needs block_size a multiple of {AMX_TOKENS} and "
            f"head_dim of {AMX_DIMS}, got {block_size} and {head_dim}"
        )
    pages = _pages(cache, CacheFormat.BHNC_CPU_AMX)
    half = block_size * head_dim
    pair = AMX_PAIR
    keys = pages[:, :, :half].view(
        blocks, heads, block_size // AMX_TOKENS, head_dim // pair, AMX_TOKENS, pair
    )
    values = pages[:, :, half:].view(
        blocks, heads, head_dim // AMX_DIMS, block_size // pair, AMX_DIMS, pair
    )
    return keys.permute(0, 2, 4, 1, 3, 5), values.permute(0, 3, 5, 1, 2, 4)


def _head_window(plane: torch.Tensor, heads: range | None) -> torch.Tensor:
    if heads is None:
        return plane
    count = plane.shape[3]
    if heads.step != 1 or not 0 <= heads.start < heads.stop <= count:
        raise ValueError(f"heads {heads} not a non-empty run within this cache's {count} heads")
    return plane[:, :, :, heads.start : heads.stop]


def _token_slots(
    plane: torch.Tensor, block_ids: Sequence[int], num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each token, the block holding it and its offset in that block."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    num_blocks, block_size = plane.shape[0], plane.shape[1] * plane.shape[2]
    needed = -(-num_tokens // block_size)
    if len(block_ids) < needed:
        raise ValueError(
            f"{num_tokens} tokens need {needed} blocks of {block_size}, got {len(block_ids)}"
        )
    used = [int(block) for block in block_ids[:needed]]
    if any(not 0 <= block < num_blocks for block in used):
        # Negative ids would silently index from the end.
        raise ValueError(f"block ids {used} outside 0..{num_blocks - 1}")
    if len(set(used)) != needed:
        raise ValueError(f"block ids {used} repeat a block")
    tokens = torch.arange(num_tokens, device=plane.device)
    ids = torch.tensor(used, dtype=torch.long, device=plane.device)
    return ids[tokens // block_size], tokens % block_size


def _check_wire_fits(wire: torch.Tensor, planes: Sequence[torch.Tensor]) -> None:
    kv, heads = len(planes), planes[0].shape[3]
    head_dim = planes[0].shape[4] * planes[0].shape[5]
    if wire.dim() != 4 or (wire.shape[0], wire.shape[2], wire.shape[3]) != (kv, heads, head_dim):
        raise ValueError(
            f"wire {tuple(wire.shape)} does not fit ({kv}, tokens, {heads}, {head_dim})"
        )
    if wire.dtype != planes[0].dtype:
        # Never convert silently: a dtype mismatch means the two sides disagree on geometry.
        raise ValueError(f"wire dtype {wire.dtype} vs cache dtype {planes[0].dtype}")
