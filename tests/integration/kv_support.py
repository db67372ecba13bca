"""Random KV caches for the tests that move KV between real workers over loopback."""

from __future__ import annotations

import torch


def random_caches(names: list[str], shape: tuple[int, ...], seed: int) -> dict[str, torch.Tensor]:
    """One cache of `shape` per layer name, the same values for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name in names}
