"""Torch reference of SIFT profiling (SPEC section 2): one layer's q/k -> packed LA and CA bits.

This is the CPU backend of the builder and the reference twin of the Triton kernel in `profile.py`; both
take the same arguments. It never holds an L x L matrix: queries are processed in blocks of whole tiles,
each block against the full key row (so each row's softmax reduces over exactly the keys the model's eager
attention reduces over).

Thresholds are compared in float32 (alpha, beta, gamma are rounded to float32 first), as the GPU kernel does.

LA criteria (`criterion`): "threshold" (SPEC section 2: a tile is kept if some probability in it is >= alpha)
or "mass": each document row keeps the smallest set of key tiles of its own document that holds at least
`coverage` of the row's attention mass on the document (tiles taken in decreasing order of mass), and a tile
is kept if some row of its query tile keeps it. Under "mass" alpha is not read; the diagonal, the sink page,
CA (beta, gamma) and dense heads are unchanged. Only this reference implements "mass" (the builder refuses
the Triton backend for it).

`profile_packed_ref` runs `profile_layer_ref` on every document of a pack (`packing.PackedDocs`): each
document's bits and output rows are those of the document profiled alone, whatever it is packed with.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from sift.format import TILES, n_pages

from .bits import pack_msb, square_to_tril
from .packing import PackedDocs

CA_NORMALIZE = ("causal", "key_index")
CRITERIA = ("threshold", "mass")


@dataclass(frozen=True)
class LayerBits:
    """Packed bits of one layer. la: [Hq, ceil(P(P+1)/2/8)] uint8; ca: [Hq, ceil(P/8)] uint8."""

    la: torch.Tensor
    ca: torch.Tensor


def validate_profile_args(q, k, *, n_prefix, tile, alpha, beta, gamma, ca_normalize) -> None:
    """Shared input checks of the reference and the kernel launcher (errors name the bad value)."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [H, L, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if q.shape[1:] != k.shape[1:]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share length and head_dim")
    if q.shape[0] % k.shape[0]:
        raise ValueError(f"query heads ({q.shape[0]}) must be a multiple of key heads ({k.shape[0]})")
    if not 0 <= n_prefix < q.shape[1]:
        raise ValueError(f"n_prefix={n_prefix} must leave at least one document token (length {q.shape[1]})")
    if tile not in TILES:
        raise ValueError(f"tile={tile} must be one of {', '.join(map(str, TILES))}")
    for name, value in (("alpha", alpha), ("beta", beta), ("gamma", gamma)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}={value} must lie in [0, 1]")
    if ca_normalize not in CA_NORMALIZE:
        raise ValueError(f"ca_normalize={ca_normalize!r} must be one of {CA_NORMALIZE}")


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # Same expansion as the models' eager path, so each score is the same dot product.
    return x if groups == 1 else x.repeat_interleave(groups, dim=0)


def _scores(q_blk: torch.Tensor, k_rep: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    s = torch.matmul(q_blk, k_rep.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    return s


def finish_bits(
    tile_max: torch.Tensor,
    key_counts: torch.Tensor,
    n_tokens: int,
    *,
    tile: int,
    alpha: float,
    gamma: float,
    ca_normalize: str,
    force_sink_page: bool,
    dense_heads: Sequence[int] = (),
    kept: torch.Tensor | None = None,
) -> LayerBits:
    """Statistics -> packed bits.

    tile_max: [Hq, P, P] fp32, max A over each tile's causal cells (upper triangle ignored).
    key_counts: [Hq, L] int, number of document queries q >= k with A[q, k] >= beta.
    kept: [Hq, P, P] bool, the LA tiles another criterion chose ("mass"); None: tile_max >= alpha.
    """
    hq, p, _ = tile_max.shape
    dev = tile_max.device
    alpha32 = torch.tensor(alpha, dtype=torch.float32, device=dev)
    gamma32 = torch.tensor(gamma, dtype=torch.float32, device=dev)
    tiles = tile_max >= alpha32 if kept is None else kept.clone()
    eye = torch.eye(p, dtype=torch.bool, device=dev)
    tiles |= eye
    if force_sink_page:
        tiles[:, :, 0] = True
    keys = torch.arange(n_tokens, device=dev)
    denom = (n_tokens - keys) if ca_normalize == "causal" else (keys + 1)
    conc = key_counts.to(torch.float32) / denom.to(torch.float32)
    hot = conc >= gamma32
    hot = torch.nn.functional.pad(hot, (0, p * tile - n_tokens)).reshape(hq, p, tile).any(dim=-1)
    for h in dense_heads:
        tiles[h] = True
        hot[h] = True
    return LayerBits(la=pack_msb(square_to_tril(tiles)), ca=pack_msb(hot))


def mass_tiles(ad: torch.Tensor, *, tile: int, p: int, coverage: float) -> torch.Tensor:
    """The "mass" criterion on one block of document rows.

    ad: [Hq, rows, L] fp32 probabilities of rows that start a query tile, over the document's keys (L tokens).
    -> [Hq, ceil(rows / T), P] bool: per query tile, the key tiles some row of it needs to hold `coverage` of
    its mass on the document (the smallest such set per row, tiles in decreasing order of mass)."""
    hq, rows, n_doc = ad.shape
    row_mass = torch.nn.functional.pad(ad, (0, p * tile - n_doc)).reshape(hq, rows, p, tile).sum(dim=-1)
    ordered, order = torch.sort(row_mass, dim=-1, descending=True)
    before = torch.cumsum(ordered, dim=-1) - ordered  # mass of the heavier tiles before each one
    need = (before < coverage * row_mass.sum(dim=-1, keepdim=True)) & (ordered > 0)
    keep = torch.zeros_like(need).scatter_(-1, order, need)
    row_tiles = -(-rows // tile)
    keep = torch.nn.functional.pad(keep, (0, 0, 0, row_tiles * tile - rows))
    return keep.reshape(hq, row_tiles, tile, p).any(dim=2)


def profile_layer_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    n_prefix: int,
    tile: int,
    alpha: float,
    beta: float,
    gamma: float,
    softcap: float | None = None,
    ca_normalize: str = "causal",
    force_sink_page: bool = True,
    dense_heads: Sequence[int] = (),
    v: torch.Tensor | None = None,
    block_bytes: int = 64 << 20,
    criterion: str = "threshold",
    coverage: float = 0.95,
) -> tuple[LayerBits, torch.Tensor | None]:
    """One layer's SIFT bits for every query head.

    q: [Hq, Lp, D] rotated queries of (profiling prefix + document), Lp = n_prefix + L.
    k: [Hkv, Lp, D] rotated keys (GQA: Hq % Hkv == 0; query head h reads key head h // (Hq // Hkv)).
    v: [Hkv, Lp, D] optional; when given the layer's attention output [Hq, Lp, D] is returned too, computed
       from the same probabilities (the CPU builder uses it to continue the forward pass).
    block_bytes: scratch budget for one query block's probabilities (sets the block height).
    criterion, coverage: the LA criterion ("threshold" or "mass", module docstring) and the mass criterion's
       share of each row's mass, in (0, 1].
    Returns (LayerBits, output or None).
    """
    validate_profile_args(q, k, n_prefix=n_prefix, tile=tile, alpha=alpha, beta=beta, gamma=gamma,
                          ca_normalize=ca_normalize)
    if criterion not in CRITERIA:
        raise ValueError(f"criterion={criterion!r} must be one of {CRITERIA}")
    if not 0.0 < coverage <= 1.0:
        raise ValueError(f"coverage={coverage} must lie in (0, 1]")
    hq, lp, _ = q.shape
    groups = hq // k.shape[0]
    n_doc = lp - n_prefix
    p = n_pages(n_doc, tile)
    k_rep = _repeat_kv(k, groups)
    v_rep = _repeat_kv(v, groups) if v is not None else None
    out = torch.empty(hq, lp, v.shape[-1], dtype=v.dtype, device=v.device) if v is not None else None
    beta32 = torch.tensor(beta, dtype=torch.float32, device=q.device)

    tile_max = torch.zeros(hq, p, p, dtype=torch.float32, device=q.device)
    key_counts = torch.zeros(hq, n_doc, dtype=torch.int64, device=q.device)
    kept = torch.zeros(hq, p, p, dtype=torch.bool, device=q.device) if criterion == "mass" else None
    key_pos = torch.arange(lp, device=q.device)
    rows_per_block = max(tile, (block_bytes // (hq * lp * 4)) // tile * tile)

    # Block starts: the prefix rows (output only), then document rows in whole tiles.
    starts = list(range(0, n_prefix, rows_per_block)) + list(range(n_prefix, lp, rows_per_block))
    ends = starts[1:] + [lp]
    ends = [min(e, n_prefix) if s < n_prefix else e for s, e in zip(starts, ends)]
    for r0, r1 in zip(starts, ends):
        s = _scores(q[:, r0:r1], k_rep, scale, softcap)
        causal = key_pos[None, :] <= torch.arange(r0, r1, device=q.device)[:, None]
        s = s.masked_fill(~causal, float("-inf"))
        a = torch.softmax(s, dim=-1, dtype=torch.float32)
        if out is not None:
            out[:, r0:r1] = torch.matmul(a.to(v.dtype), v_rep)
        if r0 < n_prefix:
            continue
        ad = a[:, :, n_prefix:]  # [Hq, rows, L]: document keys
        key_counts += ((ad >= beta32) & causal[None, :, n_prefix:]).sum(dim=1)
        rows = r1 - r0
        row_tiles = -(-rows // tile)
        padded = torch.nn.functional.pad(ad, (0, p * tile - n_doc, 0, row_tiles * tile - rows))
        tmax = padded.reshape(hq, row_tiles, tile, p, tile).amax(dim=(2, 4))
        i0 = (r0 - n_prefix) // tile
        tile_max[:, i0:i0 + row_tiles] = tmax
        if kept is not None:
            kept[:, i0:i0 + row_tiles] = mass_tiles(ad, tile=tile, p=p, coverage=coverage)

    bits = finish_bits(tile_max, key_counts, n_doc, tile=tile, alpha=alpha, gamma=gamma,
                       ca_normalize=ca_normalize, force_sink_page=force_sink_page, dense_heads=dense_heads,
                       kept=kept)
    return bits, out


def validate_packed(q, k, docs: PackedDocs, la_out, ca_out, v=None) -> None:
    """Checks of a pack's inputs shared by `profile_packed_ref` and the kernel's `profile_packed`."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[1] != docs.total or k.shape[1] != docs.total:
        raise ValueError(f"q [Hq, T, D] and k [Hkv, T, D] must hold the pack's T={docs.total} rows; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}")
    if v is not None and (v.dim() != 3 or v.shape[:2] != k.shape[:2]):
        raise ValueError(f"v must be [Hkv, T, Dv] like k {tuple(k.shape)}; got {tuple(v.shape)}")
    for name, out, width in (("la_out", la_out, docs.la_total), ("ca_out", ca_out, docs.ca_total)):
        if out.dtype != torch.uint8 or tuple(out.shape) != (q.shape[0], width) or out.device != q.device \
                or out.stride(1) != 1:
            raise ValueError(f"{name} must be a uint8 [Hq, {width}] tensor on {q.device} with unit byte stride; "
                             f"got {out.dtype} {tuple(out.shape)} on {out.device}")


def profile_packed_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    docs: PackedDocs,
    *,
    la_out: torch.Tensor,
    ca_out: torch.Tensor,
    scale: float,
    alpha: float,
    beta: float,
    gamma: float,
    softcap: float | None = None,
    ca_normalize: str = "causal",
    force_sink_page: bool = True,
    dense_heads: Sequence[int] = (),
    v: torch.Tensor | None = None,
    block_bytes: int = 64 << 20,
    criterion: str = "threshold",
    coverage: float = 0.95,
) -> torch.Tensor | None:
    """One layer of a pack: every document's bits, written into la_out / ca_out at its offsets.

    q: [Hq, T, D], k / v: [Hkv, T, D(v)], the pack's rows (`docs.total`); la_out: [Hq, docs.la_total] and ca_out:
    [Hq, docs.ca_total] uint8. Returns the layer's output [Hq, T, Dv] when v is given (each sequence attending to
    itself only), else None. Other arguments as `profile_layer_ref`.
    """
    validate_packed(q, k, docs, la_out, ca_out, v)
    out = torch.empty(q.shape[0], docs.total, v.shape[-1], dtype=v.dtype, device=v.device) if v is not None else None
    for s in range(len(docs)):
        rows = docs.seq_rows(s)
        bits, o = profile_layer_ref(q[:, rows], k[:, rows], v=v[:, rows] if v is not None else None, scale=scale,
                                    n_prefix=docs.n_prefix, tile=docs.tile, alpha=alpha, beta=beta, gamma=gamma,
                                    softcap=softcap, ca_normalize=ca_normalize, force_sink_page=force_sink_page,
                                    dense_heads=dense_heads, block_bytes=block_bytes, criterion=criterion,
                                    coverage=coverage)
        la_out[:, docs.la_bytes(s)] = bits.la
        ca_out[:, docs.ca_bytes(s)] = bits.ca
        if out is not None:
            out[:, rows] = o
    return out
