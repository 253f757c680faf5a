"""Decode-phase attention over the position-free KV cache (SPEC section 5), flash-decoding style.

One new token per request attends to that request's KV blocks. Keys are stored rotated at segment-local
positions. Each entry j of the block table (`kv_indices[j]`, a physical block) carries `kv_offset[j]`, the
logical position, in that request, of the first token of the block's segment: the offset belongs to the entry,
not to the block, so one physical block (a cached document's page) can serve several requests, or one request
twice, at different offsets. (For a batch of `kernels/layout.py`, kv_offset = block_offset[kv_indices];
generated tokens are further blocks: a new segment whose offset is the logical position of its first token, or
the query segment's trailing padding slots, whose offset already fits.) With q rotated at its own
segment-local position and `q_offset` its segment's offset,

    score(q, key of entry j) = (R(-delta) q) . k_stored,   delta = kv_offset[j] - q_offset,

so the kernel rotates q once per change of offset along the request's block list (LazyAttention's decode
rule), never a key. (A raw, un-rotated q works too: pass its logical position as q_offset.)

GQA: one program serves all query heads of a kv head, so K/V are read once and never copied. The request's
blocks are split over `num_splits` programs, each writing a partial result and its log-sum-exp; a second kernel
merges them. Padding slots (at or beyond `block_valid[b]`) are never attended and may hold anything, NaN too.

Shapes:
    q:            [B, Hq, D]       fp16 / bf16 / fp32, D / 2 a power of two >= 16
    k_cache:      [Hkv, N, D]      N = NB * block physical slots, any strides, q's dtype (v_cache the same)
    q_offset:     int32 [B]
    kv_indptr:    int32 [B + 1]    request b's blocks are kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
    kv_indices:   int32 [nnz]      physical block ids (logical order keeps rotations to one per segment)
    block_valid:  int32 [NB]       real slots of each physical block (a property of the block's KV)
    kv_offset:    int32 [nnz]      logical position of the first token of entry j's segment, in its request
    inv_freq:     float [D/2] (RoPE, rotate_half convention), or None when keys are stored at logical positions
    out:          [B, Hq, D] in q's dtype
    parallel:     optional int32 [nnz], with ape: nonzero where entry j is a block of parallel-encoded context (a
                  document read from the KV store)
    ape:          optional fp32 [B, 2]: each row's (temperature, scale) of kernels/ape.py's rescaling of its
                  attention to those entries; (1, 1) leaves a row's attention plain
"""
from __future__ import annotations


from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sift.format import TILES

from .device import sm_count, triton_runs_on
from .layout import BatchLayout
from .ape import ape_probs
from .numerics import LOG2E, check_heads_and_blocks, check_scale
from .rope import _cos_sin, apply_rope_ref

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCKS = TILES


class DecodeConfig(NamedTuple):
    """The split kernel's schedule: block_n key slots per step (capped at the block size), Triton's num_warps
    and num_stages. Every schedule computes the same attention."""
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 3


def default_config(batch: int, head_dim: int = 128) -> DecodeConfig:
    """Measured on the H200 (bf16, 32 query / 8 KV heads, D=128, 16K-32K tokens per row, `bench_decode.py
    --parts sweep`): 32 key slots per step, 4 warps, for one or two rows (each program holds a few blocks, and the
    smaller tile starts its loads sooner); 64 slots, 8 warps for more rows. Five stages for both: the
    pipeliner then keeps two steps of keys and values in flight where two to four stages keep one (the block
    id is loaded a stage before the keys it locates), which the latency of the loads needs: 29.7 against 32.2 us
    at 16K, batch 1; 136.0 against 150.3 us at 16K, batch 8 (64 slots, 4 warps, 3 stages), 253.5 against 281.9
    at 32K, the KV's floor at the copy bandwidth being 254.2. Wider heads keep three stages: five would double
    the shared memory (139 KiB at D=256, 64 slots), past what smaller GPUs give one block."""
    stages = 5 if head_dim <= 128 else 3
    return DecodeConfig(32, 4, stages) if batch <= 2 else DecodeConfig(64, 8, stages)


@triton.jit
def _decode_split_kernel(
    Q, K, V,  # q [B, Hq, D]; k, v [Hkv, N, D]
    Out,  # [B, Hq, D] when DIRECT, else unused
    PartO, PartLse,  # fp32 [B, Hq, P * S, D], fp32 [B, Hq, P * S] (log2 domain) when not DIRECT; P parts: 1, or
                     # 2 with APE (the other keys' partials, then the parallel keys')
    QOffset, KvIndptr, KvIndices, BlockValid, KvOffset,
    InvFreq,  # [D/2] float: the RoPE inverse frequencies (unused without ROPE)
    KvParallel, Ape,  # APE: int32 [nnz] entry flags, fp32 [B, 2] each row's (temperature, scale)
    stride_qb, stride_qh, stride_qd,
    stride_kh, stride_kn, stride_kd,
    stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_od,
    HQ, S, qk_scale,  # qk_scale = scale * log2(e)
    GROUP: tl.constexpr,  # Hq // Hkv
    G_PAD: tl.constexpr,  # GROUP rounded up to a power of two >= 16 (tl.dot's minimum M)
    BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,  # key slots per step, divides BLOCK (bounds the registers of the K / V tiles)
    HEAD_DIM: tl.constexpr,
    ROPE: tl.constexpr,
    DIRECT: tl.constexpr,  # S == 1: normalise and write Out, no partials
    DOT_PRECISION: tl.constexpr,
    APE: tl.constexpr,  # two online softmaxes: the parallel entries' (at temperature T) and the others'
    FAST_TRIG: tl.constexpr,  # MUFU sin / cos (CUDA; the interpreter has none)
):
    HALF: tl.constexpr = HEAD_DIM // 2
    SUB: tl.constexpr = BLOCK // BLOCK_N
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    first = tl.load(KvIndptr + b)
    n_blocks = tl.load(KvIndptr + b + 1) - first
    # Blocks spread evenly: every split gets floor or ceil of n_blocks / S (equal chunks of ceil(n / S) would
    # leave the last splits idle, e.g. 261 blocks in 64 splits of 5: 53 busy).
    j0 = first + split * n_blocks // S
    j1 = first + (split + 1) * n_blocks // S

    offs_g = tl.arange(0, G_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF)
    heads = kvh * GROUP + offs_g
    g_ok = offs_g < GROUP
    q_ptr = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q1_ptr = q_ptr + offs_h[None, :] * stride_qd
    q2_ptr = q_ptr + (offs_h + HALF)[None, :] * stride_qd
    k_head = K + kvh.to(tl.int64) * stride_kh + offs_n[:, None] * stride_kn
    v_head = V + kvh.to(tl.int64) * stride_vh + offs_n[:, None] * stride_vn
    q_off = tl.load(QOffset + b)
    # q of the current segment, in K's dtype. With RoPE it is rebuilt (`_rotated_q`) whenever the block's offset
    # changes; the first block always does (offsets are >= 0).
    q1r = tl.load(q1_ptr, mask=g_ok[:, None], other=0.0).to(K.dtype.element_ty)  # [G_PAD, D/2]
    q2r = tl.load(q2_ptr, mask=g_ok[:, None], other=0.0).to(K.dtype.element_ty)
    cur_off = q_off * 0 - 1

    m_i = tl.full([G_PAD], -1.0e30, tl.float32)  # finite: a fully masked block gives exp2(-inf) = 0, never NaN
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
    m_p = tl.full([G_PAD], -1.0e30, tl.float32)  # APE: the parallel entries' state
    l_p = tl.zeros([G_PAD], tl.float32)
    acc_p = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
    inv_t = 1.0
    if APE:
        inv_t = 1.0 / tl.load(Ape + b * 2)
    for j in range(j0 * SUB, j1 * SUB):
        kb = tl.load(KvIndices + j // SUB)
        k_first = (j % SUB) * BLOCK_N  # first slot of this step inside block kb
        if ROPE:
            off = tl.load(KvOffset + j // SUB)
            if off != cur_off:
                q1r, q2r = _rotated_q(q1_ptr, q2_ptr, g_ok, off - q_off, InvFreq, offs_g, offs_h,
                                      K.dtype.element_ty, FAST_TRIG)
                cur_off = off
        par = 0
        if APE:
            par = tl.load(KvParallel + j // SUB)
        first_slot = (kb * BLOCK + k_first).to(tl.int64)
        m_i, l_i, acc, m_p, l_p, acc_p = _step(
            q1r, q2r, k_head + first_slot * stride_kn, v_head + first_slot * stride_vn,
            offs_n < tl.load(BlockValid + kb) - k_first, par, inv_t, qk_scale, m_i, l_i, acc, m_p, l_p, acc_p,
            stride_kd, stride_vd, HEAD_DIM, DOT_PRECISION, APE)

    offs_d = tl.arange(0, HEAD_DIM)
    safe_l = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / safe_l[:, None]
    if APE and DIRECT:
        # the two parts combined by their log2-masses: the parallel part's scaled by S * T
        st = tl.load(Ape + b * 2) * tl.load(Ape + b * 2 + 1)
        lse_o = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(safe_l))
        safe_p = tl.where(l_p == 0.0, 1.0, l_p)
        lse_p = tl.where(l_p == 0.0, float("-inf"), st * (m_p + tl.log2(safe_p)))
        top = tl.maximum(tl.maximum(lse_o, lse_p), -1.0e30)
        w_o, w_p = tl.math.exp2(lse_o - top), tl.math.exp2(lse_p - top)
        total = tl.where(w_o + w_p == 0.0, 1.0, w_o + w_p)
        o = (o * w_o[:, None] + (acc_p / safe_p[:, None]) * w_p[:, None]) / total[:, None]
    if DIRECT:
        o_ptr = Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptr, o.to(Out.dtype.element_ty), mask=g_ok[:, None])
    else:
        # lse (log2) of an empty split is -inf: the merge gives it weight 0.
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(safe_l))
        parts = 2 if APE else 1
        row = (b * HQ + heads) * (parts * S) + split  # [G_PAD]
        tl.store(PartLse + row, lse, mask=g_ok)
        tl.store(PartO + row.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], o, mask=g_ok[:, None])
        if APE:     # the parallel part's partials, S rows further (its lse at temperature T, not yet scaled)
            safe_p = tl.where(l_p == 0.0, 1.0, l_p)
            tl.store(PartLse + row + S, tl.where(l_p == 0.0, float("-inf"), m_p + tl.log2(safe_p)), mask=g_ok)
            tl.store(PartO + (row + S).to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], acc_p / safe_p[:, None],
                     mask=g_ok[:, None])


@triton.jit
def _rotated_q(q1_ptr, q2_ptr, g_ok, delta, InvFreq, offs_g, offs_h, dtype: tl.constexpr, FAST_TRIG: tl.constexpr):
    """q' = R(-delta) q: q1' = q1 c + q2 s, q2' = q2 c - q1 s (angles as every kernel forms them,
    `rope._cos_sin`: fp64 turns reduced to [-pi, pi] before fp32, so the MUFU sin / cos are as good as the
    accurate ones there; every program rotates q at its first block, so the rotation's latency is paid once
    per launch, on the critical path). Angles are formed on
    the whole [G_PAD, D/2] tile (each thread only its own elements) rather than on a [D/2] vector that every
    thread would hold whole: fewer registers at the peak. q is re-read from memory rather than held: it would
    cost registers in every iteration for a rare use."""
    cos, sin = _cos_sin(delta, InvFreq, offs_h[None, :] + 0 * offs_g[:, None], FAST_TRIG)
    q1 = tl.load(q1_ptr, mask=g_ok[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(q2_ptr, mask=g_ok[:, None], other=0.0).to(tl.float32)
    return (q1 * cos + q2 * sin).to(dtype), (q2 * cos - q1 * sin).to(dtype)


@triton.jit
def _step(q1r, q2r, k_ptr, v_ptr, slot_ok, par, inv_t, qk_scale, m_i, l_i, acc, m_p, l_p, acc_p,
          stride_kd, stride_vd, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, APE: tl.constexpr):
    """BLOCK_N key slots (k_ptr, v_ptr: [BLOCK_N, 1] pointers to their first elements; slot_ok: the real ones)
    folded into the online softmax: the parallel entries' state (m_p, l_p, acc_p) when APE and par, else the
    others' (m_i, l_i, acc)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_h = tl.arange(0, HALF)
    offs_d = tl.arange(0, HEAD_DIM)
    k1 = tl.load(k_ptr + offs_h[None, :] * stride_kd, mask=slot_ok[:, None], other=0.0)  # [BLOCK_N, D/2]
    k2 = tl.load(k_ptr + (offs_h + HALF)[None, :] * stride_kd, mask=slot_ok[:, None], other=0.0)
    v = tl.load(v_ptr + offs_d[None, :] * stride_vd, mask=slot_ok[:, None], other=0.0)
    s = tl.dot(q1r, tl.trans(k1), input_precision=DOT_PRECISION)
    s = tl.dot(q2r, tl.trans(k2), s, input_precision=DOT_PRECISION)  # [G_PAD, BLOCK_N]
    if APE:
        if par != 0:
            s = tl.where(slot_ok[None, :], s * (qk_scale * inv_t), float("-inf"))
            m_p, l_p, acc_p = _online_update(s, v, m_p, l_p, acc_p, DOT_PRECISION)
        else:
            s = tl.where(slot_ok[None, :], s * qk_scale, float("-inf"))
            m_i, l_i, acc = _online_update(s, v, m_i, l_i, acc, DOT_PRECISION)
    else:
        s = tl.where(slot_ok[None, :], s * qk_scale, float("-inf"))
        m_i, l_i, acc = _online_update(s, v, m_i, l_i, acc, DOT_PRECISION)
    return m_i, l_i, acc, m_p, l_p, acc_p


@triton.jit
def _online_update(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """One step of the online softmax: scores s [G_PAD, BLOCK_N] (log2 domain, masked at -inf), values v."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _merge_part(PartO, PartLse, first, S, S_CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows first .. first + S - 1 of the partials combined -> (log2-sum-exp, normalised output [HEAD_DIM])."""
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.full([], -1.0e30, tl.float32)   # finite: all-empty splits (lse -inf) give weights exp2(-inf) = 0
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s0 in range(0, S, S_CHUNK):
        offs_s = s0 + tl.arange(0, S_CHUNK)
        row = first + offs_s
        lse = tl.load(PartLse + row, mask=offs_s < S, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        w = tl.math.exp2(lse - m_new)  # [S_CHUNK]
        o = tl.load(PartO + row.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], mask=(offs_s < S)[:, None],
                    other=0.0)
        rescale = tl.math.exp2(m - m_new)
        acc = acc * rescale + tl.sum(w[:, None] * o, 0)
        total = total * rescale + tl.sum(w, 0)
        m = m_new
    lse_all = tl.where(total == 0.0, float("-inf"), m + tl.log2(tl.where(total == 0.0, 1.0, total)))
    return lse_all, acc / tl.where(total == 0.0, 1.0, total)


@triton.jit
def _decode_merge_kernel(
    PartO, PartLse, Out, Ape,
    stride_ob, stride_oh, stride_od,
    HQ, S,
    S_CHUNK: tl.constexpr,  # partials per step (up to 128: one step at the default split counts); registers
                            # stay bounded however many splits there are
    HEAD_DIM: tl.constexpr,
    APE: tl.constexpr,      # two parts per (b, h): the other keys' partials, then the parallel keys' (scaled S * T)
):
    """Out[b, h] = the split partials of (b, h) combined by their log-sum-exps, S_CHUNK at a time (online)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    if APE:
        lse_o, o_o = _merge_part(PartO, PartLse, (b * HQ + h) * 2 * S, S, S_CHUNK, HEAD_DIM)
        lse_p, o_p = _merge_part(PartO, PartLse, (b * HQ + h) * 2 * S + S, S, S_CHUNK, HEAD_DIM)
        lse_p = lse_p * (tl.load(Ape + b * 2) * tl.load(Ape + b * 2 + 1))
        top = tl.maximum(tl.maximum(lse_o, lse_p), -1.0e30)
        w_o, w_p = tl.math.exp2(lse_o - top), tl.math.exp2(lse_p - top)
        out = (o_o * w_o + o_p * w_p) / tl.where(w_o + w_p == 0.0, 1.0, w_o + w_p)
    else:
        _, out = _merge_part(PartO, PartLse, (b * HQ + h) * S, S, S_CHUNK, HEAD_DIM)
    tl.store(Out + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d * stride_od, out.to(Out.dtype.element_ty))


def _validate(q, k_cache, v_cache, q_offset, kv_indptr, kv_indices, block_valid, kv_offset, inv_freq, scale,
              block, out, parallel=None, ape=None) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D]; got {getattr(q, 'shape', type(q))}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be [Hkv, N, D]; got {getattr(x, 'shape', type(x))}")
    if q.dtype not in DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache, v_cache must share one dtype of {DTYPES}; got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    bsz, hq, d = q.shape
    hkv, n = k_cache.shape[:2]
    if k_cache.shape != v_cache.shape or k_cache.shape[2] != d:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be [Hkv, N, D={d}]")
    half = d // 2
    if d % 2 or half < 16 or half & (half - 1):
        raise ValueError(f"head_dim={d} is unsupported: D / 2 must be a power of two >= 16 (32, 64, 128, 256)")
    nb = check_heads_and_blocks(hq, hkv, n, block)
    check_scale(scale)
    for name, x, shape in (("q_offset", q_offset, (bsz,)), ("kv_indptr", kv_indptr, (bsz + 1,)),
                           ("block_valid", block_valid, (nb,))):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.int32 or tuple(x.shape) != shape:
            raise ValueError(f"{name} must be int32 {list(shape)} (B={bsz}, NB={nb}); got "
                             f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    if not isinstance(kv_indices, torch.Tensor) or kv_indices.dtype != torch.int32 or kv_indices.dim() != 1:
        raise ValueError(f"kv_indices must be a 1-D int32 tensor; got {getattr(kv_indices, 'dtype', type(kv_indices))}")
    if not isinstance(kv_offset, torch.Tensor) or kv_offset.dtype != torch.int32 or kv_offset.shape != kv_indices.shape:
        raise ValueError(f"kv_offset must be int32 [nnz={kv_indices.numel()}], one offset per kv_indices entry; got "
                         f"{getattr(kv_offset, 'dtype', type(kv_offset))} {tuple(getattr(kv_offset, 'shape', ()))}")
    if inv_freq is not None and (not isinstance(inv_freq, torch.Tensor) or tuple(inv_freq.shape) != (half,)
                                 or not inv_freq.is_floating_point()):
        raise ValueError(f"inv_freq must be None or a float tensor [D/2]={half}; got "
                         f"{tuple(getattr(inv_freq, 'shape', ()))}")
    if out is not None and (tuple(out.shape) != (bsz, hq, d) or out.dtype != q.dtype):
        raise ValueError(f"out must be {q.dtype} [{bsz}, {hq}, {d}]; got {out.dtype} {tuple(out.shape)}")
    if (parallel is None) != (ape is None):
        raise ValueError("give parallel= and ape= together (the context entries and each row's (temperature, "
                         "scale)), or neither")
    if parallel is not None:
        if not isinstance(parallel, torch.Tensor) or parallel.dtype != torch.int32 or parallel.shape != kv_indices.shape:
            raise ValueError(f"parallel must be int32 [nnz={kv_indices.numel()}], one flag per kv_indices entry; "
                             f"got {getattr(parallel, 'dtype', type(parallel))} {tuple(getattr(parallel, 'shape', ()))}")
        if not isinstance(ape, torch.Tensor) or ape.dtype != torch.float32 or tuple(ape.shape) != (bsz, 2):
            raise ValueError(f"ape must be fp32 [B={bsz}, 2], each row's (temperature, scale); got "
                             f"{getattr(ape, 'dtype', type(ape))} {tuple(getattr(ape, 'shape', ()))}")
    tensors = [q, k_cache, v_cache, q_offset, kv_indptr, kv_indices, block_valid, kv_offset] + [
        x for x in (parallel, ape) if x is not None]
    devices = {x.device for x in tensors + ([out] if out is not None else [])}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")


def default_num_splits(batch: int, kv_heads: int, nnz_blocks: int, device: torch.device) -> int:
    """Programs per (row, kv head) along its block list (flash-decoding), from host-known sizes only (no device
    sync), never more than a row's average block count. Measured on the H200 (`bench_decode.py --parts sweep`,
    32 query / 8 KV heads, 2K-32K tokens per row, each batch with its `default_config`): about four programs
    per SM for one or two rows (B=1: 66 splits 1.2x faster than 33 and 1.1x faster than 132), about two for
    three rows or more (B=8: 4 splits 1.14x faster than 9); rounded down, since a launch a few programs over a
    whole number of waves pays a nearly empty wave."""
    per_sm = 4 if batch <= 2 else 2
    target = per_sm * sm_count(device) if device.type == "cuda" else 4
    splits = target // max(batch * kv_heads, 1)
    return max(1, min(splits, nnz_blocks // max(batch, 1), 256))


def decode_attention(q, k_cache, v_cache, q_offset, kv_indptr, kv_indices, block_valid, kv_offset, inv_freq,
                     *, scale, block, num_splits=None, out=None, parallel=None, ape=None, config=None):
    """Attention of one new token per request over its KV blocks, with q rotated per segment in the kernel.
    Shapes in the module docstring. num_splits: programs per (request, kv head) along the block list (default
    `default_num_splits`). Returns out [B, Hq, D] in q's dtype. Block ids are not range-checked (no sync).
    parallel / ape: the APE option (module docstring); without it the kernels are the plain ones.
    config: a `DecodeConfig` (default `default_config(B, D)`); every config computes the same attention."""
    _validate(q, k_cache, v_cache, q_offset, kv_indptr, kv_indices, block_valid, kv_offset, inv_freq, scale,
              block, out, parallel, ape)
    config = config or default_config(q.shape[0], q.shape[2])
    block_n = min(block, config.block_n)
    if block_n < 16 or block_n & (block_n - 1) or block % block_n:
        raise ValueError(f"config.block_n={config.block_n} must be a power of two >= 16 dividing block={block}")
    if not triton_runs_on(q.device):
        raise ValueError(f"decode_attention runs on CUDA tensors (got {q.device}); use decode_attention_ref on CPU")
    bsz, hq, d = q.shape
    hkv = k_cache.shape[0]
    group = hq // hkv
    splits = num_splits or default_num_splits(bsz, hkv, kv_indices.numel(), q.device)
    if splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    if out is None:
        out = torch.empty((bsz, hq, d), dtype=q.dtype, device=q.device)
    # The kernel forms the fp64 turns (inv_freq / 2 pi) itself: no launches besides the split and merge kernels.
    rope = inv_freq is not None
    freq = inv_freq.to(q.device) if rope else q_offset   # any pointer when unused
    direct = splits == 1
    if direct:
        part_o = part_lse = out  # unused
    else:
        parts = 1 if ape is None else 2
        part_o = torch.empty((bsz, hq, parts * splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((bsz, hq, parts * splits), dtype=torch.float32, device=q.device)
    flags = kv_indices if parallel is None else parallel   # any pointer when unused
    rows = q_offset if ape is None else ape
    _decode_split_kernel[(bsz, hkv, splits)](
        q, k_cache, v_cache, out, part_o, part_lse,
        q_offset, kv_indptr, kv_indices, block_valid, kv_offset, freq, flags, rows,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        hq, splits, float(scale) * LOG2E,
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), BLOCK=block, BLOCK_N=block_n,
        HEAD_DIM=d, ROPE=rope, DIRECT=direct,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", APE=ape is not None,
        FAST_TRIG=q.device.type == "cuda", num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if not direct:
        _decode_merge_kernel[(bsz, hq)](
            part_o, part_lse, out, rows, *out.stride(), hq, splits,
            S_CHUNK=min(triton.next_power_of_2(splits), 128), HEAD_DIM=d, APE=ape is not None, num_warps=4,
        )
    return out


def decode_attention_ref(q, k_cache, v_cache, q_offset, kv_indptr, kv_indices, block_valid, kv_offset, inv_freq,
                         *, scale, block, num_splits=None, out=None, parallel=None, ape=None, config=None):
    """The ref twin of `decode_attention` (same signature and result; num_splits and config are accepted and
    ignored).
    fp32 softmax, fp64 RoPE angles; one rotation of q per distinct segment offset of the request."""
    _validate(q, k_cache, v_cache, q_offset, kv_indptr, kv_indices, block_valid, kv_offset, inv_freq, scale,
              block, out, parallel, ape)
    flags = None if parallel is None else parallel.tolist()
    bsz, hq, d = q.shape
    group = hq // k_cache.shape[0]
    ptr, idx = kv_indptr.tolist(), kv_indices.tolist()
    valid, offset, q_off = block_valid.tolist(), kv_offset.tolist(), q_offset.tolist()
    result = torch.zeros((bsz, hq, d), dtype=torch.float32, device=q.device)
    for b in range(bsz):
        entries = range(ptr[b], ptr[b + 1])
        slots = torch.tensor([idx[j] * block + s for j in entries for s in range(valid[idx[j]])], dtype=torch.long,
                             device=q.device)
        if slots.numel() == 0:
            continue
        key_off = torch.tensor([offset[j] for j in entries for _ in range(valid[idx[j]])], device=q.device)
        k = k_cache[:, slots].float().repeat_interleave(group, dim=0)  # [Hq, n, D]
        v = v_cache[:, slots].float().repeat_interleave(group, dim=0)
        scores = torch.empty((hq, slots.numel()), dtype=torch.float32, device=q.device)
        for off in torch.unique(key_off).tolist():
            sel = key_off == off
            qr = q[b].float()[:, None, :]  # [Hq, 1, D]
            if inv_freq is not None:
                minus_delta = torch.tensor([q_off[b] - off], device=q.device)
                qr = apply_rope_ref(qr, minus_delta, inv_freq.float())
            scores[:, sel] = (qr @ k[:, sel].transpose(1, 2))[:, 0] * scale
        if flags is None:
            p = torch.softmax(scores, dim=-1)
        else:
            par = torch.tensor([bool(flags[j]) for j in entries for _ in range(valid[idx[j]])], device=q.device)
            p = ape_probs(scores, par, *ape[b].tolist())
        result[b] = (p[:, None, :] @ v)[:, 0]
    result = result.to(q.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def layout_kv_table(layout: BatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """KV block table of a prefilled batch: request b's blocks in prompt order. -> kv_indptr int32 [B + 1],
    kv_indices int32 [NB] (the runtime appends generated tokens' blocks to each request's list). The entries'
    offsets (`decode_attention`'s kv_offset) are then layout.block_offset[kv_indices]."""
    indptr = torch.zeros(layout.n_requests + 1, dtype=torch.int32, device=layout.device)
    torch.cumsum(layout.req_n_blocks, 0, dtype=torch.int32, out=indptr[1:])
    return indptr, torch.arange(layout.n_blocks, dtype=torch.int32, device=layout.device)
