"""The in-context oracle: the best bits SIFT's format could hold for one prompt, chosen from the prompt's own
attention. It is a reference for the eval (`sift-eval --modes dense,sift,oracle@0.99`), not a serving mode: it
needs an exact dense pass of the prompt first.

An index profiles each document on its own and stores, per (layer, head), LA tiles of the document's own
attention and CA pages that every later document may read (SPEC section 2). Its bits can only guess what a RAG
prompt will attend to. The oracle sees it: one exact forward of the whole prompt (quality/recall.py's attention,
fp32 softmax, one block of rows at a time) sums, per (layer, head), each own-document tile's attention mass and
each page's mass over the rows of all later documents, and keeps the pattern of the same format that loses at
most `1 - coverage` of the document rows' attention mass per (layer, head) while computing the fewest blocks:
the candidates (off-diagonal LA tiles, costing one block pair each; CA pages, costing one block pair per query
block of the later documents) are dropped in increasing order of mass per block pair while the dropped mass stays
within the budget (the diagonal tiles, the prefix and the query rows stay whole, as in SIFT). The tile is the
engine's kernel block, so the engine computes exactly the pattern chosen.

What it answers: how many blocks a per-document index of this format must compute for sparse answers to agree
with dense, when its bits are as good as the prompt itself can make them (the oracle's choice is made on the
dense pass's attention, which the sparse pass then perturbs, and greedily: a near-best, not a proven bound). If
the oracle needs more blocks than an index's thresholds compute for an agreement target, a profile of documents on
their own is not expected to reach that target at fewer blocks.

The reader criterion (`reader@C`) is the same choice made where a builder could make it: on the prompt [profiling
prefix, document, a fixed reader text] (`sift.reader.reader_ids`: the shipped sample corpus's Wikipedia leads,
1024 tokens), keeping the document's tiles and pages only. Its bits depend on the document alone: an index built
with `[profile] criterion = "reader"`, `coverage = C` and `force_sink_page = false` stores the same bits (the
greedy cut is `sift.kernels.reader_select.drop_least_mass` in both; SPEC section 2), up to the float rounding of
the two computations of the masses.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sift.errors import SiftError
from sift.reader import reader_ids

from ..kernels.bits import pack_msb, square_to_tril
from ..kernels.block_indices import pack_doc_bits
from ..kernels.reader_select import drop_least_mass
from ..runtime.request import Request
from ..runtime.supplied_bits import SuppliedBits
from .recall import DocMasks, row_blocks, run_exact, spans_of, tile_sums

MODES = ("oracle", "reader")


def parse_mode(mode: str) -> tuple[str, float] | None:
    """"oracle@C" / "reader@C" -> (name, coverage C in (0, 1]); None for any other mode. A malformed one raises
    SiftError."""
    name, _, value = mode.partition("@")
    if name not in MODES:
        return None
    try:
        coverage = float(value)
    except ValueError:
        coverage = -1.0
    if not 0.0 < coverage <= 1.0:
        raise SiftError(f"mode {mode!r}: write {name}@C with C the share of document rows' attention mass kept, "
                        f"in (0, 1], e.g. {name}@0.99")
    return name, coverage


@dataclass(frozen=True)
class PromptMass:
    """One prompt's exact attention mass at tile T, per document m (float64, on the model's device):
    own[m]: [layers, Hq, P_m, P_m], mass of document m's rows (query tile) on its own keys (key tile);
    read[m]: [layers, Hq, P_m], mass of every later document's rows on each page of document m;
    rows: the document rows' total mass per (layer, head) (each row's attention sums to 1)."""

    own: list[torch.Tensor]
    read: list[torch.Tensor]
    rows: int
    tile: int


class _MassObserver:
    """quality/recall.py's observer interface: sums the probabilities of each block of document rows."""

    def __init__(self, spans, tile: int, n_layers: int, n_heads: int, device):
        self.spans, self.tile = spans, tile
        self.docs = [(s, e) for kind, s, e in spans if kind == "doc"]
        pages = [-(-(e - s) // tile) for s, e in self.docs]
        f64 = dict(dtype=torch.float64, device=device)
        self.own = [torch.zeros(n_layers, n_heads, p, p, **f64) for p in pages]
        self.read = [torch.zeros(n_layers, n_heads, p, **f64) for p in pages]

    def row_blocks(self):
        return row_blocks(self.spans)

    def observe(self, layer: int, m: int, r0: int, r1: int, a: torch.Tensor) -> None:
        """a: [Hq, r1 - r0, r1] fp32 probabilities of rows r0..r1 (inside document m) over keys 0..r1."""
        t = self.tile
        s_m, _ = self.docs[m]
        hq, rows, _ = a.shape
        l0, l1 = r0 - s_m, r1 - s_m
        row_tiles, key_tiles = -(-rows // t), -(-l1 // t)
        own = torch.nn.functional.pad(a[:, :, s_m:r1], (0, key_tiles * t - l1, 0, row_tiles * t - rows))
        self.own[m][layer, :, l0 // t:l0 // t + row_tiles, :key_tiles] += tile_sums(own, row_tiles, key_tiles, t)
        for i, (s_i, e_i) in enumerate(self.docs[:m]):
            n = e_i - s_i
            keys = a[:, :, s_i:e_i].sum(dim=1, dtype=torch.float64)               # [Hq, n]
            pages = self.read[i].shape[-1]
            self.read[i][layer] += torch.nn.functional.pad(keys, (0, pages * t - n)).reshape(hq, pages, t).sum(-1)


def prompt_mass(model, segments: list[tuple[str, list[int]]], tile: int) -> PromptMass:
    """The exact attention mass of one prompt (segments as `SiftEngine.tokenize` gives them) at tile `tile`."""
    cfg = model.config
    spans = spans_of(segments)
    observer = _MassObserver(spans, tile, cfg.num_hidden_layers, cfg.num_attention_heads, model.device)
    run_exact(model, segments, observer)
    rows = sum(e - s for s, e in observer.docs)
    return PromptMass(own=observer.own, read=observer.read, rows=rows, tile=tile)


def select(mass: PromptMass, coverage: float) -> list[DocMasks]:
    """The oracle's pattern: per document, LA tiles [layers, Hq, P, P] and CA pages [layers, Hq, P] kept (bool,
    on the CPU), dropping the least mass per block pair first while at most (1 - coverage) * rows of each
    (layer, head)'s document-row mass is dropped."""
    pages = [r.shape[-1] for r in mass.read]
    later = [sum(pages[m + 1:]) for m in range(len(pages))]  # query blocks that read document m's pages
    items, costs, where = [], [], []
    for m, (own, read) in enumerate(zip(mass.own, mass.read)):
        p = pages[m]
        rows, cols = torch.tril_indices(p, p, offset=-1, device=own.device)
        items.append(own[..., rows, cols])
        costs.append(torch.ones(rows.numel(), dtype=torch.float64, device=own.device))
        where.append(("la", m, rows, cols))
        if later[m]:
            items.append(read)
            costs.append(torch.full((p,), float(later[m]), dtype=torch.float64, device=own.device))
            where.append(("ca", m, None, None))
    keep_la = [torch.ones_like(own, dtype=torch.bool).tril() for own in mass.own]
    keep_ca = [torch.ones_like(read, dtype=torch.bool) for read in mass.read]
    if items:
        values = torch.cat(items, dim=-1)                                          # [layers, Hq, N]
        cost = torch.cat(costs)                                                    # [N]
        one = torch.zeros(cost.shape, dtype=torch.int64, device=cost.device)       # one budget for the prompt
        budget = torch.full((*values.shape[:-1], 1), (1.0 - coverage) * mass.rows, dtype=torch.float64,
                            device=values.device)
        drop = drop_least_mass(values, cost, one, budget)
        start = 0
        for (kind, m, rows, cols), part in zip(where, items):
            d = drop[..., start:start + part.shape[-1]]
            start += part.shape[-1]
            if kind == "la":
                keep_la[m][..., rows, cols] = ~d
            else:
                keep_ca[m] &= ~d
    return [DocMasks(la=la.cpu(), ca=ca.cpu()) for la, ca in zip(keep_la, keep_ca)]


def pack(masks: list[DocMasks], n_tokens: list[int], tile: int, device) -> SuppliedBits:
    """Masks of the batch's documents, in order -> SuppliedBits in SPEC section 3's per-document blob layout."""
    n_layers, n_heads = masks[0].ca.shape[:2]
    la = [pack_msb(square_to_tril(m.la)).numpy().tobytes() for m in masks]
    ca = [pack_msb(m.ca).numpy().tobytes() for m in masks]
    bits = pack_doc_bits(la, ca, n_tokens, tile=tile, n_layers=n_layers, n_heads=n_heads, device=device)
    return SuppliedBits(bits=bits, tile=tile)


def reader_mass(engine, doc_ids: list[int], reader: list[int]) -> PromptMass:
    """A document's mass as a profile could see it offline: the document alone after the index's profiling
    prefix, read by the fixed `reader` placed after it. Only the document's own tiles and its pages' reads are
    candidates (the reader's own tiles carry no mass here)."""
    segments = [("prefix", list(engine.prefix_ids)), ("doc", list(doc_ids)), ("doc", list(reader))]
    mass = prompt_mass(engine.model, segments, engine.block)
    return PromptMass(own=[mass.own[0], torch.zeros_like(mass.own[1])], read=mass.read, rows=mass.rows,
                      tile=mass.tile)


@dataclass
class ReaderCache:
    """The reader's token ids and each document's reader mass (by its token ids), kept across calls."""

    reader: list[int] | None = None
    masses: dict[tuple[int, ...], PromptMass] = field(default_factory=dict)


def reader_bits(engine, requests: list[Request], coverage: float,
                cache: ReaderCache | None = None) -> SuppliedBits | None:
    """The reader criterion's bits for a batch: each document's masks chosen from `reader_mass` at `coverage`,
    the same for the document wherever it appears (what a builder could store)."""
    cache = cache if cache is not None else ReaderCache()
    if cache.reader is None:
        cache.reader = reader_ids(engine.tokenizer)
    masks, n_tokens = [], []
    for request in requests:
        for kind, ids in engine.tokenize(request):
            if kind == "doc":
                key = tuple(ids)
                if key not in cache.masses:
                    cache.masses[key] = reader_mass(engine, ids, cache.reader)
                masks.append(select(cache.masses[key], coverage)[0])
                n_tokens.append(len(ids))
    if not masks:
        return None
    return pack(masks, n_tokens, engine.block, engine.device)


def batch_masses(engine, requests: list[Request]) -> list[PromptMass]:
    """Each request's prompt mass at the engine's block."""
    return [prompt_mass(engine.model, engine.tokenize(r), engine.block) for r in requests]


def batch_bits(engine, requests: list[Request], coverage: float,
               masses: list[PromptMass] | None = None) -> SuppliedBits | None:
    """The oracle's bits for a batch at `coverage` (masses: `batch_masses`, computed here when None), for
    `supplied_bits.generate_with_bits(engine, requests, n, bits)`. None when the batch has no documents."""
    masses = masses if masses is not None else batch_masses(engine, requests)
    masks, n_tokens = [], []
    for request, mass in zip(requests, masses):
        segments = engine.tokenize(request)
        masks += select(mass, coverage)
        n_tokens += [len(ids) for kind, ids in segments if kind == "doc"]
    if not masks:
        return None
    return pack(masks, n_tokens, engine.block, engine.device)
