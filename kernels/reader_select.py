"""The reader criterion's choice (SPEC section 2): attention masses -> the LA tiles and CA pages kept.

Each document is profiled as [profiling prefix, document, reader text]. Per (layer, query head) its candidates are
the off-diagonal LA tiles of the document (one block pair each; column 0 too unless `force_sink_page`), whose
mass is the document rows' attention on the tile, and its CA pages, whose mass is the reader rows' attention on
the page and whose cost is one block pair per reader query tile (ceil(n_reader / tile)), as a later document's
rows would read it. Candidates are dropped in increasing order of mass per block pair (ties: candidate order,
the LA tiles in bit order, then the pages in page order) while the dropped mass stays within (1 - coverage) of
the document and reader rows' attention mass (each row's attention sums to 1: the budget is (1 - coverage) *
(L + n_reader)). Everything else is kept: the diagonal tiles, the sink page when forced, the prefix.

One implementation for every user of the choice: the builder's torch reference and the Triton launcher (through
`select_packed`, on masses computed by each), and the eval's in-context oracle (`drop_least_mass`, on its own
masses). The masses are float64 here; the order and the cut are exact functions of them, so two computations of
the masses that differ by rounding give the same bits unless a mass sits within that rounding of the cut or two
masses per block pair that straddle the cut are that close.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .device import upload
from .packing import PackedDocs


def drop_least_mass(values: torch.Tensor, cost: torch.Tensor, segment: torch.Tensor,
                    budget: torch.Tensor) -> torch.Tensor:
    """The greedy cut. values: [..., N] float64 masses (>= 0); cost: [N] float64 block pairs (> 0); segment: [N]
    int64 nondecreasing (the candidates of one segment are chosen together: a document of a pack); budget:
    [..., S] float64 per segment. Within each segment, candidates in increasing order of values / cost (stable:
    ties keep candidate order) are dropped while their cumulative mass stays <= the segment's budget.
    -> drop [..., N] bool."""
    ratio = values / cost
    by_ratio = torch.argsort(ratio, dim=-1, stable=True)
    # Segments are nondecreasing, so a stable sort by segment keeps each segment at its own positions.
    order = torch.gather(by_ratio, -1, torch.argsort(segment[by_ratio], dim=-1, stable=True))
    dropped = torch.cumsum(torch.gather(values, -1, order), dim=-1)
    first = torch.searchsorted(segment, torch.arange(budget.shape[-1], device=segment.device))  # [S]
    before = torch.nn.functional.pad(dropped, (1, 0))[..., first]                             # [..., S]
    within = dropped - before[..., segment]
    drop_sorted = within <= budget[..., segment]
    return torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)


@dataclass(frozen=True)
class ReaderTables:
    """The candidates of a pack (host-built once, int64 / float64 on the CPU): per candidate, where its mass is
    in [tile masses (sum P^2) ++ page masses (sum P)] (`source`), its cost and its document; per document, its
    row count L + n_reader."""

    source: torch.Tensor
    cost: torch.Tensor
    segment: torch.Tensor
    rows: torch.Tensor
    n_la: int  # candidates with source < n_la are LA tiles (source: the tile), the rest pages (source - n_la)


@functools.lru_cache(maxsize=8)
def reader_tables(docs: PackedDocs, force_sink_page: bool, device: torch.device) -> ReaderTables:
    """The pack's candidates on `device`, built and uploaded once per pack (a per-layer upload would wait for the
    device's queued work)."""
    t = _reader_tables(docs, force_sink_page)
    return ReaderTables(upload(t.source, device), upload(t.cost, device), upload(t.segment, device),
                        upload(t.rows, device), t.n_la)


def _reader_tables(docs: PackedDocs, force_sink_page: bool) -> ReaderTables:
    if docs.n_reader < 1:
        raise ValueError("the reader criterion needs a reader: PackedDocs(..., n_reader > 0)")
    reader_tiles = -(-docs.n_reader // docs.tile)
    n_la = sum(p * p for p in docs.pages)
    source, cost, segment = [], [], []
    tile_at = page_at = 0
    for d, p in enumerate(docs.pages):
        i, j = np.tril_indices(p, -1)  # row-major: bit order
        if force_sink_page:
            i, j = i[j > 0], j[j > 0]
        source += [tile_at + i * p + j, n_la + page_at + np.arange(p)]
        cost += [np.ones(len(i)), np.full(p, float(reader_tiles))]
        segment += [np.full(len(i) + p, d)]
        tile_at, page_at = tile_at + p * p, page_at + p
    rows = np.asarray(docs.lengths, dtype=np.float64) + docs.n_reader
    t = lambda parts, dtype: torch.from_numpy(np.concatenate(parts).astype(dtype))  # noqa: E731
    return ReaderTables(t(source, np.int64), t(cost, np.float64), t(segment, np.int64), torch.from_numpy(rows), n_la)


def select_packed(tile_mass: torch.Tensor, page_mass: torch.Tensor, docs: PackedDocs, *, coverage: float,
                  force_sink_page: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The reader criterion for every document of a pack.

    tile_mass: [Hq, sum P^2] each document's [P, P] tile masses of its rows (row-major, lower triangle read);
    page_mass: [Hq, sum P] the reader rows' mass on each page; any float dtype (the choice is made in float64).
    -> (kept tiles [Hq, sum P^2] bool, True off the candidates; kept pages [Hq, sum P] bool), for
    `profile_ref.finish_packed(kept=..., ca_kept=...)`."""
    t = reader_tables(docs, force_sink_page, tile_mass.device)
    masses = torch.cat([tile_mass, page_mass], dim=-1).to(torch.float64)
    values = masses[:, t.source]
    budget = ((1.0 - coverage) * t.rows).expand(masses.shape[0], -1)
    drop = drop_least_mass(values, t.cost, t.segment, budget)
    kept = torch.ones_like(masses, dtype=torch.bool)
    kept[:, t.source] = ~drop
    return kept[:, :t.n_la], kept[:, t.n_la:]
