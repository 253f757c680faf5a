"""Block-sparse prefill flash attention over the position-free KV cache, with RoPE (SPEC sections 4, 5): the
public entry, its ref twin and the vectorised CPU attention.

Layout (physical): the requests of a batch are packed into N = NB * block token slots; every segment (prefix,
each document, query) is padded to whole blocks, real tokens first. q and k are stored rotated at
*segment-local* positions; `block_offset[b]` is the logical position of the first token of block b's segment.
For query block qb and key block kb the score of the logical (fully rotated) q and k equals
`q . R(delta) k` with `delta = block_offset[kb] - block_offset[qb]`: one physical copy of a document's keys
serves any placement. The stored keys are never modified.

Sparsity is CSR over (head, query block): row `h * NB + qb` lists the key blocks (global block ids, ascending)
that query block qb of head h attends to. The diagonal block is masked causally by slot; key slots at or beyond
`block_valid[kb]` are never attended; query rows at or beyond `block_valid[qb]` are written as 0.

Only some query blocks may be computed (`q_blocks`: a prefill whose documents' KV comes from a cache runs only
the prefix and query tokens through the model, and their queries attend to every block): the CSR then has one
row per (head, computed block), row `h * NQ + i` for query block `q_blocks[i]`, and the rows of other blocks
are not written. Key block ids, the causal diagonal (kb == q_blocks[i]) and the per-block tables stay as above.

K and V may be pools of pages read in place (`kv_pages`: logical key block b is page kv_pages[b] of k / v): a
prompt assembled from the KV store's pages (shared documents, the call's own scratch pages) is attended with no
gathered copy of the layer. Only the memory address of a block changes; its id, valid slots, offset and the CSR
stay logical.

`sparse_attention` validates the arguments and picks the backend (`attention_backend`), in one place:
  "gluon": the warp-specialised Hopper kernel (`sparse_attention_sm90`; sm_90, block 128, head_dim 128, 16-bit);
  "tl":    the kernel in Triton's tile language (`sparse_attention_tl`; any CUDA GPU, or the Triton interpreter);
  "ref":   `sparse_attention_ref`, the ref twin (plain torch, same signature and result; loops over (head, query
           block): tests, debugging, small CPU prefill).
`sparse_attention_sdpa` computes the same with torch's SDPA per request, fast enough for whole models on CPU (the
engine's backend "torch"; runtime/backends.py says how the names relate).
`check_layout` validates the CSR / layout values (it reads them on the host, so the hot path does not call it).
"""
from __future__ import annotations


import torch

from sift.format import TILES

from . import sparse_attention_sm90 as sm90
from . import sparse_attention_tl as tl_kernel
from .ape import ape_probs, check_ape
from .device import triton_runs_on
from .layout import BatchLayout, gather_blocks
from .numerics import check_heads_and_blocks, check_scale
from .rope import apply_rope_ref

BLOCKS = TILES
HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BACKENDS = ("gluon", "tl", "ref")


def _describe(x) -> str:
    return f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}"


def _check_int32(name: str, x, shape: tuple, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.int32 or tuple(x.shape) != shape:
        raise ValueError(f"{name} must be int32 {list(shape)} ({what}); got {_describe(x)}")


def check_rows(hq: int, nb: int, indptr, row_end=None, q_blocks=None) -> int:
    """Shapes of the CSR's row tables and of q_blocks (int32 [NQ], 1 <= NQ <= NB) -> NQ, the query blocks
    computed (NB without q_blocks): indptr int32 [Hq * NQ + 1], row_end None or int32 [Hq * NQ]."""
    nq = nb
    if q_blocks is not None:
        if not isinstance(q_blocks, torch.Tensor) or q_blocks.dtype != torch.int32 or q_blocks.dim() != 1 \
                or not 1 <= q_blocks.numel() <= nb:
            raise ValueError(f"q_blocks must be None or int32 [NQ] with 1 <= NQ <= NB={nb} (the query blocks to "
                             f"compute); got {_describe(q_blocks)}")
        nq = q_blocks.numel()
    what = f"Hq={hq}, NB={nb}" if q_blocks is None else f"Hq={hq}, NQ={nq} query blocks of NB={nb}"
    _check_int32("indptr", indptr, (hq * nq + 1,), what)
    if row_end is not None:
        _check_int32("row_end", row_end, (hq * nq,), f"None or rows Hq * NQ, {what}")
    return nq


def _validate(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, scale, block, out,
              q_block_start=None, row_end=None, q_blocks=None, kv_pages=None, parallel=None, ape=None) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [H, N, D]; got {getattr(x, 'shape', type(x))}")
        if x.dtype not in DTYPES:
            raise ValueError(f"{name}.dtype={x.dtype} is unsupported; use one of {DTYPES}")
    hq, n_q, d = q.shape
    n = k.shape[1]  # physical slots
    hkv = k.shape[0]
    if k.shape != v.shape or k.shape[2] != d:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [Hkv, N, D={d}] like q")
    if kv_pages is not None:
        if not isinstance(kv_pages, torch.Tensor) or kv_pages.dtype != torch.int32 or kv_pages.dim() != 1:
            raise ValueError(f"kv_pages must be None or int32 [NB] (the page of k / v holding each key block); got "
                             f"{_describe(kv_pages)}")
        if isinstance(block_valid, torch.Tensor) and kv_pages.numel() != block_valid.numel():
            raise ValueError(f"kv_pages has {kv_pages.numel()} entries: give one page per block of the layout "
                             f"(NB={block_valid.numel()})")
        n = kv_pages.numel() * block   # logical slots; k / v hold the pool's pages
        if k.shape[1] % block:
            raise ValueError(f"k / v pools have {k.shape[1]} slots: a whole number of pages of block={block}")
    if q_block_start is None and n_q != n:
        raise ValueError(f"q has {n_q} rows and the layout {n} slots: without q_block_start q must be in the "
                         f"padded layout")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim={d} is unsupported; use one of {HEAD_DIMS}")
    nb = check_heads_and_blocks(hq, hkv, n, block)
    check_scale(scale)
    check_rows(hq, nb, indptr, row_end, q_blocks)
    _check_int32("block_valid", block_valid, (nb,), f"NB={nb}")
    _check_int32("block_offset", block_offset, (nb,), f"NB={nb}")
    if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int32 or indices.dim() != 1:
        raise ValueError(f"indices must be a 1-D int32 tensor; got {_describe(indices)}")
    if inv_freq is not None and (not isinstance(inv_freq, torch.Tensor) or tuple(inv_freq.shape) != (d // 2,)
                                 or not inv_freq.is_floating_point()):
        raise ValueError(f"inv_freq must be None or a float tensor [D/2]={d // 2}; got "
                         f"{tuple(getattr(inv_freq, 'shape', ()))}")
    if q_block_start is not None:
        _check_int32("q_block_start", q_block_start, (nb,), f"None or NB={nb}")
    check_parallel(parallel, ape, nb)
    if out is not None and (tuple(out.shape) != (hq, n_q, d) or out.dtype != q.dtype):
        raise ValueError(f"out must be {q.dtype} [{hq}, {n_q}, {d}]; got {out.dtype} {tuple(out.shape)}")
    tensors = [q, k, v, indptr, indices, block_valid, block_offset] + [
        x for x in (out, q_block_start, row_end, q_blocks, kv_pages, parallel) if x is not None]
    devices = {x.device for x in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")


def check_parallel(parallel, ape, nb: int) -> None:
    """The APE option (kernels/ape.py): parallel int32 [NB] (nonzero: key block b is parallel-encoded context)
    and ape (temperature, scale), both given or both None."""
    if (parallel is None) != (ape is None):
        raise ValueError("give parallel= and ape= together (the context blocks and their (temperature, scale)), "
                         "or neither")
    if ape is not None:
        check_ape(ape)
        _check_int32("parallel", parallel, (nb,), f"None or NB={nb}: one flag per key block")


def check_layout(indptr, indices, block_valid, block_offset, *, block: int, q_blocks=None, kv_pages=None,
                 n_pages: int = 0, parallel=None) -> None:
    """Value checks of the CSR and layout, of q_blocks (distinct block ids), of kv_pages (pages in
    [0, n_pages)) and of parallel (no computed query block is parallel-encoded context) when given (reads them on
    the host; call it where a sync is affordable)."""
    nb = block_valid.numel()
    ptr = indptr.cpu().long()
    idx = indices.cpu().long()
    if ptr[0] != 0 or ptr[-1] != idx.numel() or bool((ptr[1:] < ptr[:-1]).any()):
        raise ValueError(f"indptr must start at 0, never decrease and end at len(indices)={idx.numel()}")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= nb):
        raise ValueError(f"indices must be block ids in [0, NB={nb}); got [{int(idx.min())}, {int(idx.max())}]")
    rows = torch.repeat_interleave(torch.arange(ptr.numel() - 1), ptr[1:] - ptr[:-1])
    if idx.numel() > 1 and bool(((idx[1:] <= idx[:-1]) & (rows[1:] == rows[:-1])).any()):
        raise ValueError("indices of each CSR row must be strictly ascending")
    bv = block_valid.cpu()
    if bool(((bv < 0) | (bv > block)).any()):
        raise ValueError(f"block_valid values must lie in [0, block={block}]")
    if q_blocks is not None:
        qb = q_blocks.cpu().long()
        if int(qb.min()) < 0 or int(qb.max()) >= nb or torch.unique(qb).numel() != qb.numel():
            raise ValueError(f"q_blocks must be distinct block ids in [0, NB={nb}); got {qb.tolist()[:16]}")
    if parallel is not None:
        computed = parallel.cpu() if q_blocks is None else parallel.cpu()[q_blocks.cpu().long()]
        if bool(computed.any()):
            raise ValueError("parallel marks a computed query block: a block computed in this call is not "
                             "parallel-encoded context (mark only blocks read from a cache)")
    if kv_pages is not None and kv_pages.numel():
        kp = kv_pages.cpu().long()
        if int(kp.min()) < 0 or int(kp.max()) >= n_pages:
            raise ValueError(f"kv_pages must be pages of k / v in [0, {n_pages}); got [{int(kp.min())}, "
                             f"{int(kp.max())}]")


def attention_backend(q, k, v, block: int, out=None) -> str:
    """The backend `sparse_attention` runs for these tensors: "gluon" where the Hopper kernel takes the call
    (`sparse_attention_sm90.supports`), else "tl" on CUDA or under TRITON_INTERPRET=1, else "ref"."""
    if sm90.supports(q, k, v, block, out):
        return "gluon"
    if triton_runs_on(q.device):
        return "tl"
    return "ref"


def sparse_attention(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, *, scale, block, out=None,
                     q_block_start=None, row_end=None, q_blocks=None, kv_pages=None, parallel=None, ape=None):
    """Block-sparse causal attention with RoPE by block offsets (forward), on the backend `attention_backend`
    picks.

    q: [Hq, N, D]; k, v: [Hkv, N, D] (any strides; fp16 / bf16 / fp32), N = NB * block, D in {64, 128}.
    indptr: int32 [Hq * NB + 1] (row h * NB + qb); indices: int32 [nnz] key block ids, ascending per row.
    block_valid, block_offset: int32 [NB]. inv_freq: [D/2] float, or None when k is already at logical positions.
    scale: softmax scale. block: layout block in {16, 32, 64, 128}. out: optional [Hq, N, D] in q's dtype.
    Returns out [Hq, N, D] in q's dtype. Query rows beyond block_valid are 0.
    q_block_start: optional int32 [NB]. When given, q and out hold only the real tokens ([Hq, n_tokens, D], any
    strides, e.g. the model's own projections and a [n_tokens, Hq, D] buffer seen through a transpose): block
    b's valid slots are rows q_block_start[b] .. + block_valid[b] - 1. No padded copy of q or out is made, and
    out rows of padding do not exist. k, v stay in the padded layout (the position-free cache).
    row_end: optional int32 [Hq * NB]: row r lists indices[indptr[r]:row_end[r]] (rows with spare capacity,
    as `block_indices(..., padded=True)` writes them in one pass); default indptr[1:] (compact CSR).
    q_blocks: optional int32 [NQ], distinct block ids: only these query blocks are computed. The CSR then has
    Hq * NQ rows (indptr [Hq * NQ + 1], row_end [Hq * NQ]), row h * NQ + i for block q_blocks[i]; out rows of
    other blocks are not written (a new out holds whatever torch.empty left there). With q_block_start, q / out
    hold the tokens of the computed blocks only and q_block_start is read at those blocks only.
    kv_pages: optional int32 [NB]: k and v are pools of pages [Hkv, P * block, D] (any strides: the KV store's
    token-major pool seen through a transpose) and key block b is page kv_pages[b]; the kernels read the pages in
    place, so a prompt assembled from cached documents needs no gathered copy. block_valid / block_offset stay
    per logical block.
    parallel, ape: optional, together: parallel int32 [NB] marks the key blocks of parallel-encoded context
    (nonzero; documents read from the KV store; never a computed query block) and ape = (temperature, scale)
    rescales every row's attention to them as kernels/ape.py defines (APE). Without them the result is plain softmax attention, computed as
    before the option existed.

    Layout values are not checked here (that needs a device sync); see `check_layout`.
    """
    _validate(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, scale, block, out, q_block_start,
              row_end, q_blocks, kv_pages, parallel, ape)
    backend = attention_backend(q, k, v, block, out) if ape is None else (
        "tl" if triton_runs_on(q.device) else "ref")    # the Hopper kernel has no APE path
    args = (q, k, v, indptr, indices, block_valid, block_offset, inv_freq)
    rows = dict(q_block_start=q_block_start, row_end=row_end, q_blocks=q_blocks, kv_pages=kv_pages)
    if ape is not None:
        rows.update(parallel=parallel, ape=ape)
    if backend == "ref":
        return sparse_attention_ref(*args, scale=scale, block=block, out=out, **rows)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if backend == "gluon":
        return sm90.launch(*args, scale=scale, out=out, **rows)
    return tl_kernel.launch(*args, scale=scale, block=block, out=out, **rows)


def sparse_attention_ref(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, *, scale, block, out=None,
                         q_block_start=None, row_end=None, q_blocks=None, kv_pages=None, parallel=None, ape=None):
    """The ref twin of `sparse_attention` (same signature and result; out=None: rows not computed are 0); fp32
    softmax, fp64 RoPE angles.

    Loops over (head, query block): meant for tests, debugging and small CPU prefill, not for speed.
    """
    _validate(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, scale, block, out, q_block_start,
              row_end, q_blocks, kv_pages, parallel, ape)
    indptr, indices = _compact_csr(indptr, indices, row_end)
    rescale = None if ape is None else (parallel.tolist(), *check_ape(ape))
    check_layout(indptr, indices, block_valid, block_offset, block=block, q_blocks=q_blocks, kv_pages=kv_pages,
                 n_pages=k.shape[1] // block, parallel=parallel)
    if kv_pages is not None:
        k, v = gather_blocks(k, kv_pages, block), gather_blocks(v, kv_pages, block)
    nb = k.shape[1] // block
    blocks = list(range(nb)) if q_blocks is None else q_blocks.tolist()
    target = q.new_zeros(q.shape) if out is None else out
    if q_block_start is None:
        _ref_rows(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, scale, block, blocks, target,
                  rescale)
        return target
    # Real-token rows of the computed blocks -> padded slots, then back.
    slot = torch.arange(k.shape[1], device=q.device)
    b, c = slot // block, slot % block
    computed = torch.zeros(nb, dtype=torch.bool, device=q.device)
    computed[blocks] = True
    real = (c < block_valid.long()[b]) & computed[b]
    rows = (q_block_start.long()[b] + c)[real]
    q_pad = q.new_zeros(q.shape[0], k.shape[1], q.shape[2])
    q_pad[:, real] = q[:, rows]
    _ref_rows(q_pad, k, v, indptr, indices, block_valid, block_offset, inv_freq, scale, block, blocks, q_pad,
              rescale)
    target[:, rows] = q_pad[:, real]
    return target


def _compact_csr(indptr, indices, row_end):
    """Rows with spare capacity (row r = indices[indptr[r]:row_end[r]]) -> the compact CSR (indptr, indices)."""
    if row_end is None:
        return indptr, indices
    starts, ends = indptr[:-1].long().cpu(), row_end.long().cpu()
    if bool((ends < starts).any()) or (ends.numel() and int(ends.max()) > indices.numel()):
        raise ValueError("row_end must satisfy indptr[r] <= row_end[r] <= len(indices)")
    idx = indices.cpu()
    indices = torch.cat([idx[a:b] for a, b in zip(starts.tolist(), ends.tolist())] or [idx[:0]]).to(indptr.device)
    indptr = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(ends - starts, 0)]).to(
        device=indptr.device, dtype=torch.int32)
    return indptr, indices


def _ref_rows(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, scale, block, blocks, out,
              rescale=None):
    """out[h, rows of block blocks[i]] = attention of CSR row h * NQ + i (q, out padded [Hq, N, D]; out may be q:
    each tile's q is read before its rows are written). rescale: None or (parallel flags as a list, temperature,
    scale): the APE option."""
    hq, nq = q.shape[0], len(blocks)
    group = hq // k.shape[0]
    ptr, idx = indptr.tolist(), indices.tolist()
    tables = (block_valid.tolist(), block_offset.tolist())
    for h in range(hq):
        for i, qb in enumerate(blocks):
            rows = slice(qb * block, (qb + 1) * block)
            o = _ref_tile(q[h, rows], k[h // group], v[h // group], idx[ptr[h * nq + i]:ptr[h * nq + i + 1]], qb,
                          *tables, inv_freq, scale, block, rescale)
            out[h, rows] = o.to(out.dtype)


def _ref_tile(qt, kk, vv, kbs, qb, valid, offset, inv_freq, scale, block, rescale=None):
    """One query block qb (qt: [block, D]) against key blocks kbs of one kv head (kk, vv: [N, D]) -> fp32
    [block, D]; rows beyond valid[qb], and rows that see no key, are 0. rescale: `_ref_rows`'."""
    o = torch.zeros(block, qt.shape[1], dtype=torch.float32, device=qt.device)
    if not kbs or valid[qb] == 0:
        return o
    slot = torch.arange(block, device=qt.device)
    keys, vals, allowed = [], [], []
    for kb in kbs:
        kt = kk[kb * block:(kb + 1) * block]                                   # [block, D]
        if inv_freq is not None:
            delta = torch.full((block,), offset[kb] - offset[qb], device=qt.device)
            kt = apply_rope_ref(kt[None].float(), delta, inv_freq.float())[0]
        keys.append(kt.float())
        vals.append(vv[kb * block:(kb + 1) * block].float())
        ok = (slot < valid[kb])[None, :].expand(block, block)
        if kb == qb:
            ok = ok & (slot[None, :] <= slot[:, None])
        allowed.append(ok)
    allowed = torch.cat(allowed, dim=1)                                          # [block, nk * block]
    s = qt.float() @ torch.cat(keys).T * scale
    s = s.masked_fill(~allowed, float("-inf"))
    if rescale is None:
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)                             # rows with no key -> 0
    else:
        flags, temperature, ctx_scale = rescale
        parallel = torch.tensor([bool(flags[kb]) for kb in kbs], device=qt.device).repeat_interleave(block)
        p = ape_probs(s, parallel, temperature, ctx_scale)
    o = p @ (torch.cat(vals).nan_to_num(0.0) * allowed.any(0)[:, None])
    o[valid[qb]:] = 0
    return o


def _block_mask(indptr, indices, row_end, q_blocks, hq: int, nb: int) -> torch.Tensor:
    """The CSR (compact, or rows with spare capacity; one row per (head, computed block)) as bool [Hq, NB, NB]:
    [h, qb, kb] is set iff key block kb is listed for query block qb of head h."""
    starts = indptr[:-1].long()
    counts = (indptr[1:].long() if row_end is None else row_end.long()) - starts
    nq = counts.numel() // hq
    rows = torch.repeat_interleave(torch.arange(counts.numel(), device=indptr.device), counts)
    first = torch.cumsum(counts, 0) - counts                                     # each row's first entry, packed
    pos = starts[rows] + torch.arange(rows.numel(), device=indptr.device) - first[rows]
    qb = torch.arange(nq, device=indptr.device) if q_blocks is None else q_blocks.long()
    keep = torch.zeros(hq, nb, nb, dtype=torch.bool, device=indptr.device)
    keep[rows // nq, qb[rows % nq], indices[pos].long()] = True
    return keep


def sparse_attention_sdpa(q, k, v, indptr, indices, layout: BatchLayout, inv_freq, *, scale, causal=False,
                           row_end=None, q_blocks=None, parallel=None, ape=None):
    """`sparse_attention_ref`'s result for one layer computed with torch's SDPA per request, fast enough for whole
    models on CPU. q: [Hq, N, D], k / v: [Hkv, N, D] in `layout` (segment-local RoPE); -> [Hq, N, D], padding rows 0.
    row_end, q_blocks: as in `sparse_attention`; rows of blocks not in q_blocks are not computed and are 0.

    Per request, on its real tokens only: rotating q and k by their segment's offset puts both at logical
    positions, so scores equal the kernel's `q . R(delta) k`; the CSR becomes a token mask (block kept and
    causal) for torch's SDPA. causal=True: the CSR is known to be dense causal (mode "dense"), so no mask is
    built. parallel, ape: `sparse_attention`'s APE option; the rows are then computed from explicit scores (SDPA
    returns no log-sum-exp), APE_ROWS rows at a time."""
    hq, nb, blk = q.shape[0], layout.n_blocks, layout.block
    check_rows(hq, nb, indptr, row_end, q_blocks)
    check_parallel(parallel, ape, nb)
    out = torch.zeros_like(q)
    keep = None if causal else _block_mask(indptr, indices, row_end, q_blocks, hq, nb)
    computed = None
    if q_blocks is not None:
        computed = torch.zeros(nb, dtype=torch.bool, device=q.device)
        computed[q_blocks.long()] = True
    offset = layout.token_logical_pos - layout.token_local_pos  # [n_tokens] segment offset of each token
    for (b0, nbr), first, n in zip(layout.request_blocks, layout.req_first_token.tolist(),
                                   layout.req_n_tokens.tolist()):
        phys = layout.token_phys[first : first + n]
        tb = phys // blk
        # The request's query tokens that are computed (all without q_blocks), as indices into its tokens.
        sel = torch.arange(n, device=q.device) if computed is None else computed[tb].nonzero()[:, 0]
        if sel.numel() == 0:
            continue
        qr, kr, vr = q[:, phys[sel]], k[:, phys], v[:, phys]
        if inv_freq is not None:
            qr = apply_rope_ref(qr, offset[first : first + n][sel], inv_freq)
            kr = apply_rope_ref(kr, offset[first : first + n], inv_freq)
        if ape is not None:
            mask = sel[:, None] >= torch.arange(n, device=q.device)[None, :]
            if keep is not None:
                mask = keep.index_select(1, tb[sel]).index_select(2, tb) & mask
            out[:, phys[sel]] = _ape_rows(qr, kr, vr, mask, parallel.bool()[tb], scale, *check_ape(ape)).to(out.dtype)
            continue
        args = dict(scale=scale, enable_gqa=True)
        # A request whose every causal block is kept (all-ones bits, tiny documents) needs no mask.
        full = sel.numel() == n and (
            causal or int(keep[:, b0 : b0 + nbr, b0 : b0 + nbr].tril().sum()) == hq * nbr * (nbr + 1) // 2)
        if full:
            args["is_causal"] = True
        else:
            mask = sel[:, None] >= torch.arange(n, device=q.device)[None, :]      # [n_sel, n] causal
            if keep is not None:
                mask = keep.index_select(1, tb[sel]).index_select(2, tb) & mask   # [Hq, n_sel, n]
            args["attn_mask"] = mask[None] if mask.dim() == 3 else mask
        o = torch.nn.functional.scaled_dot_product_attention(qr[None].float(), kr[None].float(), vr[None].float(),
                                                             **args)[0]
        out[:, phys[sel]] = o.nan_to_num(0.0).to(out.dtype)  # a row with no key (empty CSR row) is 0, as in the kernel
    return out


APE_ROWS = 256


def _ape_rows(qr, kr, vr, mask, parallel, scale: float, temperature: float, ctx_scale: float) -> torch.Tensor:
    """APE attention of one request's rows from explicit fp32 scores, APE_ROWS rows at a time. qr [Hq, m, D],
    kr / vr [Hkv, n, D], mask bool [m, n] or [Hq, m, n], parallel bool [n] -> fp32 [Hq, m, D]."""
    group = qr.shape[0] // kr.shape[0]
    k = kr.float().repeat_interleave(group, dim=0)
    v = vr.float().nan_to_num(0.0).repeat_interleave(group, dim=0)
    out = torch.empty(qr.shape, dtype=torch.float32, device=qr.device)
    for r0 in range(0, qr.shape[1], APE_ROWS):
        rows = slice(r0, r0 + APE_ROWS)
        s = (qr[:, rows].float() @ k.transpose(1, 2)) * scale
        m = mask[..., rows, :]
        s = s.masked_fill(~(m if m.dim() == 3 else m[None]), float("-inf"))
        out[:, rows] = ape_probs(s, parallel, temperature, ctx_scale) @ v
    return out
