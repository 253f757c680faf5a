"""Block-sparse prefill flash attention with RoPE applied to key tiles in the kernel (SPEC sections 4, 5).

Layout (physical): the requests of a batch are packed into N = NB * block token slots; every segment (prefix,
each document, query) is padded to whole blocks, real tokens first. q and k are stored rotated at
*segment-local* positions; `block_offset[b]` is the logical position of the first token of block b's segment.
For query block qb and key block kb the score of the logical (fully rotated) q and k equals
`q . R(delta) k` with `delta = block_offset[kb] - block_offset[qb]`: one physical copy of a document's keys
serves any placement. Three ways to apply it (`KernelConfig.rope_on`):
  "pre" (default for block 128): `rotate_key_blocks` rotates the layer's keys by their blocks' offsets into a
      transient buffer (one pass over K), the kernel rotates each Q tile once by its block's offset, and the
      attention loop is the pre-rotated one (fastest on the H200: bench/README_attention.md, run 7);
  "k": each loaded K tile is rotated by delta in the loop (LazyAttention; cos/sin cached while delta holds);
  "q": the Q tile is rotated by -delta instead, only when delta changes.
The stored keys are never modified.

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

# Modes of applying RoPE (compile-time).
# ROPE_NONE: keys already at logical positions. ROPE_ON_K: each K tile is rotated by delta in registers (cos/sin
# cached while delta is unchanged). ROPE_ON_Q: the Q tile is rotated by -delta instead, only when delta changes
# (cached across the key blocks of one earlier segment), so K tiles go from memory to the tensor cores untouched.
# ROPE_PRE: a pass before the kernel (`rotate_key_blocks`) rotates each key block by its own segment offset into a
# transient buffer (keys at logical positions), the kernel rotates the Q tile once by the query block's offset,
# and the attention loop is the pre-rotated one. The stored (position-free) keys are untouched.
ROPE_NONE, ROPE_ON_K, ROPE_ON_Q, ROPE_PRE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)


@triton.jit
def _rope_cos_sin(delta, Turns, offs_h, FAST_TRIG: tl.constexpr):
    """cos, sin [D/2] fp32 of delta * inv_freq. Turns (fp64 [D/2]) is read here (an L1/L2 hit, once per change
    of delta) rather than held in registers across the loop."""
    return _cos_sin_of_turns(delta.to(tl.float64) * tl.load(Turns + offs_h), FAST_TRIG)


@triton.jit
def _cos_sin_of_turns(t, FAST_TRIG: tl.constexpr):
    """cos, sin fp32 of the angles t (fp64, in turns), reduced to [-1/2, 1/2) before fp32: exact at offsets of
    200K and beyond."""
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
def _rotate(x1, x2, cos, sin):
    """rotate_half RoPE of the halves x1, x2 [rows, D/2] by the angles (cos, sin) [D/2], in fp32."""
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    y1 = (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype)
    y2 = (x2f * cos[None, :] + x1f * sin[None, :]).to(x1.dtype)
    return y1, y2


@triton.jit
def _block_cos_sin(BlockOffset, InvFreq, b, offs_h, FAST_TRIG: tl.constexpr):
    """cos, sin [D/2] of block b's offset, the fp64 turns (inv_freq / 2 pi, as `_turns` forms them on the host)
    made here: no extra launches."""
    turns = tl.load(InvFreq + offs_h).to(tl.float64) / 6.283185307179586
    return _cos_sin_of_turns(tl.load(BlockOffset + b).to(tl.float64) * turns, FAST_TRIG)


@triton.jit
def _store_cos_sin(CosSin, b, offs_h, cos, sin, HALF: tl.constexpr):
    """Row b of the table CosSin [NB, 2 * HALF] fp32: cos | sin."""
    tl.store(CosSin + b * 2 * HALF + offs_h, cos)
    tl.store(CosSin + b * 2 * HALF + HALF + offs_h, sin)


@triton.jit
def _rotate_blocks_kernel(K, Out, BlockOffset, InvFreq, CosSin, stride_kh, stride_kn, stride_kd, stride_oh,
                          stride_on, stride_od, BLOCK: tl.constexpr, HALF: tl.constexpr, FAST_TRIG: tl.constexpr,
                          WRITE_CS: tl.constexpr):
    """Rows of block b of head h rotated by block_offset[b] (local -> logical positions). WRITE_CS: the head-0
    programs also store the angles they used, row b of the table CosSin [NB, 2 * HALF] fp32 (cos | sin)."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    rows = (b * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    offs_h = tl.arange(0, HALF)
    src = K + h.to(tl.int64) * stride_kh + rows[:, None] * stride_kn
    dst = Out + h.to(tl.int64) * stride_oh + rows[:, None] * stride_on
    x1 = tl.load(src + offs_h[None, :] * stride_kd)
    x2 = tl.load(src + (offs_h + HALF)[None, :] * stride_kd)
    cos, sin = _block_cos_sin(BlockOffset, InvFreq, b, offs_h, FAST_TRIG)
    y1, y2 = _rotate(x1, x2, cos, sin)
    tl.store(dst + offs_h[None, :] * stride_od, y1)
    tl.store(dst + (offs_h + HALF)[None, :] * stride_od, y2)
    if WRITE_CS:
        if h == 0:
            _store_cos_sin(CosSin, b, offs_h, cos, sin, HALF)


@triton.jit
def _cos_sin_kernel(BlockOffset, InvFreq, CosSin, HALF: tl.constexpr, FAST_TRIG: tl.constexpr):
    """Row b of the table CosSin [NB, 2 * HALF] fp32: cos | sin of block_offset[b] * inv_freq (as the pass)."""
    b = tl.program_id(0)
    offs_h = tl.arange(0, HALF)
    cos, sin = _block_cos_sin(BlockOffset, InvFreq, b, offs_h, FAST_TRIG)
    _store_cos_sin(CosSin, b, offs_h, cos, sin, HALF)


def rotate_key_blocks(k: torch.Tensor, block_offset: torch.Tensor, inv_freq: torch.Tensor, *, block: int,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """k [Hkv, NB * block, D] at segment-local positions -> the same keys at logical positions (every row of
    block b rotated by block_offset[b]), a new contiguous tensor (or `out`). Angles as in the attention kernel
    (fp64 turns reduced to one period, then fp32)."""
    hkv, n, d = k.shape
    if n % block or block_offset.shape != (n // block,) or inv_freq.shape != (d // 2,):
        raise ValueError(f"k {tuple(k.shape)}, block_offset {tuple(block_offset.shape)}, inv_freq "
                         f"{tuple(inv_freq.shape)} do not fit block={block}")
    if out is None:
        out = torch.empty((hkv, n, d), dtype=k.dtype, device=k.device)
    return _rotate_key_blocks(k, block_offset, inv_freq.to(k.device), block, out)


def _turns(inv_freq: torch.Tensor, device) -> torch.Tensor:
    """fp64 [D/2]: rotations per position, what the kernels form angles from."""
    return inv_freq.to(device=device, dtype=torch.float64) / (2.0 * math.pi)


def _rotate_key_blocks(k, block_offset, inv_freq, block: int, out, cos_sin=None):
    """The pass behind `rotate_key_blocks` (inv_freq: [D/2] float on k's device); cos_sin: an fp32 [NB, D]
    buffer to receive each block's angles (cos | sin, the table `cos_sin_table` makes), or None."""
    _rotate_blocks_kernel[(k.shape[0], k.shape[1] // block)](
        k, out, block_offset, inv_freq, out if cos_sin is None else cos_sin, *k.stride(), *out.stride(), BLOCK=block,
        HALF=k.shape[2] // 2, FAST_TRIG=k.device.type == "cuda", WRITE_CS=cos_sin is not None, num_warps=4)
    return out


def cos_sin_table(block_offset: torch.Tensor, inv_freq: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [NB, D]: row b = cos | sin of block_offset[b] * inv_freq ([D/2] float on block_offset's device),
    angles as the kernels form them, in `out` if given. What the Gluon kernel rotates each query tile with."""
    half = inv_freq.numel()
    if out is None:
        out = torch.empty((block_offset.numel(), 2 * half), dtype=torch.float32, device=block_offset.device)
    _cos_sin_kernel[(block_offset.numel(),)](block_offset, inv_freq, out, HALF=half,
                                             FAST_TRIG=block_offset.device.type == "cuda", num_warps=1)
    return out


@triton.jit
def _tile(j, q, q1, q2, q1r, q2r, q_ptr, q_off, qb, last_delta, cos, sin, m_i, l_i, acc,
          Indices, BlockValid, BlockOffset, Turns, k_head, v_head, stride_qd, stride_kn, stride_kd,
          stride_vn, stride_vd, qk_scale, offs_m, offs_n, offs_d, offs_h,
          BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr, ROPE: tl.constexpr,
          DIAG: tl.constexpr, Q_RELOAD: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST_TRIG: tl.constexpr):
    """One key sub-tile j (entry j // SPLIT of the CSR row, sub-tile j % SPLIT): scores, mask, online softmax
    and P @ V. DIAG: the query block's own block (causal mask by slot); otherwise only padding is masked."""
    SPLIT: tl.constexpr = BLOCK // BLOCK_N
    kb = tl.load(Indices + j // SPLIT)
    k_first = (j % SPLIT) * BLOCK_N                        # first slot of this sub-tile inside block kb
    k_valid = tl.load(BlockValid + kb)
    slot = kb * BLOCK + k_first
    k_ptr = k_head + slot.to(tl.int64) * stride_kn
    if ROPE == ROPE_NONE or ROPE == ROPE_PRE:
        k = tl.load(k_ptr + offs_d[None, :] * stride_kd)                      # [BLOCK_N, D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    else:
        k1 = tl.load(k_ptr + offs_h[None, :] * stride_kd)                     # [BLOCK_N, D/2]
        k2 = tl.load(k_ptr + (offs_h + HALF)[None, :] * stride_kd)
        delta = tl.load(BlockOffset + kb) - q_off
        if DIAG:
            # The query block's own block: delta == 0 and R(0) is the identity (q1, q2 are unrotated here).
            s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
            s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PRECISION)
        elif ROPE == ROPE_ON_K:
            # k' = R(delta) k; cos/sin recomputed only when delta changes.
            if delta != last_delta:
                cos, sin = _rope_cos_sin(delta, Turns, offs_h, FAST_TRIG)
                last_delta = delta
            k1r, k2r = _rotate(k1, k2, cos, sin)
            s = tl.dot(q1, tl.trans(k1r), input_precision=DOT_PRECISION)
            s = tl.dot(q2, tl.trans(k2r), s, input_precision=DOT_PRECISION)
        else:
            # q' = R(-delta) q gives the same scores; the rotated Q is kept while delta is unchanged.
            if delta != last_delta:
                cos, sin = _rope_cos_sin(-delta, Turns, offs_h, FAST_TRIG)
                if Q_RELOAD:  # re-read Q (L2) instead of holding the unrotated halves in registers
                    q1 = tl.load(q_ptr + offs_h[None, :] * stride_qd)
                    q2 = tl.load(q_ptr + (offs_h + HALF)[None, :] * stride_qd)
                q1r, q2r = _rotate(q1, q2, cos, sin)
                last_delta = delta
            s = tl.dot(q1r, tl.trans(k1), input_precision=DOT_PRECISION)
            s = tl.dot(q2r, tl.trans(k2), s, input_precision=DOT_PRECISION)
    cols = k_first + offs_n
    if DIAG:
        # Row r sees slot c iff c <= r (and c < k_valid): the diagonal block is the query block itself.
        lim = tl.where(kb == qb, tl.minimum(offs_m, k_valid - 1), k_valid - 1)
        s = tl.where(cols[None, :] <= lim[:, None], s, float("-inf"))
    elif k_first + BLOCK_N > k_valid:
        # Only a segment's last block is partial: its padding slots (which may hold anything) are masked.
        s = tl.where((cols < k_valid)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    # Padding slots of V may hold anything (NaN too): zero them, since 0 * NaN would poison the row.
    v = tl.load(v_head + slot.to(tl.int64) * stride_vn + offs_d[None, :] * stride_vd,
                mask=cols[:, None] < k_valid, other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return q1, q2, q1r, q2r, last_delta, cos, sin, m_new, l_i, acc


@triton.jit
def _sparse_attn_fwd(
    Q, K, V, Out,                      # q [Hq, N, D]; k, v [Hkv, N, D]; out [Hq, N, D]
    Indptr, RowEnd, Indices,           # int32 [Hq * NB + 1], int32 [Hq * NB] (row r ends there), int32 [nnz]
    BlockValid, BlockOffset,           # int32 [NB], int32 [NB]
    QTokStart,                         # int32 [NB]: Q_TOKENS: row of q / out holding block b's first slot
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
    Q_RELOAD: tl.constexpr,            # ROPE_ON_Q: re-read Q on a change of delta instead of holding it
    Q_TOKENS: tl.constexpr,            # q / out hold real tokens only (no padding rows), block b from QTokStart[b]
    PRE_VIA_OUT: tl.constexpr,         # ROPE_PRE: pass the rotated Q through the program's output rows
    DOT_PRECISION: tl.constexpr,       # "ieee" for fp32 inputs, "tf32" otherwise (ignored for 16-bit)
    FAST_TRIG: tl.constexpr,           # MUFU sin/cos (GPU); False in the interpreter
):
    SPLIT: tl.constexpr = BLOCK // BLOCK_N
    HALF: tl.constexpr = HEAD_DIM // 2
    # Heads vary fastest, so programs of one kv group run together (K/V reuse in L2), and late query blocks,
    # which list the most key blocks (causality), are launched first to shorten the tail.
    h = tl.program_id(0)
    qb = NB - 1 - tl.program_id(1)
    kvh = h // GROUP

    row = h * NB + qb
    start = tl.load(Indptr + row)
    end = tl.load(RowEnd + row)
    q_valid = tl.load(BlockValid + qb)
    # The row's diagonal entry (its last, rows ascend) gets the causal mask after the unmasked main loop.
    has_diag = end > start
    if has_diag:
        has_diag = tl.load(Indices + end - 1) == qb
    mid = tl.where(has_diag, end - 1, end)

    offs_m = tl.arange(0, BLOCK)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_h = tl.arange(0, HALF)

    if Q_TOKENS:
        # Rows past the block's valid count are clamped to its last real token (always in bounds); their
        # results are never stored.
        q_row0 = tl.load(QTokStart + qb)
        q_rows = tl.minimum(offs_m, tl.maximum(q_valid - 1, 0))
    else:
        q_row0 = qb * BLOCK
        q_rows = offs_m
    q_ptr = Q + h.to(tl.int64) * stride_qh + q_row0.to(tl.int64) * stride_qn + q_rows[:, None] * stride_qn
    k_head = K + kvh.to(tl.int64) * stride_kh + offs_n[:, None] * stride_kn
    v_head = V + kvh.to(tl.int64) * stride_vh + offs_n[:, None] * stride_vn

    m_i = tl.full([BLOCK], -1.0e30, tl.float32)  # finite: a fully masked tile gives exp2(-inf) = 0, never NaN
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)

    q_off = tl.load(BlockOffset + qb)
    if ROPE == ROPE_NONE:
        q = tl.load(q_ptr + offs_d[None, :] * stride_qd)                      # [BLOCK, D]
        q1 = q   # unused below
        q2 = q
        q1r = q
        q2r = q
    elif ROPE == ROPE_PRE:
        # Keys arrive at logical positions: rotate Q to its logical positions once (by the block's offset).
        q1 = tl.load(q_ptr + offs_h[None, :] * stride_qd)                     # [BLOCK, D/2]
        q2 = tl.load(q_ptr + (offs_h + HALF)[None, :] * stride_qd)
        cos_q, sin_q = _rope_cos_sin(q_off, Turns, offs_h, FAST_TRIG)
        q1, q2 = _rotate(q1, q2, cos_q, sin_q)
        q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), [BLOCK, HEAD_DIM])  # [q1 | q2]
        if PRE_VIA_OUT:
            # Round trip through this program's own output rows, so the rotated Q is read from memory like the
            # pre-rotated path's (a shared-memory wgmma operand) instead of staying in registers (which spills).
            o_q = Out + h.to(tl.int64) * stride_oh + q_row0.to(tl.int64) * stride_on + offs_d[None, :] * stride_od
            tl.store(o_q + offs_m[:, None] * stride_on, q.to(Out.dtype.element_ty), mask=(offs_m < q_valid)[:, None])
            tl.debug_barrier()
            q = tl.load(o_q + tl.minimum(offs_m, tl.maximum(q_valid - 1, 0))[:, None] * stride_on).to(q.dtype)
        q1 = q   # unused below
        q2 = q
        q1r = q
        q2r = q
    else:
        q = tl.zeros([1], Q.dtype.element_ty)  # unused
        q1 = tl.load(q_ptr + offs_h[None, :] * stride_qd)                     # [BLOCK, D/2]
        q2 = tl.load(q_ptr + (offs_h + HALF)[None, :] * stride_qd)
        q1r, q2r = q1, q2   # rotated by -delta for the current delta (ROPE_ON_Q): delta 0 = identity
    # cos/sin of the last delta (loop-carried). Initial delta 0: cos = 1, sin = 0.
    last_delta = tl.zeros([], tl.int32)
    cos = tl.full([HALF], 1.0, tl.float32)
    sin = tl.zeros([HALF], tl.float32)
    for j in range(start * SPLIT, mid * SPLIT):
        q1, q2, q1r, q2r, last_delta, cos, sin, m_i, l_i, acc = _tile(
            j, q, q1, q2, q1r, q2r, q_ptr, q_off, qb, last_delta, cos, sin, m_i, l_i, acc,
            Indices, BlockValid, BlockOffset, Turns, k_head, v_head, stride_qd, stride_kn, stride_kd,
            stride_vn, stride_vd, qk_scale, offs_m, offs_n, offs_d, offs_h,
            BLOCK, BLOCK_N, HALF, ROPE, False, Q_RELOAD, DOT_PRECISION, FAST_TRIG)
    for j in range(mid * SPLIT, end * SPLIT):
        q1, q2, q1r, q2r, last_delta, cos, sin, m_i, l_i, acc = _tile(
            j, q, q1, q2, q1r, q2r, q_ptr, q_off, qb, last_delta, cos, sin, m_i, l_i, acc,
            Indices, BlockValid, BlockOffset, Turns, k_head, v_head, stride_qd, stride_kn, stride_kd,
            stride_vn, stride_vd, qk_scale, offs_m, offs_n, offs_d, offs_h,
            BLOCK, BLOCK_N, HALF, ROPE, True, Q_RELOAD, DOT_PRECISION, FAST_TRIG)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # rows that saw no key (empty CSR row) stay 0
    out = acc / l_i[:, None]
    o_ptr = Out + h.to(tl.int64) * stride_oh + q_row0.to(tl.int64) * stride_on
    o_ptrs = o_ptr + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od
    if Q_TOKENS:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m < q_valid)[:, None])
    else:
        out = tl.where((offs_m < q_valid)[:, None], out, 0.0)
        tl.store(o_ptrs, out.to(Out.dtype.element_ty))


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of `_sparse_attn_fwd`. block_n divides the layout block; rope_on is "k", "q" or "pre"
    (ROPE_ON_K / ROPE_ON_Q / ROPE_PRE);
    q_reload (rope_on="q" only): re-read Q from memory on a change of delta instead of holding it."""

    block_n: int
    num_warps: int
    num_stages: int
    rope_on: str = "k"
    q_reload: bool = False
    # rope_on="pre": hand the once-rotated Q tile to the loop through the program's own output rows (memory).
    pre_via_out: bool = False
    # "triton": `_sparse_attn_fwd`; "gluon": the warp-specialised Hopper kernel (`sparse_attention_sm90`, sm_90,
    # block 128, head_dim 128, 16-bit, rope_on "pre"; num_stages = its V ring depth, the K ring has 3). Other
    # calls fall back.
    backend: str = "triton"


def default_config(block: int, head_dim: int, backend: str = "gluon") -> KernelConfig:
    """Tuned on H200 (bench/README_attention.md); the interpreter ignores warps and stages. Block 128 takes the
    Gluon Hopper kernel where it applies (`sparse_attention_sm90.supports`; the launcher falls back to
    `default_config(..., backend="triton")` elsewhere: other GPUs, head_dim 64, fp32, the interpreter)."""
    if block == 128 and backend == "gluon":
        return KernelConfig(block_n=128, num_warps=4, num_stages=2, rope_on="pre", backend="gluon")
    if block == 128:  # run 7: sparse + RoPE 0.975 / 2.761 / 8.353 ms at 16K / 32K / 64K, mask (a)
        return KernelConfig(block_n=128, num_warps=8, num_stages=2, rope_on="pre", pre_via_out=True)
    return KernelConfig(block_n=block, num_warps=4, num_stages=2, rope_on="k")


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


def sparse_attention(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, *, scale, block, out=None,
                     q_block_start=None, row_end=None):
    """Block-sparse causal attention with in-kernel RoPE of key tiles (forward).

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
    return _launch(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, scale=scale, block=block,
                   out=out, config=None, q_block_start=q_block_start, row_end=row_end)


def _launch(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, *, scale, block, out, config,
            q_block_start=None, row_end=None):
    _validate(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, scale, block, out, q_block_start,
              row_end)
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"sparse_attention runs on CUDA tensors (got {q.device}); use sparse_attention_ref on CPU")
    hq, d = q.shape[0], q.shape[2]
    nb = k.shape[1] // block
    cfg = config or default_config(block, d)
    assert block % cfg.block_n == 0 and cfg.rope_on in ("k", "q", "pre"), cfg
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    tok_start = block_valid if q_block_start is None else q_block_start  # unused without Q_TOKENS
    if cfg.backend == "gluon":
        from . import sparse_attention_sm90 as sm90
        if cfg.rope_on == "pre" and sm90.supports(q, k, v, block, out):
            cos_sin = None
            if inv_freq is not None:  # one pass over K: keys to logical positions, in a buffer laid out as v;
                # it also writes each block's cos | sin, with which the kernel rotates the query tiles (no other
                # launch: the pass forms the fp64 angles from inv_freq itself)
                inv_freq = inv_freq.to(q.device)
                cos_sin = torch.empty((nb, d), dtype=torch.float32, device=q.device)
                k = _rotate_key_blocks(k, block_offset, inv_freq, block, torch.empty_strided(
                    v.shape, v.stride(), dtype=k.dtype, device=k.device), cos_sin)
            return sm90.launch(q, k, v, out, indptr, indptr[1:] if row_end is None else row_end, indices,
                               block_valid, block_offset, tok_start, inv_freq, scale_log2=float(scale) * LOG2E,
                               rope=inv_freq is not None, q_tokens=q_block_start is not None,
                               stages=cfg.num_stages, cos_sin=cos_sin)
        cfg = default_config(block, d, backend="triton")
    if inv_freq is None:
        rope, turns = ROPE_NONE.value, torch.zeros(1, dtype=torch.float64, device=q.device)
    else:
        rope = {"k": ROPE_ON_K, "q": ROPE_ON_Q, "pre": ROPE_PRE}[cfg.rope_on].value
        turns = _turns(inv_freq, q.device)
        if cfg.rope_on == "pre":  # one pass over K: keys to logical positions, in a transient buffer
            k = _rotate_key_blocks(k, block_offset, inv_freq.to(q.device), block,
                                   torch.empty(k.shape, dtype=k.dtype, device=k.device))
    _sparse_attn_fwd[(hq, nb)](
        q, k, v, out, indptr, indptr[1:] if row_end is None else row_end, indices, block_valid, block_offset,
        tok_start, turns,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        nb, float(scale) * LOG2E,
        GROUP=hq // k.shape[0], BLOCK=block, BLOCK_N=cfg.block_n, HEAD_DIM=d, ROPE=rope,
        Q_RELOAD=cfg.q_reload, Q_TOKENS=q_block_start is not None,
        PRE_VIA_OUT=cfg.pre_via_out,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FAST_TRIG=q.device.type == "cuda",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


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
