"""The plan builder of modes "reuse" and "hybrid" (SPEC section 6; which blocks a request recomputes:
runtime/reuse.py): the documents' position-free KV comes from the KV store, a missing document is computed on its
own after the index's profiling prefix (inside the requests' own forward, or in a forward of its own first where
the policy reads its stored keys), and the forward runs only each request's prefix, query, last and recomputed
blocks, the other blocks' KV read from the documents' pages.

Each request's lease (taken by the scheduler when it was admitted) pins its documents and holds its scratch
pages, cut as `PageNeed` says: [its computed blocks | its generation pages | the profiling prefix of each document
it misses]. A document two requests of the group share is missed by the first one's lease only: the second finds
the entry the first is computing, and reads its pages at each layer after the forward wrote them.

The builder decides; the forwards it needs before deciding (the `deviation` policy's) run through the runner.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.layout import DOC, build_layout
from . import reuse
from .forward import Timer
from .kv_cache import BatchKVCache, PagedKVCache, PoolKV
from .modes import Mode
from .plan import PlanContext, PrefillPlan, n_blocks


def reuse_plan(ctx: PlanContext, runner, mode: Mode, states, timer: Timer) -> PrefillPlan:
    """-> the plan of the group's forward (modes "reuse" / "hybrid"); missing documents are part of it, except
    under the `deviation` policy, which computes them first (its plan's leases are then already committed)."""
    blk = ctx.block
    shape = [[(k, len(ids)) for k, ids in s.segments] for s in states]
    layout = build_layout(shape, blk, ctx.device)
    docs, doc_state = [], []
    for s in states:
        for (doc_id, _), ids in zip(s.request.docs, [ids for k, ids in s.segments if k == "doc"]):
            docs.append((doc_id, ids))
            doc_state.append(s)
    keys = [ctx.doc_key(ids) for _, ids in docs]
    doc_pages = [s.lease.doc_pages[k] for s, k in zip(doc_state, keys)]
    fraction = ctx.hybrid_fraction if mode.fraction is None else mode.fraction
    if mode.kind == "auto":
        per_doc = tuple(k for s in states for k in _auto_blocks(ctx, s, fraction, mode.threshold))
    else:
        per_doc = tuple(reuse.budget(n_blocks(len(ids), blk), fraction, mode.policy) for _, ids in docs)
    leases = [s.lease for s in states]
    all_ids = torch.tensor([t for s in states for _, seg in s.segments for t in seg], device=ctx.device)

    cold = _ColdDocs.make(ctx, states) if any(s.lease.misses for s in states) else None
    cold_nnz, cold_blocks = 0.0, (cold.n_doc_blocks if cold is not None else 0)
    if cold is not None and mode.policy == "deviation":
        cold_nnz = _compute_docs(ctx, runner, cold, leases, timer)
        t = time.perf_counter()
        for lease in leases:
            lease.commit()
        timer.add("store", time.perf_counter() - t)
        cold, leases_to_commit = None, ()
    else:
        leases_to_commit = tuple(leases)
    recompute = _choose_blocks(ctx, runner, mode.policy, layout, all_ids, docs, doc_pages, per_doc, leases, timer)
    plan = _forward_plan(ctx, states, shape, layout, all_ids, docs, doc_pages, recompute, timer, cold, mode.ape)
    status = [st for lease in leases for st in lease.status.values()]
    doc_tokens = sum(len(ids) for _, ids in docs)
    recomputed = int(layout.block_valid[recompute.to(ctx.device)].sum()) if doc_tokens else 0
    return PrefillPlan(**plan, computed=plan["meta"].nnz() + cold_nnz, dense=ctx.dense_pairs(layout),
                       recomputed_tokens=recomputed, doc_tokens=doc_tokens, leases=leases_to_commit,
                       store=dict(hbm=status.count("hbm"), dram=status.count("dram"), computed=status.count("miss"),
                                  computed_blocks=cold_blocks))


def _auto_blocks(ctx: PlanContext, state, fraction: float, threshold: float) -> list[int]:
    """Mode "auto": blocks recomputed per document of one request, from the index's context sensitivity."""
    sizes = [n_blocks(len(ids), ctx.block) for k, ids in state.segments if k == "doc"]
    index = ctx.index
    scores = [index.sensitivity(doc_id) if index is not None else None for doc_id, _ in state.request.docs]
    return reuse.auto_budget(sizes, scores, fraction, threshold)


def _compute_docs(ctx: PlanContext, runner, cold: "_ColdDocs", leases, timer: Timer) -> float:
    """Compute the missing documents in a forward of their own, straight into their pages (the policies that
    read their stored KV before the request's forward). -> computed tiles."""
    bits = ctx.fetch(cold.docs, timer)
    meta = ctx.metadata(cold.layout, bits, timer)
    blk = ctx.block
    slots = cold.pages[cold.layout.token_phys // blk] * blk + cold.layout.token_phys % blk
    cache = PagedKVCache(cold.layout, ctx.store, leases, cold.pages, slots)
    runner.forward(cold.ids, cold.layout.token_local_pos, meta, cache, timer)
    return float(meta.nnz()) if bits is not None else float(ctx.dense_pairs(cold.layout))


def _choose_blocks(ctx: PlanContext, runner, policy, layout, all_ids, docs, doc_pages, per_doc, leases,
                   timer: Timer) -> torch.Tensor:
    """bool [NB] on the host: the document blocks the group recomputes in context (mode "hybrid")."""
    recompute = torch.zeros(layout.n_blocks, dtype=torch.bool)
    if not any(per_doc):
        return recompute
    blk, index = ctx.block, ctx.index
    first = layout.doc_first_block.tolist()
    scores = (_deviation(ctx, runner, layout, all_ids, docs, doc_pages, leases, timer) if policy == "deviation"
              else None)
    for d, ((doc_id, ids), k) in enumerate(zip(docs, per_doc)):
        nb = n_blocks(len(ids), blk)
        if policy in ("first", "auto") or (policy == "bits" and (index is None or doc_id not in index)):
            chosen = np.arange(k)
        elif policy == "bits":
            entry = index.entry(doc_id)
            chosen = reuse.top_blocks(reuse.ca_block_scores(entry.ca, len(ids), index.tile, blk,
                                                            index.n_layers * index.n_heads), k)
        else:
            chosen = reuse.top_blocks(scores[d][:nb], k)
        recompute[first[d] + torch.as_tensor(chosen, dtype=torch.long)] = True
    return recompute


def _deviation(ctx: PlanContext, runner, layout, all_ids, docs, doc_pages, leases, timer: Timer) -> list:
    """Per document, per block: squared distance between the request's in-context keys of layer
    DEVIATION_LAYER and the cached ones (CacheBlend's signal), from a forward of the first layers only. Real
    slots only: a last block's padding slots hold whatever an earlier user of the page wrote."""
    layer = reuse.DEVIATION_LAYER
    meta = ctx.metadata(layout, ctx.fetch(docs, timer), timer)
    cache = BatchKVCache(layout, layer + 1)
    runner.forward_until(all_ids, layout.token_local_pos, meta, cache, layer, timer)
    k_ctx, _ = cache.prompt_kv(layer)
    for lease in leases:
        lease.wait_layer(layer)
    pool = ctx.store.k_pool[layer]          # [slots, Hkv, D]
    _, h, d = pool.shape
    blk = ctx.block
    out = []
    slot = torch.arange(blk, device=pool.device)
    for i, pages in enumerate(doc_pages):
        f, n = int(layout.doc_first_block[i]), int(layout.doc_n_blocks[i])
        cached = pool.view(-1, blk, h, d).index_select(0, pages).float()                 # [n, blk, Hkv, D]
        in_ctx = k_ctx.reshape(h, -1, blk, d)[:, f:f + n].permute(1, 2, 0, 3).float()
        real = slot[None, :] < layout.block_valid[f:f + n, None].to(pool.device)        # [n, blk]
        out.append((((in_ctx - cached) ** 2).sum(dim=(2, 3)) * real).sum(dim=1).cpu().numpy())
    return out


def _forward_plan(ctx: PlanContext, states, shape, layout, all_ids, docs, doc_pages, recompute: torch.Tensor,
                  timer: Timer, cold: "_ColdDocs | None", ape: tuple[float, float] | None = None) -> dict:
    """The group's own forward: each request's prefix, query, last block and recomputed blocks through the model
    (in the request's own scratch pages), every other document block read from its entry's pages; with
    `cold`, the missing documents (each after the profiling prefix, as their own requests ahead of the group's)
    run in the same forward into their pages; with `ape`, the attention to the blocks read from the store is
    rescaled (mode "ape"; each request's decode table then carries which of its entries they are). -> the fields
    of the plan's forward."""
    blk, dev = ctx.block, ctx.device
    kinds = torch.tensor([k != "doc" for s in shape for k, n in s for _ in range(n_blocks(n, blk))], dtype=torch.bool)
    computed = kinds | recompute                                                   # host, [NB]
    for f, n in layout.request_blocks:
        computed[f + n - 1] = True                                                 # the logits' position
    per_request = [int(computed[f:f + n].sum()) for f, n in layout.request_blocks]
    computed_d = computed.to(dev)
    pages = torch.empty(layout.n_blocks, dtype=torch.int64, device=dev)
    if docs:
        pages[layout.block_kind == DOC] = torch.cat(doc_pages)
    own = torch.cat([s.lease.scratch[:c] for s, c in zip(states, per_request)])
    pages[computed_d] = own
    PoolKV(ctx.store).claim(own, layout.block_valid[computed_d])
    if cold is None:
        run, ids, run_pages, run_computed, first_request = layout, all_ids, pages, computed_d, 0
        bits = ctx.fetch(docs, timer) if bool(recompute.any()) else None
    else:
        run = build_layout(cold.shape + shape, blk, dev)
        ids, run_pages = torch.cat([cold.ids, all_ids]), torch.cat([cold.pages, pages])
        run_computed = torch.cat([torch.ones_like(cold.pages, dtype=torch.bool), computed_d])
        first_request = len(cold.shape)
        bits = ctx.fetch(cold.docs + docs, timer)
    meta = ctx.metadata(run, bits, timer, q_blocks=run_computed.nonzero().flatten())
    parallel = None
    if ape is not None:     # the document blocks read from the store: every block of kind DOC not computed here
        parallel = ((run.block_kind == DOC) & ~run_computed).to(torch.int32)
        meta = dataclasses.replace(meta, parallel=parallel, ape=ape)
    sel = run_computed[run.token_phys // blk]
    slots = run_pages[meta.token_phys // blk] * blk + meta.token_phys % blk
    cache = PagedKVCache(run, ctx.store, [s.lease for s in states], run_pages, slots)
    last = run.token_phys[(run.req_first_token + run.req_n_tokens - 1).long()[first_request:]]
    offsets = layout.block_offset
    own = parallel[run.n_blocks - layout.n_blocks:] if parallel is not None else None   # after cold blocks
    tables = tuple((pages[f:f + n].to(torch.int32), offsets[f:f + n],
                    None if own is None else own[f:f + n]) for f, n in layout.request_blocks)
    return dict(ids=ids[sel], positions=run.token_local_pos[sel], meta=meta, cache=cache,
                logit_rows=torch.searchsorted(meta.token_phys, last), tables=tables)


@dataclass(frozen=True, eq=False)
class _ColdDocs:
    """The documents a group's leases miss, each as its own request: the profiling prefix (in the scratch pages
    of the lease that missed it, after its own and generation pages), then the document (in its entry's
    pages)."""

    shape: list                     # build_layout segments: [("prefix", n), ("doc", n)] per document
    layout: object                  # their layout alone
    ids: torch.Tensor               # int64 [tokens], in layout order
    pages: torch.Tensor             # int64 [blocks of `layout`]: the page of each block
    docs: list                      # (doc_id, ids) per document
    n_doc_blocks: int

    @classmethod
    def make(cls, ctx: PlanContext, states) -> "_ColdDocs":
        pfx, blk = list(ctx.prefix_ids), ctx.block
        misses, doc_pages, pfx_pages = [], [], []
        for s in states:
            by_key = {ctx.doc_key(ids): (doc_id, ids)
                      for (doc_id, _), ids in zip(s.request.docs, [ids for k, ids in s.segments if k == "doc"])}
            first = s.need.own + s.need.gen
            for i, key in enumerate(s.lease.misses):
                misses.append(by_key[key])
                doc_pages.append(s.lease.doc_pages[key])
                pfx_pages.append(s.lease.scratch[first + i * s.need.per_miss:first + (i + 1) * s.need.per_miss])
        shape = [[("prefix", len(pfx)), ("doc", len(ids))] for _, ids in misses]
        layout = build_layout(shape, blk, ctx.device)
        pages = torch.empty(layout.n_blocks, dtype=torch.int64, device=ctx.device)
        is_doc = layout.block_kind == DOC
        pages[is_doc] = torch.cat(doc_pages)
        pfx_pages = torch.cat(pfx_pages)
        pages[~is_doc] = pfx_pages
        PoolKV(ctx.store).claim(pfx_pages, layout.block_valid[~is_doc])
        ids = torch.tensor([t for _, ids in misses for t in pfx + list(ids)], device=ctx.device)
        return cls(shape, layout, ids, pages, misses, int(is_doc.sum()))
