"""Torch reference of SIFT profiling (SPEC section 2): one layer's q/k -> packed LA and CA bits.

This is the CPU backend of the builder and the reference twin of the Triton kernels in `profile.py`; both
take the same arguments. It never holds an L x L matrix: queries are processed in blocks of whole tiles, each
block against the keys up to its last row (every key any of its rows attends to; the rest of the row is masked
anyway, so each row's softmax covers exactly its causal keys, as the model's eager attention does).

Thresholds are compared in float32 (alpha, beta, gamma are rounded to float32 first), as the GPU kernel does.

LA criteria (`criterion`): "threshold" (SPEC section 2: a tile is kept if some probability in it is >= alpha)
or "mass": each document row keeps the smallest set of key tiles of its own document that holds at least
`coverage` of the row's attention mass on the document (tiles taken in decreasing order of mass), and a tile
is kept if some row of its query tile keeps it. Under "mass" alpha is not read; the diagonal, the sink page,
CA (beta, gamma) and dense heads are unchanged. Only this reference implements "mass" (the builder refuses
the Triton backend for it).

The reader criterion (`criterion="reader"`, packs whose sequences end with the reader text, `PackedDocs.n_reader`)
decides LA and CA together: each document's tile masses (its rows' fp32 probabilities summed per tile, in
float64) and page masses (the reader rows' probabilities summed per page) go to `reader_select.select_packed`,
the choice the Triton launcher makes on its kernel's masses; alpha, beta, gamma and ca_normalize are not read.

`profile_packed_ref` computes every document of a pack (`packing.PackedDocs`) as `profile_layer_ref` computes it
alone, its statistics and output rows from its own rows only, and the bits of the whole pack in one
`finish_packed`: each document's bits are those of profiling it alone, whatever it is packed with.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from sift.format import TILES, n_pages

from .bits import pack_msb, square_to_tril
from .device import upload
from .packing import PackedDocs
from .reader_select import select_packed

CA_NORMALIZE = ("causal", "key_index")
BLOCK_ROWS = 256  # document rows per block of `profile_layer_ref` (at most; fewer where block_bytes says so)
CRITERIA = ("threshold", "mass", "reader")  # "reader" decides CA too, on packs only (`profile_packed_ref`)


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


def _block_probs(q_grouped, k, v, out, r0: int, r1: int, *, scale, softcap):
    """Rows [r0, r1) of one sequence against its keys [0, r1): the fp32 probabilities a [Hq, rows, r1] (0 on
    non-causal cells) and the non-causal mask above [rows, r1]; with v, the rows' attention output goes to out.
    q_grouped: [Hkv, groups, Lp, D], k / v: [Hkv, Lp, D(v)] (query head h reads key head h // groups)."""
    hkv, groups, _, d = q_grouped.shape
    hq, rows = hkv * groups, r1 - r0
    qb = q_grouped[:, :, r0:r1].reshape(hkv, groups * rows, d)
    s = torch.matmul(qb, k[:, :r1].transpose(-1, -2)).view(hq, rows, r1).mul_(scale)
    if softcap is not None:
        s.div_(softcap).tanh_().mul_(softcap)
    above = torch.ones(rows, r1, dtype=torch.bool, device=k.device).triu_(r0 + 1)  # key > row: not causal
    a = torch.softmax(s.masked_fill_(above, float("-inf")), dim=-1, dtype=torch.float32)
    if out is not None:
        pv = torch.matmul(a.to(v.dtype).view(hkv, groups * rows, r1), v[:, :r1])
        out[:, r0:r1] = pv.view(hq, rows, -1)
    return a, above


def _rows_per_block(hq: int, lp: int, tile: int, block_bytes: int) -> int:
    return max(tile, min(BLOCK_ROWS, block_bytes // (hq * lp * 4)) // tile * tile)


def _reader_masses(q, k, v, tile_mass, page_mass, out, *, scale, n_prefix, n_reader, tile, softcap,
                   block_bytes) -> None:
    """One sequence [prefix, document, reader]'s masses for the reader criterion (and its attention output
    where `out` is given), written in place.

    q: [Hq, Lp, D], k / v: [Hkv, Lp, D(v)], Lp = n_prefix + L + n_reader; tile_mass: [Hq, P, P] float64 zeros
    (the document rows' attention on each document tile, lower triangle); page_mass: [Hq, P] float64 zeros (the
    reader rows' attention on each page); out: [Hq, Lp, Dv] or None. Probabilities are fp32 (the model's
    softmax), their sums float64."""
    hq, lp, d = q.shape
    hkv = k.shape[0]
    n_doc = lp - n_prefix - n_reader
    p = n_pages(n_doc, tile)
    q_grouped = q.reshape(hkv, hq // hkv, lp, d)
    step = _rows_per_block(hq, lp, tile, block_bytes)
    # Blocks of whole tiles of document rows (the first one also carries the prefix rows), then of reader rows.
    starts = [(0 if m0 == 0 else n_prefix + m0, n_prefix + min(m0 + step, n_doc)) for m0 in range(0, n_doc, step)]
    starts += [(r0, min(r0 + step, lp)) for r0 in range(n_prefix + n_doc, lp, step)]
    for r0, r1 in starts:
        a, _ = _block_probs(q_grouped, k, v, out, r0, r1, scale=scale, softcap=softcap)
        if r1 <= n_prefix + n_doc:
            m0, m1 = max(r0 - n_prefix, 0), r1 - n_prefix
            ad = a[:, a.shape[1] - (m1 - m0):, n_prefix:]  # [Hq, the block's document rows, document keys < m1]
            row_tiles, col_tiles = -(-(m1 - m0) // tile), -(-m1 // tile)
            padded = torch.nn.functional.pad(ad, (0, col_tiles * tile - m1, 0, row_tiles * tile - (m1 - m0)))
            sums = padded.reshape(hq, row_tiles, tile, col_tiles, tile).sum(dim=(2, 4), dtype=torch.float64)
            tile_mass[:, m0 // tile:m0 // tile + row_tiles, :col_tiles] = sums
        else:
            keys = a[:, :, n_prefix:n_prefix + n_doc].sum(dim=1, dtype=torch.float64)  # [Hq, L]
            page_mass += torch.nn.functional.pad(keys, (0, p * tile - n_doc)).view(hq, p, tile).sum(dim=-1)


def _doc_stats(q, k, v, tile_max, key_counts, kept, out, *, scale, n_prefix, tile, beta, softcap, block_bytes,
               coverage) -> None:
    """One document's statistics (and its attention output where `out` is given), written in place.

    q: [Hq, Lp, D], k / v: [Hkv, Lp, D(v)] of prefix + document; tile_max: [Hq, P, P] fp32 zeros; key_counts:
    [Hq, L] int zeros; kept: [Hq, P, P] bool zeros for the "mass" criterion, else None; out: [Hq, Lp, Dv] or None.
    """
    hq, lp, d = q.shape
    hkv = k.shape[0]
    groups = hq // hkv
    n_doc = lp - n_prefix
    p = n_pages(n_doc, tile)
    # Query head h reads key head h // groups: q as [Hkv, groups * rows, D] against K / V as they are (no copy).
    q_grouped = q.reshape(hkv, groups, lp, d)
    beta32 = torch.tensor(beta, dtype=torch.float32, device=q.device)
    # Blocks of whole tiles of document rows (the first one also carries the prefix rows), each against the keys
    # up to its last row only: the causal half of the work, in scratch of at most block_bytes.
    rows_per_block = _rows_per_block(hq, lp, tile, block_bytes)
    for m0 in range(0, n_doc, rows_per_block):
        m1 = min(m0 + rows_per_block, n_doc)
        r0, r1 = (0 if m0 == 0 else n_prefix + m0), n_prefix + m1  # rows of the block; keys [0, r1)
        rows, doc_rows = r1 - r0, m1 - m0
        a, above = _block_probs(q_grouped, k, v, out, r0, r1, scale=scale, softcap=softcap)
        ad = a[:, rows - doc_rows:, n_prefix:]  # [Hq, block's document rows, document keys < m1]
        hits = ad >= beta32  # a masked cell is 0: below any beta > 0
        if beta32 <= 0:
            hits &= ~above[None, rows - doc_rows:, n_prefix:]
        key_counts[:, :m1] += hits.sum(dim=1)
        row_tiles = -(-doc_rows // tile)
        col_tiles = -(-m1 // tile)
        padded = torch.nn.functional.pad(ad, (0, col_tiles * tile - m1, 0, row_tiles * tile - doc_rows))
        i0 = m0 // tile
        tile_max[:, i0:i0 + row_tiles, :col_tiles] = padded.reshape(hq, row_tiles, tile, col_tiles, tile).amax(
            dim=(2, 4))
        if kept is not None:
            whole = torch.nn.functional.pad(ad, (0, n_doc - m1))
            kept[:, i0:i0 + row_tiles] = mass_tiles(whole, tile=tile, p=p, coverage=coverage)


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
    validate_criterion(criterion, coverage, PackedDocs(n_prefix, (q.shape[1] - n_prefix,), tile))
    hq, lp, _ = q.shape
    n_doc = lp - n_prefix
    p = n_pages(n_doc, tile)
    out = torch.empty(hq, lp, v.shape[-1], dtype=v.dtype, device=v.device) if v is not None else None
    tile_max = torch.zeros(hq, p, p, dtype=torch.float32, device=q.device)
    key_counts = torch.zeros(hq, n_doc, dtype=torch.int64, device=q.device)
    kept = torch.zeros(hq, p, p, dtype=torch.bool, device=q.device) if criterion == "mass" else None
    _doc_stats(q, k, v, tile_max, key_counts, kept, out, scale=scale, n_prefix=n_prefix, tile=tile, beta=beta,
               softcap=softcap, block_bytes=block_bytes, coverage=coverage)
    bits = finish_bits(tile_max, key_counts, n_doc, tile=tile, alpha=alpha, gamma=gamma,
                       ca_normalize=ca_normalize, force_sink_page=force_sink_page, dense_heads=dense_heads,
                       kept=kept)
    return bits, out


def validate_criterion(criterion: str, coverage: float, docs: PackedDocs) -> None:
    """The criterion of a pack: "reader" needs the reader after every document (docs.n_reader > 0), the others
    none."""
    if criterion not in CRITERIA:
        raise ValueError(f"criterion={criterion!r} must be one of {CRITERIA}")
    if not 0.0 < coverage <= 1.0:
        raise ValueError(f"coverage={coverage} must lie in (0, 1]")
    if (criterion == "reader") != (docs.n_reader > 0):
        raise ValueError(f"criterion={criterion!r} with a pack of n_reader={docs.n_reader}: the reader criterion "
                         f"profiles [prefix, document, reader] (n_reader > 0), the others [prefix, document]")


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


@dataclass(frozen=True)
class _FinishTables:
    """Where `finish_packed` reads each output bit of a pack (host-built once per pack, int64, -1 = none).

    Per LA bit (8 per output byte, each document's bytes whole): the tile it reads in a head's [sum P^2] tile
    maxima, and whether that tile is diagonal / in column 0; per CA bit: its page (over the pack's pages); per
    page: its keys (over the pack's document keys); per key: its denominator for each `ca_normalize`; per
    document: where its tile maxima and its keys start."""

    la_tile: torch.Tensor
    la_diag: torch.Tensor
    la_col0: torch.Tensor
    ca_page: torch.Tensor
    page_keys: torch.Tensor
    denom: dict
    tmax_off: tuple[int, ...]
    key_off: tuple[int, ...]


@functools.lru_cache(maxsize=4)
def _finish_tables(docs: PackedDocs) -> _FinishTables:
    tile = docs.tile
    la_tile, la_diag, la_col0, ca_page, page_keys, causal, key_index = [], [], [], [], [], [], []
    tmax_off, key_off, pages_before = [], [], 0
    tmax_at = keys_at = 0
    for n, p, la_bytes, ca_bytes in zip(docs.lengths, docs.pages, docs.la_nbytes, docs.ca_nbytes):
        i, j = np.tril_indices(p)  # row-major lower triangle: bit i(i+1)/2 + j
        pad = la_bytes * 8 - len(i)
        la_tile.append(np.concatenate([tmax_at + i * p + j, np.full(pad, -1)]))
        la_diag.append(np.concatenate([i == j, np.zeros(pad, bool)]))
        la_col0.append(np.concatenate([j == 0, np.zeros(pad, bool)]))
        ca_page.append(np.concatenate([pages_before + np.arange(p), np.full(ca_bytes * 8 - p, -1)]))
        keys = np.arange(p * tile)
        page_keys.append(np.where(keys < n, keys_at + keys, -1).reshape(p, tile))
        causal.append(n - np.arange(n))
        key_index.append(np.arange(n) + 1)
        tmax_off.append(tmax_at)
        key_off.append(keys_at)
        tmax_at, keys_at, pages_before = tmax_at + p * p, keys_at + n, pages_before + p
    t = lambda parts: torch.from_numpy(np.concatenate(parts))  # noqa: E731
    return _FinishTables(t(la_tile), t(la_diag), t(la_col0), t(ca_page), t(page_keys),
                         {"causal": t(causal).to(torch.float32), "key_index": t(key_index).to(torch.float32)},
                         tuple(tmax_off), tuple(key_off))


@functools.lru_cache(maxsize=8)
def _finish_tables_on(docs: PackedDocs, device: torch.device) -> _FinishTables:
    """`_finish_tables` on `device`, uploaded once per pack: a per-layer upload would wait for the device's
    queued work."""
    t = _finish_tables(docs)
    on = lambda x: upload(x, device)  # noqa: E731
    return _FinishTables(on(t.la_tile), on(t.la_diag), on(t.la_col0), on(t.ca_page), on(t.page_keys),
                         {k: on(v) for k, v in t.denom.items()}, t.tmax_off, t.key_off)


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[:, index] with index -1 reading False."""
    return torch.nn.functional.pad(x, (0, 1))[:, index]


def finish_packed(
    tile_max: torch.Tensor,
    key_counts: torch.Tensor,
    docs: PackedDocs,
    *,
    la_out: torch.Tensor,
    ca_out: torch.Tensor,
    alpha: float,
    gamma: float,
    ca_normalize: str,
    force_sink_page: bool,
    dense_heads: Sequence[int] = (),
    kept: torch.Tensor | None = None,
    ca_kept: torch.Tensor | None = None,
) -> None:
    """`finish_bits` for every document of a pack at once (the torch twin of the kernels' `_launch_bits`).

    tile_max: [Hq, sum P^2] fp32, each document's [P, P] tile maxima row-major in document order; key_counts:
    [Hq, sum L] int, each document's key counts in order; kept: like tile_max, bool ("mass", "reader"), else
    tile_max >= alpha; ca_kept: [Hq, sum P] bool, the pages chosen ("reader"; tile_max and key_counts are then not
    read), else from key_counts and gamma. Writes la_out [Hq, la_total] / ca_out [Hq, ca_total]; equal to
    `finish_bits` document by document.
    """
    dev = tile_max.device
    t = _finish_tables_on(docs, dev)
    if kept is None:
        kept = tile_max >= torch.tensor(alpha, dtype=torch.float32, device=dev)
    la = _gather(kept, t.la_tile) | t.la_diag
    if force_sink_page:
        la |= t.la_col0
    la &= t.la_tile >= 0
    if ca_kept is None:
        hot = key_counts.to(torch.float32) / t.denom[ca_normalize] >= torch.tensor(gamma, dtype=torch.float32,
                                                                                  device=dev)
        ca_kept = _gather(hot, t.page_keys).any(dim=-1)
    ca = _gather(ca_kept, t.ca_page)
    for h in dense_heads:
        la[h] = t.la_tile >= 0
        ca[h] = t.ca_page >= 0
    la_out.copy_(pack_msb(la))
    ca_out.copy_(pack_msb(ca))


def reader_masses_ref(q: torch.Tensor, k: torch.Tensor, docs: PackedDocs, *, scale: float,
                      softcap: float | None = None, v: torch.Tensor | None = None, out: torch.Tensor | None = None,
                      block_bytes: int = 64 << 20) -> tuple[torch.Tensor, torch.Tensor]:
    """The reader criterion's masses of a pack whose sequences end with the reader (the twin of the kernels'
    `reader_masses`): (tile masses [Hq, sum P^2], page masses [Hq, sum P]) float64, each document's from its own
    rows. q: [Hq, T, D], k / v: [Hkv, T, D(v)]; with v, the layer's output goes to out [Hq, T, Dv]."""
    hq = q.shape[0]
    t = _finish_tables(docs)
    tile_mass = torch.zeros(hq, sum(p * p for p in docs.pages), dtype=torch.float64, device=q.device)
    page_mass = torch.zeros(hq, sum(docs.pages), dtype=torch.float64, device=q.device)
    page_off = 0
    for s, p in enumerate(docs.pages):
        rows, tiles = docs.seq_rows(s), slice(t.tmax_off[s], t.tmax_off[s] + p * p)
        _reader_masses(q[:, rows], k[:, rows], v[:, rows] if v is not None else None,
                       tile_mass[:, tiles].view(hq, p, p), page_mass[:, page_off:page_off + p],
                       out[:, rows] if out is not None else None, scale=scale, n_prefix=docs.n_prefix,
                       n_reader=docs.n_reader, tile=docs.tile, softcap=softcap, block_bytes=block_bytes)
        page_off += p
    return tile_mass, page_mass


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
    itself only), else None. Other arguments as `profile_layer_ref`, whose statistics each document gets (from
    its own rows only); the bits of all documents come from one `finish_packed`.
    """
    validate_profile_args(q, k, n_prefix=docs.n_prefix, tile=docs.tile, alpha=alpha, beta=beta, gamma=gamma,
                          ca_normalize=ca_normalize)
    validate_packed(q, k, docs, la_out, ca_out, v)
    validate_criterion(criterion, coverage, docs)
    hq = q.shape[0]
    t = _finish_tables(docs)
    out = torch.empty(hq, docs.total, v.shape[-1], dtype=v.dtype, device=v.device) if v is not None else None
    squares = sum(p * p for p in docs.pages)
    if criterion == "reader":
        tile_mass, page_mass = reader_masses_ref(q, k, docs, scale=scale, softcap=softcap, v=v, out=out,
                                                 block_bytes=block_bytes)
        kept, ca_kept = select_packed(tile_mass, page_mass, docs, coverage=coverage, force_sink_page=force_sink_page)
        finish_packed(tile_mass, None, docs, la_out=la_out, ca_out=ca_out, alpha=alpha, gamma=gamma,
                      ca_normalize=ca_normalize, force_sink_page=force_sink_page, dense_heads=dense_heads, kept=kept,
                      ca_kept=ca_kept)
        return out
    tile_max = torch.zeros(hq, squares, dtype=torch.float32, device=q.device)
    key_counts = torch.zeros(hq, sum(docs.lengths), dtype=torch.int64, device=q.device)
    kept = torch.zeros(hq, squares, dtype=torch.bool, device=q.device) if criterion == "mass" else None
    for s, (n, p) in enumerate(zip(docs.lengths, docs.pages)):
        rows, tiles = docs.seq_rows(s), slice(t.tmax_off[s], t.tmax_off[s] + p * p)
        _doc_stats(q[:, rows], k[:, rows], v[:, rows] if v is not None else None, tile_max[:, tiles].view(hq, p, p),
                   key_counts[:, t.key_off[s]:t.key_off[s] + n], kept[:, tiles].view(hq, p, p) if kept is not None
                   else None, out[:, rows] if out is not None else None, scale=scale, n_prefix=docs.n_prefix,
                   tile=docs.tile, beta=beta, softcap=softcap, block_bytes=block_bytes, coverage=coverage)
    finish_packed(tile_max, key_counts, docs, la_out=la_out, ca_out=ca_out, alpha=alpha, gamma=gamma,
                  ca_normalize=ca_normalize, force_sink_page=force_sink_page, dense_heads=dense_heads, kept=kept)
    return out
