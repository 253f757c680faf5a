"""Modes "reuse" and "hybrid" of the engine (SPEC section 6; which blocks a call recomputes: runtime/reuse.py):
the documents' position-free KV comes from the engine's KVStore, a missing document is computed on its own after
the index's profiling prefix (inside the request's own forward, or in a forward of its own first where the policy
reads its stored keys), and the request's forward runs only its prefix, query, last and recomputed blocks, the
other blocks' KV read from the documents' pages through a `PagedKVCache`.

These functions compose a `SiftEngine`'s public steps (`segments`, `check_docs`, `metadata`, `forward_tokens`,
`routed_attention`), the engine passed in as `engine` (this module does not import it); `SiftEngine.prefill` and
`generate` call `prefill` for these modes and `release` when the call ends.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from sift.format import content_hash

from ..kernels.layout import DOC, build_layout
from . import reuse
from .forward import StopAfter, Stopped, Timer
from .kv_cache import BatchKVCache, PagedKVCache
from .kv_store import entry_key


def prefill(engine, requests: Sequence, mode: str, new_tokens: int):
    """Modes "reuse" / "hybrid" (runtime/reuse.py): documents' KV from the store (computed on its own on a
    miss), the request's prefix, query and recomputed blocks through the model. -> (the fields of the call's
    `PrefillResult` but its mode, backend and block; the layout; the batch's PagedKVCache, holding the store
    lease until `release`)."""
    t0 = time.perf_counter()
    if engine.device.type == "cuda":
        torch.cuda.current_stream(engine.device).synchronize()
    engine.validate_requests(requests, mode)
    _, policy, fraction = reuse.parse_mode(mode)
    timer = Timer(engine.device)
    segs, lengths = engine.segments(requests, new_tokens)
    if engine.index is not None:
        engine.check_docs(requests, segs)
    shape = [[(k, len(ids)) for k, ids in s] for s in segs]
    layout = build_layout(shape, engine.block, engine.device)
    docs = [(doc_id, ids) for r, s in zip(requests, segs)
            for (doc_id, _), ids in zip(r.docs, [ids for k, ids in s if k == "doc"])]
    dtype = engine.kv_store.geometry.dtype
    keys = [entry_key(engine.kv_store.fingerprint, content_hash(ids), len(ids), dtype, engine.prefix_ids, engine.block)
            for _, ids in docs]
    distinct = {k: d for k, d in zip(keys, docs)}
    fraction = engine.hybrid_fraction if fraction is None else fraction
    plan = _ReusePlan.make(layout, docs, policy, fraction, -(-new_tokens // engine.block))
    all_ids = torch.tensor([t for s in segs for _, seg in s for t in seg], device=engine.device)
    t_store = time.perf_counter()
    lease = engine.kv_store.lease({k: len(ids) for k, (_, ids) in distinct.items()}, plan.scratch_pages,
                                per_miss_pages=-(-len(engine.prefix_ids) // engine.block))
    store_s = time.perf_counter() - t_store
    try:
        # Missing documents join the request's own forward (one forward: they attend only to the profiling
        # prefix and themselves, so their KV is what a forward of their own would give), except where the
        # policy must read their stored KV before choosing what to recompute.
        cold = _ColdDocs.make(engine, lease, distinct, plan) if lease.misses else None
        cold_nnz = 0.0
        cold_blocks = cold.n_doc_blocks if cold is not None else 0
        if cold is not None and policy == "deviation":
            cold_nnz = _compute_docs(engine, cold, timer)
            cold = None
            store_s += _timed(lease.commit)
        recompute = _choose_blocks(engine, policy, layout, all_ids, docs, keys, lease, plan, timer)
        logits, meta, cache = _reuse_forward(engine, shape, layout, all_ids, docs, keys, lease, plan, recompute,
                                                  timer, cold)
        store_s += _timed(lease.commit)
    except BaseException:
        lease.release()
        raise
    stages = timer.totals()
    stages["store"] += store_s
    total = time.perf_counter() - t0
    n_layers, n_heads = engine.model.config.num_hidden_layers, engine.model.config.num_attention_heads
    dense_pairs = n_layers * n_heads * layout.causal_block_pairs
    frac = (float(meta.nnz()) + cold_nnz) / dense_pairs
    doc_tokens = int(layout.doc_n_tokens.sum())
    redone = int(layout.block_valid[recompute].sum()) if doc_tokens else 0
    stages["rest"] = max(0.0, total - sum(stages.values()))
    stages["total"] = total
    status = list(lease.status.values())
    result = dict(logits=logits, ttft_s=(total,) * len(requests), stages=stages, tile_fraction=frac,
                  n_tokens=tuple(lengths), recomputed_fraction=redone / doc_tokens if doc_tokens else 0.0,
                  store=dict(hbm=status.count("hbm"), dram=status.count("dram"), computed=status.count("miss"),
                             computed_blocks=cold_blocks))
    return result, layout, cache


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _compute_docs(engine, cold: "_ColdDocs", timer: Timer) -> float:
    """Compute the missing documents in a forward of their own, straight into their pages (the policies that
    read their stored KV before the request's forward). -> computed tiles."""
    bits = _bits_of(engine, cold.layout, cold.docs, timer)
    meta = engine.metadata(cold.layout, bits, timer)
    slots = cold.pages[cold.layout.token_phys // engine.block] * engine.block + cold.layout.token_phys % engine.block
    cache = PagedKVCache(cold.layout, engine.kv_store, cold.lease, cold.pages, slots,
                         cold.pages.new_empty(0, 0))
    engine.forward_tokens(cold.ids[None], cold.layout.token_local_pos, meta, cache, timer)
    if bits is not None:
        return float(meta.nnz())
    config = engine.model.config   # every causal pair
    return float(config.num_hidden_layers * config.num_attention_heads * cold.layout.causal_block_pairs)


def _choose_blocks(engine, policy, layout, all_ids, docs, keys, lease, plan: "_ReusePlan",
                   timer: Timer) -> torch.Tensor:
    """bool [NB]: the document blocks this request recomputes in context (mode "hybrid")."""
    recompute = torch.zeros(layout.n_blocks, dtype=torch.bool)
    if not plan.per_doc:
        return recompute.to(engine.device)
    first = layout.doc_first_block.tolist()
    scores = _deviation(engine, layout, all_ids, docs, keys, lease, timer) if policy == "deviation" else None
    for d, ((doc_id, ids), k) in enumerate(zip(docs, plan.per_doc)):
        nb = -(-len(ids) // engine.block)
        if policy == "first" or (policy == "bits" and (engine.index is None or doc_id not in engine.index)):
            chosen = np.arange(k)
        elif policy == "bits":
            entry = engine.index.entry(doc_id)
            chosen = reuse.top_blocks(reuse.ca_block_scores(entry.ca, len(ids), engine.index.tile, engine.block,
                                                            engine.index.n_layers * engine.index.n_heads), k)
        else:
            chosen = reuse.top_blocks(scores[d][:nb], k)
        recompute[first[d] + torch.as_tensor(chosen, dtype=torch.long)] = True
    return recompute.to(engine.device)


def _deviation(engine, layout, all_ids, docs, keys, lease, timer: Timer) -> list[np.ndarray]:
    """Per document, per block: squared distance between the request's in-context keys of layer
    DEVIATION_LAYER and the cached ones (CacheBlend's signal), from a forward of the first layers only. Real
    slots only: a last block's padding slots hold whatever an earlier user of the page wrote."""
    meta = engine.metadata(layout, _bits_of(engine, layout, docs, timer), timer)
    cache = BatchKVCache(layout, reuse.DEVIATION_LAYER + 1)
    state = StopAfter(engine.attention_backend, meta, cache, engine.inv_freq, timer, reuse.DEVIATION_LAYER)
    with engine.routed_attention(), contextlib.suppress(Stopped):
        engine.model.base_model(input_ids=all_ids[None], position_ids=layout.token_local_pos[None],
                              use_cache=False, sift_state=state)
    k_ctx, _ = cache.prompt_kv(reuse.DEVIATION_LAYER)
    lease.wait_layer(reuse.DEVIATION_LAYER)
    pool = engine.kv_store.k_pool[reuse.DEVIATION_LAYER]          # [slots, Hkv, D]
    _, h, d = pool.shape
    blk = engine.block
    out = []
    slot = torch.arange(blk, device=pool.device)
    for i, k in enumerate(keys):
        f, n = int(layout.doc_first_block[i]), int(layout.doc_n_blocks[i])
        cached = pool.view(-1, blk, h, d).index_select(0, lease.doc_pages[k]).float()   # [n, blk, Hkv, D]
        ctx = k_ctx.reshape(h, -1, blk, d)[:, f:f + n].permute(1, 2, 0, 3).float()
        real = slot[None, :] < layout.block_valid[f:f + n, None].to(pool.device)       # [n, blk]
        out.append((((ctx - cached) ** 2).sum(dim=(2, 3)) * real).sum(dim=1).cpu().numpy())
    return out


def _bits_of(engine, layout, docs, timer: Timer):
    """The batch's documents' bits (None without an index)."""
    if engine.index is None or not docs:
        return None
    with timer("fetch"):
        return engine.index.fetch([(doc_id, len(ids)) for doc_id, ids in docs], on_unknown=engine.on_unknown)


def _reuse_forward(engine, shape, layout, all_ids, docs, keys, lease, plan: "_ReusePlan", recompute: torch.Tensor,
                   timer: Timer, cold: "_ColdDocs | None" = None):
    """The request's own forward: its prefix, query, last block and recomputed blocks through the model
    (each in a scratch page of the call), every other document block read from its entry's pages; with
    `cold`, the missing documents (each after the profiling prefix, as their own requests ahead of the
    batch's) run in the same forward into their pages. -> (logits [B, vocab], metadata, the batch's cache)."""
    blk = engine.block
    computed = (layout.block_kind != DOC) | recompute
    computed[(layout.req_first_block + layout.req_n_blocks - 1).long()] = True  # the logits' position
    pages = torch.empty(layout.n_blocks, dtype=torch.int64, device=engine.device)
    if docs:
        pages[layout.block_kind == DOC] = torch.cat([lease.doc_pages[k] for k in keys])
    own = lease.scratch[:int(computed.sum())]
    pages[computed] = own
    engine.kv_store.page_valid[own] = layout.block_valid[computed]
    gen = lease.scratch[plan.gen_first:plan.gen_first + layout.n_requests * plan.gen_blocks]
    gen = gen.view(layout.n_requests, plan.gen_blocks)
    if cold is None:
        run, ids, run_pages, run_computed, first_request = layout, all_ids, pages, computed, 0
        bits = _bits_of(engine, layout, docs, timer) if bool(recompute.any()) else None
    else:
        run = build_layout(cold.shape + shape, blk, engine.device)
        ids, run_pages = torch.cat([cold.ids, all_ids]), torch.cat([cold.pages, pages])
        run_computed = torch.cat([torch.ones_like(cold.pages, dtype=torch.bool), computed])
        first_request = len(cold.shape)
        bits = _bits_of(engine, run, cold.docs + docs, timer)
    meta = engine.metadata(run, bits, timer, q_blocks=run_computed.nonzero().flatten())
    sel = run_computed[run.token_phys // blk]
    slots = run_pages[meta.token_phys // blk] * blk + meta.token_phys % blk
    cache = PagedKVCache(run, engine.kv_store, lease, run_pages, slots, gen)
    hidden = engine.forward_tokens(ids[sel][None], run.token_local_pos[sel], meta, cache, timer)
    last = run.token_phys[(run.req_first_token + run.req_n_tokens - 1).long()[first_request:]]
    rows = torch.searchsorted(meta.token_phys, last)
    logits = engine.model.get_output_embeddings()(hidden[0, rows]).float()
    if cold is not None:   # generation reads the batch's own blocks
        cache = PagedKVCache(layout, engine.kv_store, lease, pages, pages.new_empty(0), gen)
    return logits, meta, cache


def release(cache) -> None:
    """End a call's hold on the KV store (reuse modes)."""
    if isinstance(cache, PagedKVCache):
        cache.lease.release()


@dataclass(frozen=True, eq=False)
class _ColdDocs:
    """The documents a reuse call misses, each as its own request: the profiling prefix (in the call's scratch
    pages from `cold_first`), then the document (in its entry's pages)."""

    lease: object
    shape: list                     # build_layout segments: [("prefix", n), ("doc", n)] per document
    layout: object                  # their layout alone
    ids: torch.Tensor               # int64 [tokens], in layout order
    pages: torch.Tensor             # int64 [blocks of `layout`]: the page of each block
    docs: list                      # (doc_id, ids) per document
    n_doc_blocks: int

    @classmethod
    def make(cls, engine, lease, distinct: dict, plan: "_ReusePlan") -> "_ColdDocs":
        misses, pfx = lease.misses, engine.prefix_ids
        shape = [[("prefix", len(pfx)), ("doc", len(distinct[k][1]))] for k in misses]
        layout = build_layout(shape, engine.block, engine.device)
        pages = torch.empty(layout.n_blocks, dtype=torch.int64, device=engine.device)
        is_doc = layout.block_kind == DOC
        pages[is_doc] = torch.cat([lease.doc_pages[k] for k in misses])
        n_pfx = int((~is_doc).sum())
        pfx_pages = lease.scratch[plan.cold_first:plan.cold_first + n_pfx]
        pages[~is_doc] = pfx_pages
        engine.kv_store.page_valid[pfx_pages] = layout.block_valid[~is_doc]
        docs = [distinct[k] for k in misses]
        ids = torch.tensor([t for k in misses for t in pfx + list(distinct[k][1])], device=engine.device)
        return cls(lease, shape, layout, ids, pages, docs, int(is_doc.sum()))


@dataclass(frozen=True)
class _ReusePlan:
    """How a reuse call cuts its scratch pages: [0, gen_first) its own computed blocks (an upper bound: prefix,
    query, last and recomputed blocks), then `gen_blocks` per request for generation (`scratch_pages` in all),
    then from `cold_first` the profiling prefix's blocks of the documents computed on a miss (the store adds
    those per miss). per_doc: blocks recomputed per document ordinal (empty: none)."""

    per_doc: tuple[int, ...]
    gen_blocks: int
    gen_first: int
    cold_first: int
    scratch_pages: int

    @classmethod
    def make(cls, layout, docs, policy, fraction: float, gen_blocks: int) -> "_ReusePlan":
        per_doc = tuple(reuse.budget(-(-len(ids) // layout.block), fraction, policy) for _, ids in docs)
        if not any(per_doc):
            per_doc = ()
        own = int((layout.block_kind != DOC).sum()) + layout.n_requests + sum(per_doc)
        gen = layout.n_requests * gen_blocks
        return cls(per_doc, gen_blocks, own, own + gen, own + gen)
