"""Prefill plans: what one prefill forward of a group of requests runs, decided before the model runs
(STYLE 11 and 14: the scheduler decides, the runner executes).

    PageNeed       the pages a request takes from the KV pool when it is admitted (its documents, its own
                   blocks, its generation pages), known when it is added
    PlanContext    what the builders read: the engine's configuration (block, index, store, backend)
    PrefillPlan    one forward, frozen: token ids and positions, the metadata, the cache view, the rows whose
                   logits are kept, each request's decode block table, and the figures of the result
    sift_plan      the builder of modes "sift" and "dense"; modes "reuse" and "hybrid" have theirs in
                   runtime/reuse_prefill.py (`reuse_plan`); the engine picks one per group

Every mode writes into pages of the pool: a request's lease (runtime/kv_store.py) holds its documents' pages
(reuse modes) and its own scratch pages, cut as [own blocks | generation pages | the profiling prefix of each
document it computes on a miss].
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from sift.format import content_hash

from ..kernels.layout import build_layout
from . import reuse
from .backends import dense_layers
from .forward import Timer
from .kv_cache import PagedKVCache
from .kv_store import entry_key
from .metadata import PrefillMetadata
from .modes import Mode


def n_blocks(n_tokens: int, block: int) -> int:
    return -(-n_tokens // block)


@dataclass(frozen=True)
class PageNeed:
    """docs: the request's distinct document store keys -> n_tokens (reuse modes; empty otherwise); own: pages
    of the blocks the request computes; gen: its generation pages; per_miss: pages of the profiling prefix of
    each document the store misses. Its lease's scratch is [own | gen | per_miss per miss]."""

    docs: dict
    own: int
    gen: int
    per_miss: int = 0

    def worst(self, block: int) -> int:
        """Pages the request holds at most (every document missing)."""
        return self.own + self.gen + sum(n_blocks(n, block) + self.per_miss for n in self.docs.values())


@dataclass(frozen=True)
class PlanContext:
    """The engine's configuration as the builders read it (fixed when the engine is made)."""

    block: int
    device: torch.device
    n_layers: int
    n_heads: int
    index: object                   # SiftIndex | None
    on_unknown: str
    prefix_ids: tuple[int, ...]     # the index's profiling prefix (the canonical context of a store entry)
    store: object                   # KVStore
    backend: object                 # the attention backend (bits -> block CSR)
    hybrid_fraction: float

    def doc_key(self, ids: list[int]) -> str:
        store = self.store
        return entry_key(store.fingerprint, content_hash(ids), len(ids), store.geometry.dtype, self.prefix_ids,
                         self.block)

    def fetch(self, docs: list[tuple[str, list[int]]], timer: Timer):
        """The documents' bits from the index, in order (None without an index or documents)."""
        if self.index is None or not docs:
            return None
        with timer("fetch"):
            return self.index.fetch([(doc_id, len(ids)) for doc_id, ids in docs], on_unknown=self.on_unknown)

    def metadata(self, layout, bits, timer: Timer, q_blocks: torch.Tensor | None = None,
                 tile: int | None = None) -> PrefillMetadata:
        """Every layer's block CSR, before the forward: from the bits (of `tile`, default the index's), or dense
        when there are none; only the rows of `q_blocks` when given."""
        with timer("decode"):
            if bits is None:
                return PrefillMetadata.build(layout, dense_layers(layout, self.n_heads, self.n_layers),
                                             sparse=False, q_blocks=q_blocks)
            indices = self.backend.decode_indices(layout, bits, tile or self.index.tile, self.n_heads)
            return PrefillMetadata.build(layout, indices, sparse=True, q_blocks=q_blocks)

    def dense_pairs(self, layout) -> int:
        return self.n_layers * self.n_heads * layout.causal_block_pairs


@dataclass(frozen=True, eq=False)
class PrefillPlan:
    """One prefill forward. ids / positions: int64 [n], the tokens it runs (in the metadata's token order) at
    their segment-local positions; meta / cache: what its attention reads and where its K / V go; logit_rows:
    int64 [B], the row of each request's last prompt token among those tokens; tables: per request, int32 pages
    and kv offsets of its prompt blocks in logical order (its decode block table, generation pages to follow),
    and None or (mode "ape") int32 flags of the blocks that are reused documents' pages;
    computed / dense: tiles computed (a 0-d device tensor, read when the result is made) and the dense causal
    count; recomputed_tokens / doc_tokens: reuse modes' share of document tokens computed in context; store: the
    documents found in HBM / DRAM / computed (reuse modes); leases: committed once the forward wrote their
    misses."""

    ids: torch.Tensor
    positions: torch.Tensor
    meta: PrefillMetadata
    cache: PagedKVCache
    logit_rows: torch.Tensor
    tables: tuple
    computed: torch.Tensor | float
    dense: int
    recomputed_tokens: int = 0
    doc_tokens: int = 0
    store: dict = field(default_factory=dict)
    leases: tuple = ()


def page_need(ctx: PlanContext, mode: Mode, segments: list, max_tokens: int) -> PageNeed:
    """The pages a request of `segments` (as `SiftEngine.tokenize` gives them) takes in `mode`, generating up to
    max_tokens tokens (the last one drawn is never written to the cache)."""
    blk = ctx.block
    gen = n_blocks(max_tokens - 1, blk) if max_tokens > 1 else 0
    if not mode.reuses:
        return PageNeed({}, sum(n_blocks(len(ids), blk) for _, ids in segments), gen)
    docs = [ids for kind, ids in segments if kind == "doc"]
    fraction = ctx.hybrid_fraction if mode.fraction is None else mode.fraction
    if mode.kind == "auto":     # at most its whole budget, whichever documents take it
        recompute = math.ceil(fraction * sum(n_blocks(len(ids), blk) for ids in docs))
    else:
        recompute = sum(reuse.budget(n_blocks(len(ids), blk), fraction, mode.policy) for ids in docs)
    own = sum(n_blocks(len(ids), blk) for kind, ids in segments if kind != "doc") + 1 + recompute
    return PageNeed({ctx.doc_key(ids): len(ids) for ids in docs}, own, gen, n_blocks(len(ctx.prefix_ids), blk))


def sift_plan(ctx: PlanContext, mode: Mode, states, timer: Timer, supplied=None) -> PrefillPlan:
    """Modes "sift" and "dense": every token of every request through the model, each request's blocks in its
    own scratch pages; sparse from the documents' bits (the index's, or `supplied`: (DocBits, tile)), dense
    otherwise."""
    blk = ctx.block
    layout = build_layout([[(k, len(ids)) for k, ids in s.segments] for s in states], blk, ctx.device)
    block_pages = torch.cat([s.lease.scratch[:n] for s, (_, n) in zip(states, layout.request_blocks)])
    slots = block_pages[layout.token_phys // blk] * blk + layout.token_phys % blk
    cache = PagedKVCache(layout, ctx.store, [s.lease for s in states], block_pages, slots)
    cache.claim(block_pages, layout.block_valid)
    bits, tile = None, None
    if supplied is not None:
        bits, tile = supplied
        bits = bits if layout.n_docs else None
    elif mode.kind == "sift":
        docs = [(doc_id, ids) for s in states
                for (doc_id, _), ids in zip(s.request.docs, [ids for k, ids in s.segments if k == "doc"])]
        bits = ctx.fetch(docs, timer)
    meta = ctx.metadata(layout, bits, timer, tile=tile)
    ids = torch.tensor([t for s in states for _, seg in s.segments for t in seg], device=ctx.device)
    offsets = layout.block_offset
    tables = tuple((block_pages[f:f + n].to(torch.int32), offsets[f:f + n], None)
                   for f, n in layout.request_blocks)
    dense = ctx.dense_pairs(layout)
    return PrefillPlan(ids=ids, positions=layout.token_local_pos, meta=meta, cache=cache,
                       logit_rows=(layout.req_first_token + layout.req_n_tokens - 1).long(), tables=tables,
                       computed=meta.nnz() if meta.sparse else float(dense), dense=dense)
