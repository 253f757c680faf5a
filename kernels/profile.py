"""Triton kernel of SIFT profiling (SPEC section 2): one layer's q/k -> LA/CA statistics -> packed bits.

The reference twin is `profile_ref.profile_layer_ref`; both share `validate_profile_args`, and `_bits_kernel`
is the one-launch twin of the reference's `finish_bits` (tested equal to it bit for bit), so the passes only
have to produce the two statistics `finish_bits` reads. Two flash-style passes, never an L x L matrix:

1. `_lse_kernel`, per (query head, block of BLOCK_M document rows): the row log-sum-exp over the row's
   causal keys (profiling prefix included), online, in log2 units -> lse2 [Hq, L]. Prefix rows are skipped:
   no statistic needs them. Skipped entirely when the caller passes the forward pass's `lse`.
2. `_stats_kernel`, per (query head, block of BLOCK_N document keys): the key block stays on chip while the
   document query blocks at or below it stream past. Per cell x = log2 A = s * log2(e) - lse2, so
   * LA: max of x over each (query tile, key tile), stored once as exp2 -> tile_max [Hq, P, P] fp32;
   * CA: cells with x >= log2(beta) are counted in int32 registers and reduced and stored once per program
     -> key_counts [Hq, L] int32. Each program owns its keys: no atomics, and the result is deterministic.
   Comparing log2 A with log2(beta) instead of A with beta saves the exp2 of every cell (the pass is then
   bound by its one QK^T product); the two orders differ only for a probability within float rounding of
   beta, which is also where exp2 and the reference's softmax may disagree.
3. `_bits_kernel`, per (head, block of output bytes): `finish_bits` (alpha / gamma thresholds, diagonal, sink
   page, dense heads, MSB-first packing) straight into the layer's uint8 outputs; one launch instead of ~20
   small torch ops, which dominated short (RAG-sized) documents.

Memory: lse2 and key_counts are O(Hq * L); tile_max is O(Hq * P^2) (4 bytes per tile), so `profile_layer`
runs pass 2 and the bits kernel over chunks of heads whose tile maxima fit `stats_bytes`.

GQA: query head h reads key head h // (Hq // Hkv) in place; K is never expanded. q / k may have any strides
(e.g. views of [L, H, D]). fp32 inputs use IEEE dot products so the bits match the CPU reference; fp16 /
bf16 products are exact in the fp32 accumulator, so they match the reference run on the upcast inputs.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from sift.format import ca_nbytes, la_nbytes, n_pages

from .numerics import LOG2E
from .profile_ref import LayerBits, validate_profile_args

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _log2_scores(qk, qk_mul, cap_mul, SOFTCAP: tl.constexpr):
    """Raw q.k -> the model's score in log2 units.

    Plain: qk * (scale * log2 e). Soft-capped: cap * log2 e * tanh(qk * scale / cap), with qk_mul = scale / cap
    and cap_mul = cap * log2 e; tanh from exp2 (libdevice is not available in the interpreter).
    """
    if SOFTCAP:
        y = qk * qk_mul
        e = tl.exp2(tl.abs(y) * -2.8853900817779268)  # exp(-2|y|)
        t = (1.0 - e) / (1.0 + e)
        return tl.where(y < 0, -t, t) * cap_mul
    else:
        return qk * qk_mul


@triton.jit
def _lse_kernel(
    Q, K, LSE2,
    stride_qh, stride_ql, stride_qd, stride_kh, stride_kl, stride_kd, stride_lh,
    n_prefix, n_doc, qk_mul, cap_mul,
    GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """LSE2[h, m] = log2 sum_{n <= n_prefix + m} exp2(s2[n_prefix + m, n]) for document rows m < n_doc."""
    h = tl.program_id(0)
    # The last row blocks have the most keys: launch them first.
    m0 = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    row0 = n_prefix + m0  # absolute position of the block's first row
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    d_ok = rd < HEAD_DIM
    row_ok = m0 + rm < n_doc

    q_ptrs = Q + h.to(tl.int64) * stride_qh + row0.to(tl.int64) * stride_ql \
        + (rm[:, None] * stride_ql + rd[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    kt_ptrs = K + (h // GROUPS).to(tl.int64) * stride_kh + (rd[:, None] * stride_kd + rn[None, :] * stride_kl)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    n_full = (row0 // BLOCK_N) * BLOCK_N  # keys [0, n_full) are causal for every row of the block
    n_end = tl.minimum(row0 + BLOCK_M, n_prefix + n_doc)
    for _ in range(0, n_full, BLOCK_N):
        kt = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
        s = _log2_scores(tl.dot(q, kt, input_precision=DOT_PRECISION), qk_mul, cap_mul, SOFTCAP)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_i = m_new
        kt_ptrs += BLOCK_N * stride_kl
    for n0 in range(n_full, n_end, BLOCK_N):
        kt = tl.load(kt_ptrs, mask=d_ok[:, None] & (n0 + rn < n_end)[None, :], other=0.0)
        s = _log2_scores(tl.dot(q, kt, input_precision=DOT_PRECISION), qk_mul, cap_mul, SOFTCAP)
        s = tl.where((n0 + rn)[None, :] <= (row0 + rm)[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_i = m_new
        kt_ptrs += BLOCK_N * stride_kl
    tl.store(LSE2 + h.to(tl.int64) * stride_lh + m0 + rm, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def _tile_max(x, ROWS: tl.constexpr, COLS: tl.constexpr, TILE: tl.constexpr):
    """x: [ROWS, COLS] -> [ROWS / TILE, COLS / TILE] maxima of its TILE x TILE tiles."""
    RT: tl.constexpr = ROWS // TILE
    CT: tl.constexpr = COLS // TILE
    if CT == 1:
        # One column tile: a row reduction (within warps), then a small one over a [ROWS] vector.
        r = tl.max(x, 1)
        return tl.max(tl.reshape(r, [RT, TILE]), 1)[:, None]
    else:
        r = tl.max(tl.reshape(x, [ROWS, CT, TILE]), 2)
        return tl.max(tl.reshape(r, [RT, TILE, CT]), 1)


@triton.jit
def _stats_block(
    acc, q_op, k_op, Q_LSE, TMAX, m0, n0, offs_n, rm,
    stride_ti, n_doc, n_pages, qk_mul, cap_mul, log2_beta, lse_mul,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE: tl.constexpr, KEY_ROWS: tl.constexpr,
    CAUSAL_MASK: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, COUNT: tl.constexpr,
):
    """One query block against the program's key block: add to the per-key counts, store its tiles' maxima.

    Per cell y = log2 A - log2 beta = s2 - (lse2 + log2 beta), one FMA from the raw q.k: counted iff y >= 0,
    i.e. iff its sign bit is clear, so acc adds the sign bit shifted down (-1 per cell below beta, and per
    masked or padded cell, which are -inf); the caller turns it into counts. The tile maxima of log2 A are
    those of y plus log2 beta (one constant for all cells). COUNT False (beta = 0: every causal cell counts,
    closed form in the caller) leaves log2 beta out (it is 0 there).

    KEY_ROWS: the scores are laid out [keys, queries] (k_op = k [BLOCK_N, D] is the stationary left operand,
    q_op = q^T [D, BLOCK_M] streams in as the right one, like a flash forward) and acc [BLOCK_N] holds the
    per-key sums (a row sum: within warps); else [queries, keys] (q_op = q [BLOCK_M, D], k_op = k^T
    [D, BLOCK_N]) and acc [BLOCK_M, BLOCK_N] sums elementwise (a per-block column sum would cross warps),
    reduced once at the end.
    """
    offs_m = m0 + rm
    row_ok = offs_m < n_doc
    # Rows past the document get lse2 = +inf, so y = -inf: below beta, never a maximum.
    lse2 = tl.load(Q_LSE + offs_m, mask=row_ok, other=float("inf")) * lse_mul
    shift = lse2 + log2_beta if COUNT else lse2
    ti = m0 // TILE + tl.arange(0, BLOCK_M // TILE)
    tj = n0 // TILE + tl.arange(0, BLOCK_N // TILE)
    if KEY_ROWS:
        qk = tl.dot(k_op, q_op, input_precision=DOT_PRECISION)
        if SOFTCAP:
            y = _log2_scores(qk, qk_mul, cap_mul, SOFTCAP) - shift[None, :]
        else:
            y = qk * qk_mul - shift[None, :]
        if CAUSAL_MASK:
            y = tl.where(offs_n[:, None] <= offs_m[None, :], y, float("-inf"))
        if COUNT:
            acc += tl.sum(y.to(tl.int32, bitcast=True) >> 31, 1)
        ymax = _tile_max(y, BLOCK_N, BLOCK_M, TILE)  # [key tiles, query tiles]
        tmax_ptrs = TMAX + tj[:, None] + ti[None, :] * stride_ti
        tmax_mask = (tj < n_pages)[:, None] & (ti < n_pages)[None, :]
    else:
        qk = tl.dot(q_op, k_op, input_precision=DOT_PRECISION)
        if SOFTCAP:
            y = _log2_scores(qk, qk_mul, cap_mul, SOFTCAP) - shift[:, None]
        else:
            y = qk * qk_mul - shift[:, None]
        if CAUSAL_MASK:
            y = tl.where(offs_n[None, :] <= offs_m[:, None], y, float("-inf"))
        if COUNT:
            acc += y.to(tl.int32, bitcast=True) >> 31
        ymax = _tile_max(y, BLOCK_M, BLOCK_N, TILE)  # [query tiles, key tiles]
        tmax_ptrs = TMAX + ti[:, None] * stride_ti + tj[None, :]
        tmax_mask = (ti < n_pages)[:, None] & (tj < n_pages)[None, :]
    if COUNT:
        ymax = ymax + log2_beta
    tl.store(tmax_ptrs, tl.exp2(ymax), mask=tmax_mask)
    return acc


@triton.jit
def _load_q(Q, q_ptrs, h, row0, row_ok, d_ok,
            BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, KEY_ROWS: tl.constexpr, TMA: tl.constexpr):
    """The streamed operand: q rows [row0, row0 + BLOCK_M) of head h as [BLOCK_M, D], or [D, BLOCK_M] for
    KEY_ROWS. TMA: Q is a [Hq, Lp, D] tensor descriptor (rows past Lp and columns past D read as 0);
    else q_ptrs already point at the block (rows past the document masked to 0)."""
    if TMA:
        q = tl.reshape(Q.load([h, row0, 0]), [BLOCK_M, BLOCK_D])
        if KEY_ROWS:
            q = tl.trans(q)
    elif KEY_ROWS:
        q = tl.load(q_ptrs, mask=d_ok[:, None] & row_ok[None, :], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    return q


@triton.jit
def _stats_rows(acc, Q, q_ptrs, k_op, q_lse, tmax_ptr, m_lo, m_from, m_to, h, n0, offs_n, rm, d_ok,
                n_prefix, stride_ql, stride_ti, n_doc, n_pages, qk_mul, cap_mul, log2_beta, lse_mul,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
                KEY_ROWS: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                COUNT: tl.constexpr, TMA: tl.constexpr):
    """The query blocks [m_from, m_to) against the program's key block -> acc. q_ptrs point at query block
    m_lo (unused with TMA, where Q is the descriptor)."""
    for m0 in range(m_from, m_to, BLOCK_M):
        if TMA:
            ptrs = q_ptrs
        else:
            ptrs = q_ptrs + (m0 - m_lo).to(tl.int64) * stride_ql
        q_op = _load_q(Q, ptrs, h, n_prefix + m0, m0 + rm < n_doc, d_ok, BLOCK_M, BLOCK_D, KEY_ROWS, TMA)
        acc = _stats_block(acc, q_op, k_op, q_lse, tmax_ptr, m0, n0, offs_n, rm,
                           stride_ti, n_doc, n_pages, qk_mul, cap_mul, log2_beta, lse_mul,
                           BLOCK_M, BLOCK_N, TILE, KEY_ROWS, CAUSAL, SOFTCAP, DOT_PRECISION, COUNT)
    return acc


@triton.jit
def _stats_kernel(
    Q, K, LSE, TMAX, COUNTS,
    stride_qh, stride_ql, stride_qd, stride_kh, stride_kl, stride_kd, stride_lh, stride_th, stride_ti, stride_ch,
    n_prefix, n_doc, n_pages, h_first, qk_mul, cap_mul, log2_beta, lse_first, lse_mul,
    GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEY_ROWS: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, COUNT: tl.constexpr, TMA: tl.constexpr,
):
    """Document keys [n0, n0 + BLOCK_N) of head h_first + program_id(0) against every document query q >= key.

    TMAX[hc, i, j] = max A over tile (i, j)'s causal cells (written for every j <= i, 0 above the diagonal
    where a block reaches there); COUNTS[h, n] = |{document q >= n : A[q, n] >= beta}|.
    LSE[h, lse_first + m] * lse_mul is document row m's lse2: the first pass's lse2 (lse_first 0, lse_mul 1)
    or the forward's natural-log lse over all rows (lse_first n_prefix, lse_mul log2 e, rounded as
    `lse * LOG2E` in fp32 torch would be). log2_beta: log2 of beta (beta > 0; COUNT False when beta = 0).
    Q: pointer, or with TMA a [Hq, Lp, D] tensor descriptor of block [1, BLOCK_M, BLOCK_D].
    """
    hc = tl.program_id(0)
    h = h_first + hc
    # Key block 0 meets the most query blocks; launch order is heads fastest, so heavy programs go first.
    n0 = tl.program_id(1) * BLOCK_N
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    d_ok = rd < HEAD_DIM
    offs_n = n0 + rn
    n_ok = offs_n < n_doc

    k_base = K + (h // GROUPS).to(tl.int64) * stride_kh + (n_prefix + n0).to(tl.int64) * stride_kl
    m_lo = (n0 // BLOCK_M) * BLOCK_M
    q_ptrs = Q
    if not TMA:
        q_base = Q + h.to(tl.int64) * stride_qh + (n_prefix + m_lo).to(tl.int64) * stride_ql
        if KEY_ROWS:
            q_ptrs = q_base + (rd[:, None] * stride_qd + rm[None, :] * stride_ql)
        else:
            q_ptrs = q_base + (rm[:, None] * stride_ql + rd[None, :] * stride_qd)
    if KEY_ROWS:
        k_op = tl.load(k_base + (rn[:, None] * stride_kl + rd[None, :] * stride_kd),
                       mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = tl.zeros([BLOCK_N], tl.int32)
    else:
        k_op = tl.load(k_base + (rd[:, None] * stride_kd + rn[None, :] * stride_kl),
                       mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    q_lse = LSE + h.to(tl.int64) * stride_lh + lse_first
    tmax_ptr = TMAX + hc.to(tl.int64) * stride_th

    # Query blocks from m_full on lie wholly at or below the key block: no causal mask. Two loops (the mask is
    # a compile-time flag of the block step) so the unmasked majority carries no mask arithmetic.
    m_full = tl.minimum(tl.cdiv(n0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M, n_doc)
    acc = _stats_rows(acc, Q, q_ptrs, k_op, q_lse, tmax_ptr, m_lo, m_lo, m_full, h, n0, offs_n, rm, d_ok,
                      n_prefix, stride_ql, stride_ti, n_doc, n_pages, qk_mul, cap_mul, log2_beta, lse_mul,
                      BLOCK_M, BLOCK_N, BLOCK_D, TILE, KEY_ROWS, True, SOFTCAP, DOT_PRECISION, COUNT, TMA)
    acc = _stats_rows(acc, Q, q_ptrs, k_op, q_lse, tmax_ptr, m_lo, m_full, n_doc, h, n0, offs_n, rm, d_ok,
                      n_prefix, stride_ql, stride_ti, n_doc, n_pages, qk_mul, cap_mul, log2_beta, lse_mul,
                      BLOCK_M, BLOCK_N, BLOCK_D, TILE, KEY_ROWS, False, SOFTCAP, DOT_PRECISION, COUNT, TMA)
    if COUNT:
        # acc sums -1 per visited cell below beta; every key of the block met the same query rows.
        if KEY_ROWS:
            below = -acc
        else:
            below = -tl.sum(acc, 0)
        counts = tl.cdiv(n_doc - m_lo, BLOCK_M) * BLOCK_M - below
    else:
        counts = n_doc - offs_n  # beta = 0: every document query q >= key
    tl.store(COUNTS + h.to(tl.int64) * stride_ch + offs_n, counts, mask=n_ok)


@triton.jit
def _la_bytes(TMAX, LA, dense, b0, n_bits, n_bytes, stride_ti, alpha,
              BYTES: tl.constexpr, SINK: tl.constexpr, HAS_DENSE: tl.constexpr):
    """LA bytes [b0, b0 + BYTES) of one head; TMAX / LA: that head's tile maxima [P, P] / output row."""
    rb = b0 + tl.arange(0, BYTES)
    n = rb.to(tl.int64)[:, None] * 8 + tl.arange(0, 8)[None, :]  # [BYTES, 8] bit index i(i+1)/2 + j
    ok = n < n_bits
    i = ((tl.sqrt((8 * n + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int64)
    i = tl.where((i + 1) * (i + 2) // 2 <= n, i + 1, i)  # fp32 sqrt is off by at most one row
    i = tl.where(i * (i + 1) // 2 > n, i - 1, i)
    j = n - i * (i + 1) // 2
    tm = tl.load(TMAX + i * stride_ti + j, mask=ok, other=0.0)
    bit = (tm >= alpha) | (i == j)
    if SINK:
        bit = bit | (j == 0)
    if HAS_DENSE:
        bit = bit | dense
    bit = bit & ok
    byte = tl.sum(bit.to(tl.int32) << (7 - tl.arange(0, 8))[None, :], 1)  # MSB first
    tl.store(LA + rb, byte.to(tl.uint8), mask=rb < n_bytes)


@triton.jit
def _ca_bytes(COUNTS, CA, dense, b0, n_doc, n_pages, n_bytes, gamma,
              TILE: tl.constexpr, BYTES: tl.constexpr, KEY_INDEX: tl.constexpr, HAS_DENSE: tl.constexpr):
    """CA bytes [b0, b0 + BYTES) of one head; COUNTS / CA: that head's key counts [L] / output row."""
    rb = b0 + tl.arange(0, BYTES)
    page = rb[:, None] * 8 + tl.arange(0, 8)[None, :]  # [BYTES, 8]
    key = page[:, :, None] * TILE + tl.arange(0, TILE)[None, None, :]  # [BYTES, 8, TILE]
    ok = key < n_doc
    count = tl.load(COUNTS + key, mask=ok, other=0)
    if KEY_INDEX:
        denom = key + 1
    else:
        denom = tl.where(ok, n_doc - key, 1)
    hot = (tl.math.div_rn(count.to(tl.float32), denom.to(tl.float32)) >= gamma) & ok
    page_hot = tl.max(hot.to(tl.int32), 2)  # [BYTES, 8]
    if HAS_DENSE:
        page_hot = tl.where(dense & (page < n_pages), 1, page_hot)
    byte = tl.sum(page_hot << (7 - tl.arange(0, 8))[None, :], 1)  # MSB first
    tl.store(CA + rb, byte.to(tl.uint8), mask=rb < n_bytes)


@triton.jit
def _bits_kernel(
    TMAX, COUNTS, DENSE, LA, CA,
    stride_th, stride_ti, stride_ch, stride_lah, stride_cah,
    h_first, n_doc, n_pages, la_bits, la_bytes, ca_bytes, alpha, gamma,
    TILE: tl.constexpr, LA_BYTES: tl.constexpr, CA_BYTES: tl.constexpr,
    KEY_INDEX: tl.constexpr, SINK: tl.constexpr, HAS_DENSE: tl.constexpr,
):
    """`profile_ref.finish_bits` in one launch for heads h_first + program_id(1): packed LA and CA bytes.

    Programs [0, cdiv(la_bytes, LA_BYTES)) write LA_BYTES bytes of LA each, the rest CA_BYTES bytes of CA.
    Every byte is written, trailing bits 0. alpha / gamma are already float32 values, so the comparisons are
    finish_bits' own (tile_max >= alpha; count / denom, correctly rounded, >= gamma).
    """
    pid = tl.program_id(0)
    hc = tl.program_id(1)
    h = h_first + hc
    n_la = tl.cdiv(la_bytes, LA_BYTES)
    dense = False
    if HAS_DENSE:
        dense = tl.load(DENSE + h) != 0
    if pid < n_la:
        _la_bytes(TMAX + hc.to(tl.int64) * stride_th, LA + h.to(tl.int64) * stride_lah, dense, pid * LA_BYTES,
                  la_bits, la_bytes, stride_ti, alpha, LA_BYTES, SINK, HAS_DENSE)
    else:
        _ca_bytes(COUNTS + h.to(tl.int64) * stride_ch, CA + h.to(tl.int64) * stride_cah, dense,
                  (pid - n_la) * CA_BYTES, n_doc, n_pages, ca_bytes, gamma, TILE, CA_BYTES, KEY_INDEX, HAS_DENSE)


@dataclass(frozen=True)
class ProfileKernelConfig:
    """Launch parameters of one pass.

    block_m: query rows per block; block_n: keys per block. For the stats pass both are multiples of the
    tile, and key_rows lays its scores out [keys, queries] (the key block as the stationary left operand of
    the dot, queries streaming in as the right one, like a flash forward) instead of [queries, keys].
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    key_rows: bool = False
    tma: bool = False  # stats pass: stream q blocks with TMA (Hopper+; pointer loads where q does not allow it)


def default_configs(tile: int, head_dim: int,
                    dtype: torch.dtype) -> tuple[ProfileKernelConfig, ProfileKernelConfig]:
    """(lse pass, stats pass) launch parameters; the interpreter ignores warps and stages.

    16-bit, head_dim <= 128: 128 x 128 blocks and [queries, keys] scores; the stats pass streams q with TMA
    (without it the steady loop spills registers) and, for tiles <= 64, uses 64 x 128 blocks with 4 warps, so
    two programs share an SM and one's tensor-core work overlaps the other's ALU work (`bench/bench_profile.py`
    sweeps these shapes). fp32 (IEEE dots on FMA units, for checks rather than speed): up to tile 64 both
    passes share one block shape and orientation, so a cell's q.k comes out of the same instruction sequence in
    both and log2 A of a row's only key is exactly 0; more warps for bigger blocks keep the unrolled FMA dot's
    compile time down. Shared memory (227 KiB on Hopper) bounds blocks and stages for head_dim > 128.
    """
    wide = head_dim > 128
    if dtype == torch.float32:
        block = max(tile, 32)
        stats = ProfileKernelConfig(block_m=block, block_n=block, num_warps={32: 4, 64: 8, 128: 16}[block],
                                    num_stages=2)
        if wide:
            return ProfileKernelConfig(block_m=32, block_n=32, num_warps=4, num_stages=2), stats
        lse = stats if block <= 64 else ProfileKernelConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)
        return lse, stats
    if wide:
        return (ProfileKernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2),
                ProfileKernelConfig(block_m=max(tile, 64), block_n=max(tile, 64), num_warps=8,
                             num_stages=2 if tile <= 64 else 1, key_rows=True))
    # A 64-row block holds whole tiles only for tile <= 64.
    stats = (ProfileKernelConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, tma=True) if tile <= 64 else
             ProfileKernelConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, tma=True))
    return ProfileKernelConfig(block_m=128, block_n=128, num_warps=8, num_stages=3), stats


@dataclass(frozen=True)
class ProfileStats:
    """Statistics of one layer (document part only); `finish_bits` turns them into bits.

    tile_max: [Hq, P, P] fp32, max A over each tile's causal cells (0 above the diagonal).
    key_counts: [Hq, L] int32, number of document queries q >= k with A[q, k] >= beta.
    lse: [Hq, L] fp32, natural-log log-sum-exp of each document row (prefix keys included).
    """

    tile_max: torch.Tensor
    key_counts: torch.Tensor
    lse: torch.Tensor


def _check_kernel_inputs(q, k, *, scale, softcap, lse, dense_heads) -> None:
    for name, x in (("q", q), ("k", k)):
        if x.dtype not in DTYPES:
            raise ValueError(f"{name}.dtype={x.dtype} is unsupported; use one of {DTYPES}")
    if k.dtype != q.dtype or k.device != q.device:
        raise ValueError(f"q and k must share dtype and device; got {q.dtype}/{q.device}, {k.dtype}/{k.device}")
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"profile_layer runs on CUDA tensors (got {q.device}); use profile_layer_ref on CPU")
    if not (isinstance(scale, (int, float)) and scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale={scale!r} must be a positive finite float (usually head_dim ** -0.5)")
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0 and math.isfinite(softcap)):
        raise ValueError(f"softcap={softcap!r} must be None or a positive finite float")
    hq, lp, _ = q.shape
    if lse is not None:
        if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (hq, lp) or not lse.is_floating_point():
            raise ValueError(f"lse must be a float tensor [Hq, Lp] = [{hq}, {lp}] (natural log); got "
                             f"{getattr(lse, 'dtype', type(lse))} {tuple(getattr(lse, 'shape', ()))}")
        if lse.device != q.device:
            raise ValueError(f"lse is on {lse.device} but q on {q.device}")
    bad = [h for h in dense_heads if not 0 <= int(h) < hq]
    if bad:
        raise ValueError(f"dense_heads {bad} out of range: heads are 0..{hq - 1}")


def _score_muls(scale: float, softcap: float | None) -> tuple[float, float]:
    if softcap is None:
        return scale * LOG2E, 1.0
    return scale / softcap, softcap * LOG2E


def _device_of(x: torch.Tensor):
    # Triton launches on the current CUDA device, which need not be the tensors' one.
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


def _launch_lse(q, k, *, n_prefix, scale, softcap, cfg: ProfileKernelConfig) -> torch.Tensor:
    """-> lse2 [Hq, L] fp32: log2-sum-exp2 of the document rows' scores in log2 units."""
    hq, lp, d = q.shape
    n_doc = lp - n_prefix
    lse2 = torch.empty(hq, n_doc, dtype=torch.float32, device=q.device)
    qk_mul, cap_mul = _score_muls(scale, softcap)
    with _device_of(q):
        _lse_kernel[(hq, triton.cdiv(n_doc, cfg.block_m))](
            q, k, lse2, *q.stride(), *k.stride(), lse2.stride(0),
            n_prefix, n_doc, qk_mul, cap_mul,
            GROUPS=hq // k.shape[0], HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SOFTCAP=softcap is not None,
            DOT_PRECISION=_dot_precision(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return lse2


def _fp32(x: float) -> float:
    """x rounded to float32, as the reference's torch.tensor(x, dtype=float32) compares it."""
    return float(torch.tensor(x, dtype=torch.float32))


@dataclass(frozen=True)
class _Lse:
    """Row lse as the stats pass reads it: tensor[h, first + m] * mul is document row m's lse2 (log2 units)."""

    tensor: torch.Tensor
    first: int
    mul: float


def _lse_input(lse: torch.Tensor | None, q, k, *, n_prefix, scale, softcap, cfg) -> _Lse:
    """The forward's natural-log lse [Hq, Lp] as given (scaled to log2 in the kernel), else the first pass's."""
    if lse is None:
        return _Lse(_launch_lse(q, k, n_prefix=n_prefix, scale=scale, softcap=softcap, cfg=cfg), 0, 1.0)
    if lse.dtype != torch.float32 or lse.stride(1) != 1:
        lse = lse.to(torch.float32).contiguous()
    return _Lse(lse, n_prefix, LOG2E)


def _launch_stats(q, k, lse: _Lse, key_counts, heads: range, *, n_prefix, tile, beta, scale, softcap,
                  cfg: ProfileKernelConfig, zero_upper: bool = True) -> torch.Tensor:
    """Fills key_counts[heads] and returns tile_max [len(heads), P, P] fp32 (above the diagonal: 0 when
    zero_upper, else whatever the allocation held; the bits read only the lower triangle)."""
    hq, lp, d = q.shape
    n_doc = lp - n_prefix
    p = n_pages(n_doc, tile)
    assert cfg.block_m % tile == 0 and cfg.block_n % tile == 0, (cfg, tile)
    alloc = torch.zeros if zero_upper else torch.empty
    tile_max = alloc(len(heads), p, p, dtype=torch.float32, device=q.device)
    beta32 = _fp32(beta)
    count = beta32 > 0  # beta = 0: every causal cell counts, no comparisons needed
    log2_beta = math.log2(beta32) if count else 0.0
    qk_mul, cap_mul = _score_muls(scale, softcap)
    block_d = triton.next_power_of_2(d)
    q_arg = _q_descriptor(q, cfg.block_m, block_d) if cfg.tma else None
    with _device_of(q):
        _stats_kernel[(len(heads), triton.cdiv(n_doc, cfg.block_n))](
            q if q_arg is None else q_arg, k, lse.tensor, tile_max, key_counts,
            *q.stride(), *k.stride(), lse.tensor.stride(0), tile_max.stride(0), tile_max.stride(1),
            key_counts.stride(0),
            n_prefix, n_doc, p, heads.start, qk_mul, cap_mul, log2_beta, lse.first, lse.mul,
            GROUPS=hq // k.shape[0], HEAD_DIM=d, BLOCK_D=block_d, TILE=tile,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, KEY_ROWS=cfg.key_rows, SOFTCAP=softcap is not None,
            DOT_PRECISION=_dot_precision(q.dtype), COUNT=count, TMA=q_arg is not None,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return tile_max


def _q_descriptor(q: torch.Tensor, block_m: int, block_d: int):
    """A TMA descriptor of q [Hq, Lp, D] (block [1, block_m, block_d]), or None where TMA cannot read q: it
    needs unit stride along D, 16-byte aligned base and strides, and a GPU that has it (sm_90+); the
    interpreter emulates it."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    esize = q.element_size()
    if q.stride(2) != 1 or q.data_ptr() % 16 or (q.stride(0) * esize) % 16 or (q.stride(1) * esize) % 16:
        return None
    if q.is_cuda and torch.cuda.get_device_capability(q.device)[0] < 9:
        return None
    return TensorDescriptor(q, list(q.shape), list(q.stride()), [1, block_m, block_d])


LA_BYTES_PER_PROGRAM = 64


def _launch_bits(tile_max, key_counts, dense, la, ca, heads: range, *, n_doc, tile, alpha, gamma,
                 ca_normalize, force_sink_page) -> None:
    """`finish_bits` as one kernel: writes la[heads] / ca[heads] (uint8 rows of the whole layer's outputs).

    tile_max: [len(heads), P, P] fp32 (lower triangle read); key_counts: [Hq, L] int32; dense: [Hq] uint8
    (1 = dense head) or None.
    """
    p = n_pages(n_doc, tile)
    ca_per_program = max(1, 512 // tile)  # 4096 keys a program
    grid = (triton.cdiv(la.shape[1], LA_BYTES_PER_PROGRAM) + triton.cdiv(ca.shape[1], ca_per_program), len(heads))
    with _device_of(tile_max):
        _bits_kernel[grid](
            tile_max, key_counts, dense if dense is not None else key_counts, la, ca,
            tile_max.stride(0), tile_max.stride(1), key_counts.stride(0), la.stride(0), ca.stride(0),
            heads.start, n_doc, p, p * (p + 1) // 2, la.shape[1], ca.shape[1], _fp32(alpha), _fp32(gamma),
            TILE=tile, LA_BYTES=LA_BYTES_PER_PROGRAM, CA_BYTES=ca_per_program,
            KEY_INDEX=ca_normalize == "key_index", SINK=force_sink_page, HAS_DENSE=dense is not None,
            num_warps=4,
        )


def _configs(configs, tile, q, n_prefix) -> tuple[ProfileKernelConfig, ProfileKernelConfig]:
    if configs is None and q.dtype == torch.float32 and q.shape[-1] > 128 and tile == 128:
        raise ValueError(f"fp32 inputs with head_dim={q.shape[-1]} > 128 and tile=128 do not fit in shared "
                         "memory; profile in bf16 / fp16 or with a smaller tile")
    lse_cfg, stats_cfg = configs or default_configs(tile, q.shape[-1], q.dtype)
    for cfg in (lse_cfg, stats_cfg):
        if cfg.block_m < 16 or cfg.block_n < 16:
            raise ValueError(f"{cfg}: blocks must be at least 16 (tl.dot)")
    if stats_cfg.block_m % tile or stats_cfg.block_n % tile:
        raise ValueError(f"{stats_cfg}: stats blocks must be multiples of tile={tile}")
    n_doc = q.shape[1] - n_prefix
    if triton.cdiv(n_doc, min(lse_cfg.block_m, stats_cfg.block_n)) > 65535:
        raise ValueError(f"a document of {n_doc} tokens needs more than 65535 blocks of a launch grid; split it")
    return lse_cfg, stats_cfg


def profile_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    n_prefix: int,
    tile: int,
    beta: float,
    softcap: float | None = None,
    lse: torch.Tensor | None = None,
    configs: tuple[ProfileKernelConfig, ProfileKernelConfig] | None = None,
) -> ProfileStats:
    """The statistics behind `profile_layer`'s bits, for every query head (tests, debugging, benchmarks).

    q: [Hq, Lp, D], k: [Hkv, Lp, D] as in `profile_layer`. Holds all heads' tile maxima at once (O(Hq P^2)).
    configs: (lse pass, stats pass) launch parameters; default `default_configs`.
    """
    validate_profile_args(q, k, n_prefix=n_prefix, tile=tile, alpha=0.0, beta=beta, gamma=0.0,
                          ca_normalize="causal")
    _check_kernel_inputs(q, k, scale=scale, softcap=softcap, lse=lse, dense_heads=())
    lse_cfg, stats_cfg = _configs(configs, tile, q, n_prefix)
    hq, lp, _ = q.shape
    lse_in = _lse_input(lse, q, k, n_prefix=n_prefix, scale=scale, softcap=softcap, cfg=lse_cfg)
    key_counts = torch.empty(hq, lp - n_prefix, dtype=torch.int32, device=q.device)
    tile_max = _launch_stats(q, k, lse_in, key_counts, range(hq), n_prefix=n_prefix, tile=tile, beta=beta,
                             scale=scale, softcap=softcap, cfg=stats_cfg)
    doc_lse = lse_in.tensor[:, lse_in.first:] * lse_in.mul / LOG2E
    return ProfileStats(tile_max=tile_max, key_counts=key_counts, lse=doc_lse)


def profile_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    n_prefix: int,
    tile: int,
    alpha: float,
    beta: float,
    gamma: float,
    softcap: float | None = None,
    ca_normalize: str = "causal",
    force_sink_page: bool = True,
    dense_heads: Sequence[int] = (),
    lse: torch.Tensor | None = None,
    stats_bytes: int = 256 << 20,
    configs: tuple[ProfileKernelConfig, ProfileKernelConfig] | None = None,
) -> tuple[LayerBits, None]:
    """One layer's SIFT bits for every query head, on the GPU; same meaning as `profile_layer_ref`.

    q: [Hq, Lp, D] rotated queries of (profiling prefix + document), Lp = n_prefix + L; k: [Hkv, Lp, D]
    rotated keys (Hq % Hkv == 0); any strides; fp32, fp16 or bf16.
    lse: optional [Hq, Lp] row log-sum-exp (natural log, fp32) of this layer's scores from the forward pass;
       skips the first pass. Only the document rows are read.
    stats_bytes: budget for the [heads, P, P] fp32 tile maxima; heads are processed in chunks that fit it.
    configs: launch parameters (lse pass, stats pass); default `default_configs`.
    Returns (LayerBits(la [Hq, ceil(P(P+1)/2/8)] uint8, ca [Hq, ceil(P/8)] uint8), None).
    """
    validate_profile_args(q, k, n_prefix=n_prefix, tile=tile, alpha=alpha, beta=beta, gamma=gamma,
                          ca_normalize=ca_normalize)
    _check_kernel_inputs(q, k, scale=scale, softcap=softcap, lse=lse, dense_heads=dense_heads)
    lse_cfg, stats_cfg = _configs(configs, tile, q, n_prefix)
    hq, lp, _ = q.shape
    n_doc = lp - n_prefix
    p = n_pages(n_doc, tile)
    lse_in = _lse_input(lse, q, k, n_prefix=n_prefix, scale=scale, softcap=softcap, cfg=lse_cfg)
    key_counts = torch.empty(hq, n_doc, dtype=torch.int32, device=q.device)
    la = torch.empty(hq, la_nbytes(n_doc, tile), dtype=torch.uint8, device=q.device)
    ca = torch.empty(hq, ca_nbytes(n_doc, tile), dtype=torch.uint8, device=q.device)
    dense = None
    if dense_heads:
        flags = torch.zeros(hq, dtype=torch.uint8)
        flags[[int(h) for h in dense_heads]] = 1
        dense = flags.to(q.device)
    chunk = max(1, stats_bytes // (p * p * 4))
    for h0 in range(0, hq, chunk):
        heads = range(h0, min(h0 + chunk, hq))
        tile_max = _launch_stats(q, k, lse_in, key_counts, heads, n_prefix=n_prefix, tile=tile, beta=beta,
                                 scale=scale, softcap=softcap, cfg=stats_cfg, zero_upper=False)
        _launch_bits(tile_max, key_counts, dense, la, ca, heads, n_doc=n_doc, tile=tile, alpha=alpha,
                     gamma=gamma, ca_normalize=ca_normalize, force_sink_page=force_sink_page)
    return LayerBits(la=la, ca=ca), None
