"""Block-sparse prefill flash attention with RoPE applied to key tiles in the kernel (SPEC sections 4, 5).

Layout (physical): the requests of a batch are packed into N = NB * block token slots; every segment (prefix,
each document, query) is padded to whole blocks, real tokens first. q and k are stored rotated at
*segment-local* positions; `block_offset[b]` is the logical position of the first token of block b's segment.
For query block qb and key block kb the score of the logical (fully rotated) q and k equals
`q . R(delta) k` with `delta = block_offset[kb] - block_offset[qb]`, so the kernel rotates each loaded K tile
once by `delta` (LazyAttention): one physical copy of a document's keys serves any placement.

Sparsity is CSR over (head, query block): row `h * NB + qb` lists the key blocks (global block ids, ascending)
that query block qb of head h attends to. The diagonal block is masked causally by slot; key slots at or beyond
`block_valid[kb]` are never attended; query rows at or beyond `block_valid[qb]` are written as 0.

Three layers (STYLE rule 2): `_sparse_attn_fwd` (the Triton kernel), `sparse_attention` (the launcher), and
`sparse_attention_ref` (the torch twin, same signature). `check_layout` validates the CSR / layout values (it
reads them on the host, so the launcher does not call it on the hot path).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .rope import apply_rope_ref

BLOCKS = (16, 32, 64, 128)
HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634

# ROPE modes of the kernel (compile-time).
ROPE_NONE, ROPE_ON_K, ROPE_ON_Q = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


# How key blocks with delta == 0 (R(0) = identity) skip the rotation (compile-time, RoPE modes only):
# SKIP_SPLIT: the row's trailing run of delta == 0 blocks (its own segment: segments are contiguous in the block
#   layout and rows are ascending) runs in a second loop that is the pre-rotated loop itself; the first loop
#   rotates. Keeps every dot at loop level, so Triton still overlaps each P @ V wgmma with the next tile.
# SKIP_BRANCH: one loop with a runtime branch on delta around the QK^T dots. Compiled for sm_90, the dots inside
#   the branch make Triton wait on each P @ V wgmma right after issuing it (no overlap); kept for comparison.
# SKIP_NONE: rotate every tile (the previous kernel, plus the cos/sin cache).
SKIP_NONE, SKIP_SPLIT, SKIP_BRANCH = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
SKIP_MODES = {"none": SKIP_NONE.value, "split": SKIP_SPLIT.value, "branch": SKIP_BRANCH.value}


@triton.jit
def _softmax_pv(s, kb, k_first, k_valid, qb, m_i, l_i, acc, v_head, stride_vn, stride_vd, qk_scale,
                offs_m, offs_n, offs_d, BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax update of (m_i, l_i, acc) with the raw scores s [BLOCK, BLOCK_N] of one key sub-tile."""
    # Row r may see slot c of block kb iff c < k_valid, and c <= r on the diagonal block.
    lim = tl.where(kb == qb, tl.minimum(offs_m, k_valid - 1), k_valid - 1)
    s = tl.where((k_first + offs_n)[None, :] <= lim[:, None], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    # Padding slots may hold anything (NaN too): zero them, since 0 * NaN would poison the row.
    v = tl.load(v_head + (kb * BLOCK + k_first).to(tl.int64) * stride_vn + offs_d[None, :] * stride_vd,
                mask=(k_first + offs_n)[:, None] < k_valid, other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _rope_cos_sin(delta, Turns, offs_h, FAST_TRIG: tl.constexpr):
    """cos, sin [D/2] fp32 of delta * inv_freq. Angle in fp64 turns, reduced to [-1/2, 1/2) before fp32: exact
    at offsets of 200K and beyond. Turns is read here (an L1/L2 hit, once per change of delta) rather than held
    in 16 registers across the loop: that pays for the registers the cached cos/sin take."""
    t = delta.to(tl.float64) * tl.load(Turns + offs_h)
    t = t - tl.floor(t + 0.5)
    angle = t.to(tl.float32) * 6.283185307179586
    # |angle| <= pi here, where the MUFU approximations are good to ~5e-7 (accurate libdevice sin/cos cost
    # thousands of cycles per tile, measured as +60% time).
    if FAST_TRIG:
        cos = libdevice.fast_cosf(angle)
        sin = libdevice.fast_sinf(angle)
    else:  # the interpreter has no MUFU functions
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    return cos, sin


@triton.jit
def _rotated_scores(q1, q2, k1, k2, cos, sin, ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Scores of the logical q, k: q . R(delta) k, with the rotation applied to K or (by -delta) to Q."""
    if ROPE == ROPE_ON_K:
        # k' = R(delta) k (rotate_half): k1' = k1 c - k2 s, k2' = k2 c + k1 s
        k1f = k1.to(tl.float32)
        k2f = k2.to(tl.float32)
        k1r = (k1f * cos[None, :] - k2f * sin[None, :]).to(k1.dtype)
        k2r = (k2f * cos[None, :] + k1f * sin[None, :]).to(k1.dtype)
        s = tl.dot(q1, tl.trans(k1r), input_precision=DOT_PRECISION)
        s = tl.dot(q2, tl.trans(k2r), s, input_precision=DOT_PRECISION)
    else:
        # q' = R(-delta) q, same scores: q1' = q1 c + q2 s, q2' = q2 c - q1 s
        q1f = q1.to(tl.float32)
        q2f = q2.to(tl.float32)
        q1r = (q1f * cos[None, :] + q2f * sin[None, :]).to(q1.dtype)
        q2r = (q2f * cos[None, :] - q1f * sin[None, :]).to(q1.dtype)
        s = tl.dot(q1r, tl.trans(k1), input_precision=DOT_PRECISION)
        s = tl.dot(q2r, tl.trans(k2), s, input_precision=DOT_PRECISION)
    return s


@triton.jit
def _sparse_attn_fwd(
    Q, K, V, Out,                      # q [Hq, N, D]; k, v [Hkv, N, D]; out [Hq, N, D]
    Indptr, Indices,                   # int32 [Hq * NB + 1], int32 [nnz]
    BlockValid, BlockOffset,           # int32 [NB], int32 [NB]
    Turns,                             # fp64 [D/2]: inv_freq / (2 pi), rotations per position
    stride_qh, stride_qn, stride_qd,
    stride_kh, stride_kn, stride_kd,
    stride_vh, stride_vn, stride_vd,
    stride_oh, stride_on, stride_od,
    NB, qk_scale,                      # qk_scale = scale * log2(e): scores go straight into exp2
    GROUP: tl.constexpr,               # Hq // Hkv
    BLOCK: tl.constexpr,               # layout block = query rows per program
    BLOCK_N: tl.constexpr,             # key sub-tile (divides BLOCK)
    HEAD_DIM: tl.constexpr,
    ROPE: tl.constexpr,                # ROPE_NONE / ROPE_ON_K / ROPE_ON_Q
    SKIP_ZERO: tl.constexpr,           # SKIP_NONE / SKIP_SPLIT / SKIP_BRANCH (RoPE modes only)
    DOT_PRECISION: tl.constexpr,       # "ieee" for fp32 inputs, "tf32" otherwise (ignored for 16-bit)
    FAST_TRIG: tl.constexpr,           # MUFU sin/cos (GPU); False in the interpreter
):
    SPLIT: tl.constexpr = BLOCK // BLOCK_N
    HALF: tl.constexpr = HEAD_DIM // 2
    SCAN: tl.constexpr = 64            # CSR entries inspected per step of the delta == 0 suffix scan
    # Heads vary fastest, so programs of one kv group run together (K/V reuse in L2), and late query blocks,
    # which list the most key blocks (causality), are launched first to shorten the tail.
    h = tl.program_id(0)
    qb = NB - 1 - tl.program_id(1)
    kvh = h // GROUP

    row = h * NB + qb
    start = tl.load(Indptr + row)
    end = tl.load(Indptr + row + 1)
    q_valid = tl.load(BlockValid + qb)

    offs_m = tl.arange(0, BLOCK)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_h = tl.arange(0, HALF)

    q_ptr = Q + h.to(tl.int64) * stride_qh + (qb * BLOCK).to(tl.int64) * stride_qn + offs_m[:, None] * stride_qn
    k_head = K + kvh.to(tl.int64) * stride_kh + offs_n[:, None] * stride_kn
    v_head = V + kvh.to(tl.int64) * stride_vh + offs_n[:, None] * stride_vn

    m_i = tl.full([BLOCK], -1.0e30, tl.float32)  # finite: a fully masked tile gives exp2(-inf) = 0, never NaN
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)

    # Entries [start, mid) of the row go through the rotating loop, [mid, end) through the pre-rotated loop.
    mid = start
    if ROPE != ROPE_NONE:
        q1 = tl.load(q_ptr + offs_h[None, :] * stride_qd)                     # [BLOCK, D/2]
        q2 = tl.load(q_ptr + (offs_h + HALF)[None, :] * stride_qd)
        q_off = tl.load(BlockOffset + qb)
        mid = end
        if SKIP_ZERO == SKIP_SPLIT:
            # mid = start of the row's trailing run of delta == 0 entries, found SCAN entries at a time.
            go = end > start
            while go:
                jj = mid - 1 - tl.arange(0, SCAN)
                ok = jj >= start
                kbs = tl.load(Indices + jj, mask=ok, other=0)
                nonzero = ok & (tl.load(BlockOffset + kbs, mask=ok, other=0) != q_off)
                last = tl.max(tl.where(nonzero, jj, -1))                       # last nonzero-delta entry
                go = (last < 0) & (mid - SCAN > start)
                mid = tl.where(last >= 0, last + 1, tl.maximum(mid - SCAN, start))
        # cos/sin of the last delta (loop-carried): consecutive key blocks and sub-tiles of one earlier segment
        # share delta, so they are computed once per run. The initial entry is delta = 0: cos = 1, sin = 0.
        last_delta = tl.zeros([], tl.int32)
        cos = tl.full([HALF], 1.0, tl.float32)
        sin = tl.zeros([HALF], tl.float32)
        for j in range(start * SPLIT, mid * SPLIT):
            kb = tl.load(Indices + j // SPLIT)
            k_first = (j % SPLIT) * BLOCK_N                 # first slot of this sub-tile inside block kb
            k_valid = tl.load(BlockValid + kb)
            k_ptr = k_head + (kb * BLOCK + k_first).to(tl.int64) * stride_kn
            k1 = tl.load(k_ptr + offs_h[None, :] * stride_kd)                  # [BLOCK_N, D/2]
            k2 = tl.load(k_ptr + (offs_h + HALF)[None, :] * stride_kd)
            delta = tl.load(BlockOffset + kb) - q_off
            if SKIP_ZERO == SKIP_BRANCH:
                if delta == 0:
                    s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
                    s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PRECISION)
                else:
                    if delta != last_delta:
                        cos, sin = _rope_cos_sin(delta, Turns, offs_h, FAST_TRIG)
                        last_delta = delta
                    s = _rotated_scores(q1, q2, k1, k2, cos, sin, ROPE, DOT_PRECISION)
            else:
                # delta == 0 can occur here (SKIP_NONE, or a block of another segment that starts at the same
                # logical position as the query's): it is rotated like any other delta (by R(0), exact).
                if delta != last_delta:
                    cos, sin = _rope_cos_sin(delta, Turns, offs_h, FAST_TRIG)
                    last_delta = delta
                s = _rotated_scores(q1, q2, k1, k2, cos, sin, ROPE, DOT_PRECISION)
            m_i, l_i, acc = _softmax_pv(s, kb, k_first, k_valid, qb, m_i, l_i, acc, v_head, stride_vn, stride_vd,
                                        qk_scale, offs_m, offs_n, offs_d, BLOCK, DOT_PRECISION)

    # Pre-rotated loop: all of the row without RoPE, its delta == 0 suffix with SKIP_SPLIT (R(0) = identity).
    if mid < end:
        q = tl.load(q_ptr + offs_d[None, :] * stride_qd)                      # [BLOCK, D]
        for j in range(mid * SPLIT, end * SPLIT):
            kb = tl.load(Indices + j // SPLIT)
            k_first = (j % SPLIT) * BLOCK_N
            k_valid = tl.load(BlockValid + kb)
            k = tl.load(k_head + (kb * BLOCK + k_first).to(tl.int64) * stride_kn + offs_d[None, :] * stride_kd)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            m_i, l_i, acc = _softmax_pv(s, kb, k_first, k_valid, qb, m_i, l_i, acc, v_head, stride_vn, stride_vd,
                                        qk_scale, offs_m, offs_n, offs_d, BLOCK, DOT_PRECISION)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # rows that saw no key (empty CSR row) stay 0
    out = acc / l_i[:, None]
    out = tl.where((offs_m < q_valid)[:, None], out, 0.0)
    o_ptr = Out + h.to(tl.int64) * stride_oh + (qb * BLOCK).to(tl.int64) * stride_on
    tl.store(o_ptr + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od, out.to(Out.dtype.element_ty))


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of `_sparse_attn_fwd`. block_n divides the layout block; rope_on is "k" or "q"."""

    block_n: int
    num_warps: int
    num_stages: int
    rope_on: str = "k"
    # How delta == 0 tiles skip the rotation: "split" / "branch" / "none" (SKIP_*). "none" (rotate every tile,
    # cos/sin cached while delta is unchanged) measured fastest on the H200: RoPE +6..9% against +15..19% for
    # the others (bench/results/attention-h200-2026-11-29-run3.json).
    skip_zero: str = "none"


def default_config(block: int, head_dim: int) -> KernelConfig:
    """Tuned on H200 (bench/README_attention.md); the interpreter ignores warps and stages."""
    if block == 128:
        return KernelConfig(block_n=128, num_warps=8, num_stages=2, rope_on="k")
    return KernelConfig(block_n=block, num_warps=4, num_stages=2, rope_on="k")


def _validate(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, scale, block, out) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [H, N, D]; got {getattr(x, 'shape', type(x))}")
        if x.dtype not in DTYPES:
            raise ValueError(f"{name}.dtype={x.dtype} is unsupported; use one of {DTYPES}")
    hq, n, d = q.shape
    hkv = k.shape[0]
    if k.shape != v.shape or k.shape[1:] != (n, d):
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [Hkv, N={n}, D={d}] like q")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim={d} is unsupported; use one of {HEAD_DIMS}")
    if block not in BLOCKS:
        raise ValueError(f"block={block} is unsupported; use one of {BLOCKS}")
    if n % block:
        raise ValueError(f"N={n} token slots must be a whole number of blocks (block={block}); pad the layout")
    nb = n // block
    if not (isinstance(scale, (int, float)) and scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale={scale!r} must be a positive finite float (usually head_dim ** -0.5)")
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
    if out is not None and (tuple(out.shape) != (hq, n, d) or out.dtype != q.dtype):
        raise ValueError(f"out must be {q.dtype} [{hq}, {n}, {d}]; got {out.dtype} {tuple(out.shape)}")
    tensors = [q, k, v, indptr, indices, block_valid, block_offset] + ([out] if out is not None else [])
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


def sparse_attention(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, *, scale, block, out=None):
    """Block-sparse causal attention with in-kernel RoPE of key tiles (forward).

    q: [Hq, N, D]; k, v: [Hkv, N, D] (any strides; fp16 / bf16 / fp32), N = NB * block, D in {64, 128}.
    indptr: int32 [Hq * NB + 1] (row h * NB + qb); indices: int32 [nnz] key block ids, ascending per row.
    block_valid, block_offset: int32 [NB]. inv_freq: [D/2] float, or None when k is already at logical positions.
    scale: softmax scale. block: layout block in {16, 32, 64, 128}. out: optional [Hq, N, D] in q's dtype.
    Returns out [Hq, N, D] in q's dtype. Query rows beyond block_valid are 0.

    Layout values are not checked here (that needs a device sync); see `check_layout`.
    """
    return _launch(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, scale=scale, block=block,
                   out=out, config=None)


def _launch(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, *, scale, block, out, config):
    _validate(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, scale, block, out)
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"sparse_attention runs on CUDA tensors (got {q.device}); use sparse_attention_ref on CPU")
    hq, n, d = q.shape
    nb = n // block
    cfg = config or default_config(block, d)
    assert block % cfg.block_n == 0 and cfg.rope_on in ("k", "q") and cfg.skip_zero in SKIP_MODES, cfg
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if inv_freq is None:
        rope, turns = ROPE_NONE.value, torch.zeros(1, dtype=torch.float64, device=q.device)
    else:
        rope = (ROPE_ON_K if cfg.rope_on == "k" else ROPE_ON_Q).value
        turns = inv_freq.to(device=q.device, dtype=torch.float64) / (2.0 * math.pi)
    _sparse_attn_fwd[(hq, nb)](
        q, k, v, out, indptr, indices, block_valid, block_offset, turns,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        nb, float(scale) * LOG2E,
        GROUP=hq // k.shape[0], BLOCK=block, BLOCK_N=cfg.block_n, HEAD_DIM=d, ROPE=rope,
        SKIP_ZERO=SKIP_MODES[cfg.skip_zero],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FAST_TRIG=q.device.type == "cuda",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def sparse_attention_ref(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, *, scale, block, out=None):
    """Torch twin of `sparse_attention` (same signature and result); fp32 softmax, fp64 RoPE angles.

    Loops over (head, query block): meant for tests, debugging and small CPU prefill, not for speed.
    """
    _validate(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, scale, block, out)
    check_layout(indptr, indices, block_valid, block_offset, block=block)
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
