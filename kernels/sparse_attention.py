"""Block-sparse prefill flash attention over the position-free KV cache, with RoPE (SPEC sections 4, 5): the
public entry and its torch twins.

Layout (physical): the requests of a batch are packed into N = NB * block token slots; every segment (prefix,
each document, query) is padded to whole blocks, real tokens first. q and k are stored rotated at
*segment-local* positions; `block_offset[b]` is the logical position of the first token of block b's segment.
For query block qb and key block kb the score of the logical (fully rotated) q and k equals
`q . R(delta) k` with `delta = block_offset[kb] - block_offset[qb]`: one physical copy of a document's keys
serves any placement. The stored keys are never modified.

Sparsity is CSR over (head, query block): row `h * NB + qb` lists the key blocks (global block ids, ascending)
that query block qb of head h attends to. The diagonal block is masked causally by slot; key slots at or beyond
`block_valid[kb]` are never attended; query rows at or beyond `block_valid[qb]` are written as 0.

`sparse_attention` validates the arguments and picks the backend (`attention_backend`), in one place:
  "gluon": the warp-specialised Hopper kernel (`sparse_attention_sm90`; sm_90, block 128, head_dim 128, 16-bit);
  "tl":    the kernel in Triton's tile language (`sparse_attention_tl`; any CUDA GPU, or the Triton interpreter);
  "torch": `sparse_attention_ref`, the torch twin (same signature and result; loops over (head, query block):
           tests, debugging, small CPU prefill).
`sparse_attention_torch` computes the same with SDPA per request, fast enough for whole models on CPU.
`check_layout` validates the CSR / layout values (it reads them on the host, so the hot path does not call it).
"""
from __future__ import annotations

import os

import torch

from sift.format import TILES

from . import sparse_attention_sm90 as sm90
from . import sparse_attention_tl as tl_kernel
from .layout import BatchLayout
from .numerics import check_heads_and_blocks, check_scale
from .rope import apply_rope_ref

BLOCKS = TILES
HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BACKENDS = ("gluon", "tl", "torch")


def _validate(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, scale, block, out,
              q_block_start=None, row_end=None) -> None:
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
    if q_block_start is None and n_q != n:
        raise ValueError(f"q has {n_q} rows and k {n} slots: without q_block_start q must be in the padded layout")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim={d} is unsupported; use one of {HEAD_DIMS}")
    nb = check_heads_and_blocks(hq, hkv, n, block)
    check_scale(scale)
    for name, x, shape in (
        ("indptr", indptr, (hq * nb + 1,)),
        ("block_valid", block_valid, (nb,)),
        ("block_offset", block_offset, (nb,)),
    ):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.int32 or tuple(x.shape) != shape:
            raise ValueError(f"{name} must be int32 {list(shape)} (Hq={hq}, NB={nb}); got "
                             f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int32 or indices.dim() != 1:
        raise ValueError(f"indices must be a 1-D int32 tensor; got {getattr(indices, 'dtype', type(indices))} "
                         f"{tuple(getattr(indices, 'shape', ()))}")
    if inv_freq is not None and (not isinstance(inv_freq, torch.Tensor) or tuple(inv_freq.shape) != (d // 2,)
                                 or not inv_freq.is_floating_point()):
        raise ValueError(f"inv_freq must be None or a float tensor [D/2]={d // 2}; got "
                         f"{tuple(getattr(inv_freq, 'shape', ()))}")
    if row_end is not None and (not isinstance(row_end, torch.Tensor) or row_end.dtype != torch.int32
                                or tuple(row_end.shape) != (hq * nb,)):
        raise ValueError(f"row_end must be None or int32 [Hq * NB={hq * nb}]; got "
                         f"{getattr(row_end, 'dtype', type(row_end))} {tuple(getattr(row_end, 'shape', ()))}")
    if q_block_start is not None and (not isinstance(q_block_start, torch.Tensor) or q_block_start.dtype != torch.int32
                                      or tuple(q_block_start.shape) != (nb,)):
        raise ValueError(f"q_block_start must be None or int32 [NB={nb}]; got "
                         f"{getattr(q_block_start, 'dtype', type(q_block_start))} "
                         f"{tuple(getattr(q_block_start, 'shape', ()))}")
    if out is not None and (tuple(out.shape) != (hq, n_q, d) or out.dtype != q.dtype):
        raise ValueError(f"out must be {q.dtype} [{hq}, {n_q}, {d}]; got {out.dtype} {tuple(out.shape)}")
    tensors = [q, k, v, indptr, indices, block_valid, block_offset] + ([out] if out is not None else []) \
        + ([q_block_start] if q_block_start is not None else []) + ([row_end] if row_end is not None else [])
    devices = {x.device for x in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")


def check_layout(indptr, indices, block_valid, block_offset, *, block: int) -> None:
    """Value checks of the CSR and layout (reads them on the host; call it where a sync is affordable)."""
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


def attention_backend(q, k, v, block: int, out=None) -> str:
    """The backend `sparse_attention` runs for these tensors: "gluon" where the Hopper kernel takes the call
    (`sparse_attention_sm90.supports`), else "tl" on CUDA or under TRITON_INTERPRET=1, else "torch"."""
    if sm90.supports(q, k, v, block, out):
        return "gluon"
    if q.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return "tl"
    return "torch"


def sparse_attention(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, *, scale, block, out=None,
                     q_block_start=None, row_end=None):
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

    Layout values are not checked here (that needs a device sync); see `check_layout`.
    """
    _validate(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, scale, block, out, q_block_start,
              row_end)
    backend = attention_backend(q, k, v, block, out)
    args = (q, k, v, indptr, indices, block_valid, block_offset, inv_freq)
    if backend == "torch":
        return sparse_attention_ref(*args, scale=scale, block=block, out=out, q_block_start=q_block_start,
                                    row_end=row_end)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if backend == "gluon":
        return sm90.launch(*args, scale=scale, out=out, q_block_start=q_block_start, row_end=row_end)
    return tl_kernel.launch(*args, scale=scale, block=block, out=out, q_block_start=q_block_start, row_end=row_end)


def sparse_attention_ref(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, *, scale, block, out=None,
                         q_block_start=None, row_end=None):
    """Torch twin of `sparse_attention` (same signature and result); fp32 softmax, fp64 RoPE angles.

    Loops over (head, query block): meant for tests, debugging and small CPU prefill, not for speed.
    """
    _validate(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, scale, block, out, q_block_start,
              row_end)
    if row_end is not None:  # rows with spare capacity -> compact CSR
        starts, ends = indptr[:-1].long().cpu(), row_end.long().cpu()
        if bool((ends < starts).any()) or (ends.numel() and int(ends.max()) > indices.numel()):
            raise ValueError("row_end must satisfy indptr[r] <= row_end[r] <= len(indices)")
        idx = indices.cpu()
        indices = torch.cat([idx[a:b] for a, b in zip(starts.tolist(), ends.tolist())] or [idx[:0]]).to(q.device)
        indptr = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(ends - starts, 0)]).to(
            device=q.device, dtype=torch.int32)
    check_layout(indptr, indices, block_valid, block_offset, block=block)
    if q_block_start is not None:  # real-token rows -> padded slots, then back
        n_slots = k.shape[1]
        slot = torch.arange(n_slots, device=q.device)
        b, c = slot // block, slot % block
        real = c < block_valid.long()[b]
        rows = (q_block_start.long()[b] + c)[real]
        q_pad = q.new_zeros(q.shape[0], n_slots, q.shape[2])
        q_pad[:, real] = q[:, rows]
        o_pad = sparse_attention_ref(q_pad, k, v, indptr, indices, block_valid, block_offset, inv_freq,
                                     scale=scale, block=block)
        result = q.new_zeros(q.shape)
        result[:, rows] = o_pad[:, real]
        if out is None:
            return result
        out.copy_(result)
        return out
    hq, n, d = q.shape
    nb = n // block
    group = hq // k.shape[0]
    ptr = indptr.tolist()
    idx = indices.tolist()
    valid = block_valid.tolist()
    offset = block_offset.tolist()
    result = torch.zeros((hq, n, d), dtype=torch.float32, device=q.device)
    slot = torch.arange(block, device=q.device)
    for h in range(hq):
        kk, vv = k[h // group], v[h // group]
        for qb in range(nb):
            kbs = idx[ptr[h * nb + qb]:ptr[h * nb + qb + 1]]
            if not kbs or valid[qb] == 0:
                continue
            keys, vals, allowed = [], [], []
            for kb in kbs:
                kt = kk[kb * block:(kb + 1) * block]                               # [block, D]
                if inv_freq is not None:
                    delta = torch.full((block,), offset[kb] - offset[qb], device=q.device)
                    kt = apply_rope_ref(kt[None].float(), delta, inv_freq.float())[0]
                keys.append(kt.float())
                vals.append(vv[kb * block:(kb + 1) * block].float())
                ok = (slot < valid[kb])[None, :].expand(block, block)
                if kb == qb:
                    ok = ok & (slot[None, :] <= slot[:, None])
                allowed.append(ok)
            qt = q[h, qb * block:(qb + 1) * block].float()                          # [block, D]
            s = qt @ torch.cat(keys).T * scale                                      # [block, nk * block]
            s = s.masked_fill(~torch.cat(allowed, dim=1), float("-inf"))
            p = torch.softmax(s, dim=-1).nan_to_num(0.0)                            # rows with no key -> 0
            vcat = torch.cat(vals).nan_to_num(0.0) * torch.cat(allowed, dim=1).any(0)[:, None]
            o = p @ vcat
            o[valid[qb]:] = 0
            result[h, qb * block:(qb + 1) * block] = o
    result = result.to(q.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def sparse_attention_torch(q, k, v, indptr, indices, layout: BatchLayout, inv_freq, *, scale, causal=False):
    """Torch equivalent of `sparse_attention_ref` for one layer (same result), fast enough for whole models on
    CPU. q: [Hq, N, D], k / v: [Hkv, N, D] in `layout` (segment-local RoPE); -> [Hq, N, D], padding rows 0.

    Per request, on its real tokens only: rotating q and k by their segment's offset puts both at logical
    positions, so scores equal the kernel's `q . R(delta) k`; the CSR becomes a token mask (block kept and
    causal) for torch's SDPA. causal=True: the CSR is known to be dense causal (mode "dense"), so no mask is
    built."""
    hq, nb, blk = q.shape[0], layout.n_blocks, layout.block
    out = torch.zeros_like(q)
    keep = None
    if not causal:
        counts = (indptr[1:] - indptr[:-1]).long()
        rows = torch.repeat_interleave(torch.arange(hq * nb, device=q.device), counts)
        keep = torch.zeros(hq * nb, nb, dtype=torch.bool, device=q.device)
        keep[rows, indices[: int(indptr[-1])].long()] = True
        keep = keep.view(hq, nb, nb)
    offset = layout.token_logical_pos - layout.token_local_pos  # [n_tokens] segment offset of each token
    for (b0, nbr), first, n in zip(layout.request_blocks, layout.req_first_token.tolist(),
                                   layout.req_n_tokens.tolist()):
        phys = layout.token_phys[first : first + n]
        # A request whose every causal block is kept (all-ones bits, tiny documents) needs no mask.
        full = causal or int(keep[:, b0 : b0 + nbr, b0 : b0 + nbr].tril().sum()) == hq * nbr * (nbr + 1) // 2
        qr, kr, vr = q[:, phys], k[:, phys], v[:, phys]
        if inv_freq is not None:
            qr = apply_rope_ref(qr, offset[first : first + n], inv_freq)
            kr = apply_rope_ref(kr, offset[first : first + n], inv_freq)
        args = dict(scale=scale, enable_gqa=True)
        if full:
            args["is_causal"] = True
        else:
            tb = phys // blk
            mask = keep.index_select(1, tb).index_select(2, tb)  # [Hq, n, n]
            args["attn_mask"] = (mask & torch.ones(n, n, dtype=torch.bool, device=q.device).tril())[None]
        o = torch.nn.functional.scaled_dot_product_attention(qr[None].float(), kr[None].float(), vr[None].float(),
                                                             **args)[0]
        out[:, phys] = o.nan_to_num(0.0).to(out.dtype)  # a row with no key (empty CSR row) is 0, as in the kernel
    return out
