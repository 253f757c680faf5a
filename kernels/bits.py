"""Bit-vector layout of SPEC section 2, shared by the profiler, the index and the runtime decoder.

LA: tile (i, j), 0 <= j <= i < P, is bit n = i(i+1)/2 + j, stored MSB-first: byte n // 8, bit 7 - n % 8.
CA: page j is bit j, same packing. Unused trailing bits are 0.
"""
from __future__ import annotations

import torch


def pack_msb(bits: torch.Tensor) -> torch.Tensor:
    """bits: [..., n] bool -> [..., ceil(n / 8)] uint8, MSB-first, trailing bits 0."""
    n = bits.shape[-1]
    pad = (-n) % 8
    if pad:
        bits = torch.nn.functional.pad(bits.to(torch.uint8), (0, pad))
    b = bits.to(torch.uint8).reshape(*bits.shape[:-1], -1, 8)
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=bits.device)
    return (b * weights).sum(dim=-1, dtype=torch.int32).to(torch.uint8)


def unpack_msb(packed: torch.Tensor, n: int) -> torch.Tensor:
    """packed: [..., nbytes] uint8 -> [..., n] bool (inverse of `pack_msb`)."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*packed.shape[:-1], -1)[..., :n].bool()


def tril_to_square(la: torch.Tensor, p: int) -> torch.Tensor:
    """la: [..., P(P+1)/2] bool in row-major lower-triangle order -> [..., P, P] bool (upper triangle False)."""
    rows, cols = torch.tril_indices(p, p, device=la.device)
    out = torch.zeros(*la.shape[:-1], p, p, dtype=torch.bool, device=la.device)
    out[..., rows, cols] = la
    return out


def square_to_tril(tiles: torch.Tensor) -> torch.Tensor:
    """tiles: [..., P, P] -> [..., P(P+1)/2] in row-major lower-triangle order (i, then j <= i)."""
    p = tiles.shape[-1]
    rows, cols = torch.tril_indices(p, p, device=tiles.device)
    return tiles[..., rows, cols]
