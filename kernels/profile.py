"""Triton kernels of SIFT profiling (SPEC section 2): one layer's q/k -> LA/CA statistics -> packed bits, for a
pack of documents at once (`packing.PackedDocs`: sequences of prefix + document back to back, each attending to
itself only), one launch per pass and layer for the whole pack.

The reference twin is `profile_ref.profile_packed_ref` (`profile_layer_ref` per document); both share
`validate_profile_args`, and `_bits_kernel` is the one-launch twin of the reference's `finish_bits` (tested
equal to it bit for bit), so the passes only have to produce the two statistics `finish_bits` reads. Every
program reads which document it works on, and where, from tables built once per pack (`PackPlan`); a program
never crosses a document boundary, and it cuts its document into blocks exactly as it would cut the document
alone, so a document's bits do not depend on what it is packed with. Flash-style passes, never an L x L
matrix:

1. `_attention_kernel`, per (query head, block of BLOCK_M rows of one sequence): the row log-sum-exp over the
   row's causal keys of its sequence (profiling prefix included), online, in log2 units -> lse2 [Hq, T]; with
   V also the attention output [T, Hq, Dv] (`attention_packed`: the layer's forward where no SDPA backend
   returns the lse, `attention_lse`). Without V only document rows are visited: no statistic needs the
   prefix's. Skipped entirely when the caller passes the forward pass's `lse`.
2. `_stats_kernel`, per (query head, block of BLOCK_N keys of one document): the key block stays on chip while
   the document's query blocks at or below it stream past. Per cell x = log2 A = s * log2(e) - lse2, so
   * LA: max of x over each (query tile, key tile), stored once as exp2 -> tile_max, [P, P] fp32 per document;
   * CA: cells with x >= log2(beta) are counted in int32 registers and reduced and stored once per program
     -> key_counts [Hq, T] int32. Each program owns its keys: no atomics, and the result is deterministic.
   Comparing log2 A with log2(beta) instead of A with beta saves the exp2 of every cell (the pass is then
   bound by its one QK^T product); the two orders differ only for a probability within float rounding of
   beta, which is also where exp2 and the reference's softmax may disagree.
3. `_bits_kernel`, per (head, block of one document's output bytes): `finish_bits` (alpha / gamma thresholds,
   diagonal, sink page, dense heads, MSB-first packing) straight into the layer's uint8 outputs; one launch
   instead of ~20 small torch ops per document, which dominated short (RAG-sized) documents.

The reader criterion (`criterion="reader"`; every sequence is [prefix, document, reader], `PackedDocs.n_reader`)
replaces passes 2 and 3: `_mass_kernel`, per (query head, block of BLOCK_N keys of one document), sums
A = exp2(s2 - lse2) over each (query tile, key tile) of the document rows at or below the key block -> tile masses
[sum P^2], and over the reader rows for each page -> page masses [sum P], reading the same lse as pass 2; each
program owns its outputs (no atomics, deterministic). The choice (`reader_select.select_packed`: a sort per head
over the pack's candidates) and the packing (`profile_ref.finish_packed`) are torch ops shared with the reference,
so the two backends' bits differ only where their masses' rounding straddles a decision.

Memory: lse2 and key_counts are O(Hq * T); tile_max is O(Hq * sum P^2) (4 bytes per tile), so `profile_packed`
runs pass 2 and the bits kernel over chunks of heads whose tile maxima fit `stats_bytes`.

GQA: query head h reads key head h // (Hq // Hkv) in place; K is never expanded. q / k may have any strides
(e.g. views of [T, H, D]). fp32 inputs use IEEE dot products so the bits match the CPU reference; fp16 /
bf16 products are exact in the fp32 accumulator, so they match the reference run on the upcast inputs.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from sift.format import ca_nbytes, la_nbytes

from .numerics import LOG2E
from .packing import PackedDocs
from .profile_ref import LayerBits, finish_packed, validate_criterion, validate_packed, validate_profile_args
from .reader_select import select_packed

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
def _attention_kernel(
    Q, K, V, O, LSE2, SEQ0, DOC_LEN, BLOCKS,
    stride_qh, stride_ql, stride_qd, stride_kh, stride_kl, stride_kd, stride_vh, stride_vl, stride_vd,
    stride_ol, stride_oh, stride_od, stride_lh,
    n_fixed, n_heads, qk_mul, cap_mul,
    GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_V: tl.constexpr,
):
    """Rows [r0, r0 + BLOCK_M) of sequence s, (s, r0) = BLOCKS[program_id(1)] (r0 counted from the sequence's
    first row SEQ0[s]; the sequence holds n_fixed + DOC_LEN[s] rows: prefix, document and reader, if any) and
    query head h, program_id(0) = blk * n_heads + h (heads fastest):
    LSE2[h, row] = log2 sum_{key <= row, key in s} exp2(s2[row, key]) and, with HAS_V, O[row, h] = the softmax
    of those scores times V (rows and keys as pack rows)."""
    h = tl.program_id(0) % n_heads
    blk = tl.program_id(0) // n_heads
    seq = tl.load(BLOCKS + 2 * blk)
    row0 = tl.load(BLOCKS + 2 * blk + 1)
    base = tl.load(SEQ0 + seq).to(tl.int64)
    seq_len = n_fixed + tl.load(DOC_LEN + seq)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    d_ok = rd < HEAD_DIM
    row_ok = row0 + rm < seq_len

    q_ptrs = Q + h.to(tl.int64) * stride_qh + (base + row0) * stride_ql \
        + (rm[:, None] * stride_ql + rd[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    kv_head = (h // GROUPS).to(tl.int64)
    kt_ptrs = K + kv_head * stride_kh + base * stride_kl + (rd[:, None] * stride_kd + rn[None, :] * stride_kl)
    v_ptrs = V + kv_head * stride_vh + base * stride_vl + (rn[:, None] * stride_vl + rd[None, :] * stride_vd)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_full = (row0 // BLOCK_N) * BLOCK_N  # keys [0, n_full) are causal for every row of the block
    n_end = tl.minimum(row0 + BLOCK_M, seq_len)
    for _ in range(0, n_full, BLOCK_N):
        kt = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
        s = _log2_scores(tl.dot(q, kt, input_precision=DOT_PRECISION), qk_mul, cap_mul, SOFTCAP)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        rescale = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * rescale + tl.sum(p, 1)
        if HAS_V:
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            v_ptrs += BLOCK_N * stride_vl
        m_i = m_new
        kt_ptrs += BLOCK_N * stride_kl
    for n0 in range(n_full, n_end, BLOCK_N):
        n_ok = n0 + rn < n_end
        kt = tl.load(kt_ptrs, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        s = _log2_scores(tl.dot(q, kt, input_precision=DOT_PRECISION), qk_mul, cap_mul, SOFTCAP)
        s = tl.where((n0 + rn)[None, :] <= (row0 + rm)[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        rescale = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * rescale + tl.sum(p, 1)
        if HAS_V:
            v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            v_ptrs += BLOCK_N * stride_vl
        m_i = m_new
        kt_ptrs += BLOCK_N * stride_kl
    rows = base + row0 + rm
    tl.store(LSE2 + h.to(tl.int64) * stride_lh + rows, m_i + tl.log2(l_i), mask=row_ok)
    if HAS_V:
        o_ptrs = O + rows[:, None] * stride_ol + h.to(tl.int64) * stride_oh + rd[None, :] * stride_od
        tl.store(o_ptrs, (acc / l_i[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


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
                doc0, stride_ql, stride_ti, n_doc, n_pages, qk_mul, cap_mul, log2_beta, lse_mul,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
                KEY_ROWS: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                COUNT: tl.constexpr, TMA: tl.constexpr):
    """The query blocks [m_from, m_to) against the program's key block -> acc. q_ptrs point at query block
    m_lo (unused with TMA, where Q is the descriptor); doc0: the pack row of the document's first token."""
    for m0 in range(m_from, m_to, BLOCK_M):
        if TMA:
            ptrs = q_ptrs
        else:
            ptrs = q_ptrs + (m0 - m_lo).to(tl.int64) * stride_ql
        q_op = _load_q(Q, ptrs, h, doc0 + m0, m0 + rm < n_doc, d_ok, BLOCK_M, BLOCK_D, KEY_ROWS, TMA)
        acc = _stats_block(acc, q_op, k_op, q_lse, tmax_ptr, m0, n0, offs_n, rm,
                           stride_ti, n_doc, n_pages, qk_mul, cap_mul, log2_beta, lse_mul,
                           BLOCK_M, BLOCK_N, TILE, KEY_ROWS, CAUSAL, SOFTCAP, DOT_PRECISION, COUNT)
    return acc


@triton.jit
def _key_block(BLOCKS, SEQ0, DOC_LEN, n_prefix, h_first, n_heads, TILE: tl.constexpr):
    """A key-block program's place (program_id(0) = blk * n_heads + hc, heads fastest; (d, n0) = BLOCKS[blk]):
    (hc, head h_first + hc, document d, first key n0, pack row of d's first token, L, P)."""
    hc = tl.program_id(0) % n_heads
    blk = tl.program_id(0) // n_heads
    doc = tl.load(BLOCKS + 2 * blk)
    n_doc = tl.load(DOC_LEN + doc)
    return (hc, h_first + hc, doc, tl.load(BLOCKS + 2 * blk + 1), tl.load(SEQ0 + doc) + n_prefix, n_doc,
            tl.cdiv(n_doc, TILE))


@triton.jit
def _stats_kernel(
    Q, K, LSE, TMAX, COUNTS, SEQ0, DOC_LEN, TMAX_OFF, BLOCKS,
    stride_qh, stride_ql, stride_qd, stride_kh, stride_kl, stride_kd, stride_lh, stride_th, stride_ch,
    n_prefix, h_first, n_heads, qk_mul, cap_mul, log2_beta, lse_mul,
    GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEY_ROWS: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, COUNT: tl.constexpr, TMA: tl.constexpr,
):
    """Keys [n0, n0 + BLOCK_N) of document d, (d, n0) = BLOCKS[blk], for head h = h_first + hc
    (program_id(0) = blk * n_heads + hc: heads fastest), against every query q >= key of the same document.

    Document d starts at pack row SEQ0[d] + n_prefix and has DOC_LEN[d] tokens, P = ceil(DOC_LEN[d] / TILE).
    TMAX[hc, TMAX_OFF[d] + i * P + j] = max A over tile (i, j)'s causal cells (written for every j <= i,
    0 above the diagonal where a block reaches there); COUNTS[h, row] = |{document q >= key : A[q, key] >= beta}|
    at the key's pack row. LSE[h, row] * lse_mul is the row's lse2: this module's first pass (lse_mul 1) or the
    forward's natural-log lse (lse_mul log2 e, rounded as `lse * LOG2E` in fp32 torch would be).
    log2_beta: log2 of beta (beta > 0; COUNT False when beta = 0). Q: pointer, or with TMA a [Hq, T, D] tensor
    descriptor of block [1, BLOCK_M, BLOCK_D].
    """
    hc, h, doc, n0, doc0, n_doc, n_pages = _key_block(BLOCKS, SEQ0, DOC_LEN, n_prefix, h_first, n_heads, TILE)
    stride_ti = n_pages
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    d_ok = rd < HEAD_DIM
    offs_n = n0 + rn
    n_ok = offs_n < n_doc

    k_base = K + (h // GROUPS).to(tl.int64) * stride_kh + (doc0 + n0).to(tl.int64) * stride_kl
    m_lo = (n0 // BLOCK_M) * BLOCK_M
    q_ptrs = Q
    if not TMA:
        q_base = Q + h.to(tl.int64) * stride_qh + (doc0 + m_lo).to(tl.int64) * stride_ql
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
    q_lse = LSE + h.to(tl.int64) * stride_lh + doc0
    tmax_ptr = TMAX + hc.to(tl.int64) * stride_th + tl.load(TMAX_OFF + doc).to(tl.int64)

    # Query blocks from m_full on lie wholly at or below the key block: no causal mask. Two loops (the mask is
    # a compile-time flag of the block step) so the unmasked majority carries no mask arithmetic.
    m_full = tl.minimum(tl.cdiv(n0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M, n_doc)
    acc = _stats_rows(acc, Q, q_ptrs, k_op, q_lse, tmax_ptr, m_lo, m_lo, m_full, h, n0, offs_n, rm, d_ok,
                      doc0, stride_ql, stride_ti, n_doc, n_pages, qk_mul, cap_mul, log2_beta, lse_mul,
                      BLOCK_M, BLOCK_N, BLOCK_D, TILE, KEY_ROWS, True, SOFTCAP, DOT_PRECISION, COUNT, TMA)
    acc = _stats_rows(acc, Q, q_ptrs, k_op, q_lse, tmax_ptr, m_lo, m_full, n_doc, h, n0, offs_n, rm, d_ok,
                      doc0, stride_ql, stride_ti, n_doc, n_pages, qk_mul, cap_mul, log2_beta, lse_mul,
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
    tl.store(COUNTS + h.to(tl.int64) * stride_ch + doc0 + offs_n, counts, mask=n_ok)


@triton.jit
def _tile_sum(x, ROWS: tl.constexpr, COLS: tl.constexpr, TILE: tl.constexpr):
    """x: [ROWS, COLS] -> [ROWS / TILE, COLS / TILE] sums of its TILE x TILE tiles (rows first, then columns)."""
    RT: tl.constexpr = ROWS // TILE
    CT: tl.constexpr = COLS // TILE
    r = tl.sum(tl.reshape(x, [RT, TILE, COLS]), 1)   # [RT, COLS]
    return tl.sum(tl.reshape(r, [RT, CT, TILE]), 2)


@triton.jit
def _mass_probs(Q, q_ptrs, k_op, q_lse, m0, offs_n, rm, d_ok, rows_end, lse_mul, qk_mul, cap_mul,
                CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Probabilities A = exp2(s2 - lse2) of query rows [m0, m0 + BLOCK_M) (< rows_end; q_ptrs at row m0) on the
    program's keys offs_n; 0 on rows past rows_end and, with CAUSAL, on keys after the row."""
    offs_m = m0 + rm
    row_ok = offs_m < rows_end
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    lse2 = tl.load(q_lse + offs_m, mask=row_ok, other=float("inf")) * lse_mul
    y = _log2_scores(tl.dot(q, k_op, input_precision=DOT_PRECISION), qk_mul, cap_mul, SOFTCAP) - lse2[:, None]
    if CAUSAL:
        y = tl.where(offs_n[None, :] <= offs_m[:, None], y, float("-inf"))
    return tl.exp2(y)


@triton.jit
def _mass_kernel(
    Q, K, LSE, TMASS, PMASS, SEQ0, DOC_LEN, TMAX_OFF, PAGE_OFF, BLOCKS,
    stride_qh, stride_ql, stride_qd, stride_kh, stride_kl, stride_kd, stride_lh, stride_th, stride_ph,
    n_prefix, n_reader, h_first, n_heads, qk_mul, cap_mul, lse_mul,
    GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """The reader criterion's masses: keys [n0, n0 + BLOCK_N) of document d, (d, n0) = BLOCKS[blk], head
    h = h_first + hc (program_id(0) = blk * n_heads + hc), against every document row q >= key, then every reader
    row of its sequence (rows L .. L + n_reader after the document's first token).

    TMASS[hc, TMAX_OFF[d] + i * P + j] = sum of A over tile (i, j)'s causal cells (each tile of the lower triangle
    written by exactly one program and query block; 0 above the diagonal where a block reaches there);
    PMASS[hc, PAGE_OFF[d] + j] = sum of A over the reader rows and page j's keys. A = exp2(s2 - lse2), lse2 =
    LSE[h, row] * lse_mul, as the stats pass reads it. fp32 sums: over the rows of a block, then over the
    blocks, then (pages) over the tile's keys; each program owns its outputs (no atomics, deterministic).
    """
    hc, h, doc, n0, doc0, n_doc, n_pages = _key_block(BLOCKS, SEQ0, DOC_LEN, n_prefix, h_first, n_heads, TILE)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    d_ok = rd < HEAD_DIM
    offs_n = n0 + rn
    n_ok = offs_n < n_doc
    k_base = K + (h // GROUPS).to(tl.int64) * stride_kh + (doc0 + n0).to(tl.int64) * stride_kl
    k_op = tl.load(k_base + (rd[:, None] * stride_kd + rn[None, :] * stride_kl),
                   mask=d_ok[:, None] & n_ok[None, :], other=0.0)
    q_base = Q + h.to(tl.int64) * stride_qh + doc0.to(tl.int64) * stride_ql + (rm[:, None] * stride_ql
                                                                               + rd[None, :] * stride_qd)
    q_lse = LSE + h.to(tl.int64) * stride_lh + doc0
    ti0 = tl.arange(0, BLOCK_M // TILE)
    tj = n0 // TILE + tl.arange(0, BLOCK_N // TILE)
    tmass = TMASS + hc.to(tl.int64) * stride_th + tl.load(TMAX_OFF + doc).to(tl.int64)
    m_lo = (n0 // BLOCK_M) * BLOCK_M
    q_ptrs = q_base + m_lo.to(tl.int64) * stride_ql
    for m0 in range(m_lo, n_doc, BLOCK_M):
        a = _mass_probs(Q, q_ptrs, k_op, q_lse, m0, offs_n, rm, d_ok, n_doc, lse_mul, qk_mul, cap_mul, True,
                        SOFTCAP, DOT_PRECISION)
        ti = m0 // TILE + ti0
        tl.store(tmass + ti[:, None] * n_pages + tj[None, :], _tile_sum(a, BLOCK_M, BLOCK_N, TILE),
                 mask=(ti < n_pages)[:, None] & (tj < n_pages)[None, :])
        q_ptrs += BLOCK_M * stride_ql
    acc = tl.zeros([BLOCK_N], tl.float32)
    q_ptrs = q_base + n_doc.to(tl.int64) * stride_ql
    for m0 in range(n_doc, n_doc + n_reader, BLOCK_M):  # reader rows: every document key is causal for them
        a = _mass_probs(Q, q_ptrs, k_op, q_lse, m0, offs_n, rm, d_ok, n_doc + n_reader, lse_mul, qk_mul, cap_mul,
                        False, SOFTCAP, DOT_PRECISION)
        acc += tl.sum(a, 0)
        q_ptrs += BLOCK_M * stride_ql
    acc = tl.where(n_ok, acc, 0.0)
    pages = tl.sum(tl.reshape(acc, [BLOCK_N // TILE, TILE]), 1)
    tl.store(PMASS + hc.to(tl.int64) * stride_ph + tl.load(PAGE_OFF + doc) + tj, pages, mask=tj < n_pages)


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
    TMAX, COUNTS, DENSE, LA, CA, SEQ0, DOC_LEN, TMAX_OFF, LA_OFF, CA_OFF, PROGS,
    stride_th, stride_ch, stride_lah, stride_cah,
    n_prefix, h_first, n_la_progs, alpha, gamma,
    TILE: tl.constexpr, LA_BYTES: tl.constexpr, CA_BYTES: tl.constexpr,
    KEY_INDEX: tl.constexpr, SINK: tl.constexpr, HAS_DENSE: tl.constexpr,
):
    """`profile_ref.finish_bits` in one launch for heads h_first + program_id(1): packed LA and CA bytes.

    (d, b0) = PROGS[program_id(0)]: programs below n_la_progs write LA_BYTES bytes of document d's LA vector from
    byte b0 (at LA[h, LA_OFF[d] + b0]), the others CA_BYTES bytes of its CA vector. Every byte is written,
    trailing bits 0. alpha / gamma are already float32 values, so the comparisons are finish_bits' own
    (tile_max >= alpha; count / denom, correctly rounded, >= gamma).
    """
    pid = tl.program_id(0)
    hc = tl.program_id(1)
    h = h_first + hc
    doc = tl.load(PROGS + 2 * pid)
    b0 = tl.load(PROGS + 2 * pid + 1)
    n_doc = tl.load(DOC_LEN + doc)
    p = tl.cdiv(n_doc, TILE)
    dense = False
    if HAS_DENSE:
        dense = tl.load(DENSE + h) != 0
    if pid < n_la_progs:
        la_bits = p * (p + 1) // 2
        _la_bytes(TMAX + hc.to(tl.int64) * stride_th + tl.load(TMAX_OFF + doc).to(tl.int64),
                  LA + h.to(tl.int64) * stride_lah + tl.load(LA_OFF + doc).to(tl.int64), dense, b0,
                  la_bits, tl.cdiv(la_bits, 8), p, alpha, LA_BYTES, SINK, HAS_DENSE)
    else:
        counts = COUNTS + h.to(tl.int64) * stride_ch + (tl.load(SEQ0 + doc) + n_prefix).to(tl.int64)
        _ca_bytes(counts, CA + h.to(tl.int64) * stride_cah + tl.load(CA_OFF + doc).to(tl.int64), dense, b0,
                  n_doc, p, tl.cdiv(p, 8), gamma, TILE, CA_BYTES, KEY_INDEX, HAS_DENSE)


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


def attention_config(tile: int, head_dim: int, dtype: torch.dtype) -> ProfileKernelConfig:
    """Launch parameters of `attention_packed` (the first pass with V: the layer's output too). fp32 runs the
    first pass's own blocks, whose q.k share the stats pass's instruction sequence (IEEE dots, for checks
    rather than speed)."""
    if dtype == torch.float32:
        return default_configs(tile, head_dim, dtype)[0]
    if head_dim > 128:
        return ProfileKernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    return ProfileKernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)


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


@dataclass(frozen=True, eq=False)
class PackPlan:
    """What the kernels of one pack read besides q / k / v: its geometry, the launch parameters and the device
    tables, built once per pack by `plan_pack` and only read by every layer (no host-device synchronisation).

    Tables (int32 on the device): per document, the first row of its sequence (`seq0`), its length, where its
    tile maxima start in a head's [sum P^2] (`tmax_off`) and its bytes in a head's LA / CA row; per program of
    each launch, (sequence or document, first row / key / byte), heaviest programs first.
    """

    docs: PackedDocs
    lse_cfg: ProfileKernelConfig
    stats_cfg: ProfileKernelConfig
    fwd_cfg: ProfileKernelConfig
    seq0: torch.Tensor
    cu_seqlens: torch.Tensor    # [B + 1] sequence boundaries (varlen attention's offsets)
    doc_len: torch.Tensor
    tmax_off: torch.Tensor
    la_off: torch.Tensor
    ca_off: torch.Tensor
    page_off: torch.Tensor      # where each document's pages start in a head's [sum P] page masses (reader)
    lse_blocks: torch.Tensor    # [n, 2] (sequence, first row within it): document and reader rows, first pass
    fwd_blocks: torch.Tensor    # [n, 2] the same over every row, prefix included, for `attention_packed`
    stats_blocks: torch.Tensor  # [n, 2] (document, first key within it)
    bits_progs: torch.Tensor    # [n, 2] (document, first byte): LA programs first, then CA
    n_la_progs: int
    tmax_per_head: int          # sum over documents of P^2
    ca_per_program: int         # CA bytes one bits program writes


LA_BYTES_PER_PROGRAM = 64


def _blocks(starts: np.ndarray, lengths: np.ndarray, block: int) -> np.ndarray:
    """Per document d, the blocks [starts[d] + i * block for i < ceil(lengths[d] / block)] -> [n, 2] int64 rows
    (d, first), in document order."""
    counts = -(-lengths // block)
    doc = np.repeat(np.arange(len(lengths)), counts)
    index = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.stack([doc, starts[doc] + index * block], axis=1)


def _heaviest_first(table: np.ndarray, work: np.ndarray) -> np.ndarray:
    return table[np.argsort(-work, kind="stable")]


def _check_configs(configs, fwd_config, tile: int, head_dim: int, dtype: torch.dtype):
    if configs is None and dtype == torch.float32 and head_dim > 128 and tile == 128:
        raise ValueError(f"fp32 inputs with head_dim={head_dim} > 128 and tile=128 do not fit in shared "
                         "memory; profile in bf16 / fp16 or with a smaller tile")
    lse_cfg, stats_cfg = configs or default_configs(tile, head_dim, dtype)
    fwd_cfg = fwd_config or attention_config(tile, head_dim, dtype)
    for cfg in (lse_cfg, stats_cfg, fwd_cfg):
        if cfg.block_m < 16 or cfg.block_n < 16:
            raise ValueError(f"{cfg}: blocks must be at least 16 (tl.dot)")
    if stats_cfg.block_m % tile or stats_cfg.block_n % tile:
        raise ValueError(f"{stats_cfg}: stats blocks must be multiples of tile={tile}")
    return lse_cfg, stats_cfg, fwd_cfg


def plan_pack(docs: PackedDocs, *, head_dim: int, dtype: torch.dtype, device,
              configs: tuple[ProfileKernelConfig, ProfileKernelConfig] | None = None,
              fwd_config: ProfileKernelConfig | None = None) -> PackPlan:
    """The pack's tables, uploaded in one asynchronous copy from pinned memory where the device is a GPU.

    configs: (first pass, stats pass) launch parameters, default `default_configs`; fwd_config: those of
    `attention_packed`, default `attention_config`."""
    lse_cfg, stats_cfg, fwd_cfg = _check_configs(configs, fwd_config, docs.tile, head_dim, dtype)
    lengths = np.asarray(docs.lengths, dtype=np.int64)
    n_prefix = docs.n_prefix
    pages = np.asarray(docs.pages, dtype=np.int64)
    squares = pages * pages
    tmax_per_head = int(squares.sum())
    if docs.total >= 2**31 or tmax_per_head >= 2**31:
        raise ValueError(f"a pack of {docs.total} rows and {tmax_per_head} tiles per head exceeds the kernels' "
                         f"int32 offsets; profile fewer tokens per pack")
    zeros = np.zeros_like(lengths)
    lse_blocks = _blocks(zeros + n_prefix, lengths + docs.n_reader, lse_cfg.block_m)  # document and reader rows
    lse_blocks = _heaviest_first(lse_blocks, lse_blocks[:, 1])  # later rows have more keys
    fwd_blocks = _blocks(zeros, lengths + n_prefix + docs.n_reader, fwd_cfg.block_m)
    fwd_blocks = _heaviest_first(fwd_blocks, fwd_blocks[:, 1])
    stats_blocks = _blocks(zeros, lengths, stats_cfg.block_n)
    stats_blocks = _heaviest_first(stats_blocks, lengths[stats_blocks[:, 0]] - stats_blocks[:, 1])
    ca_per_program = max(1, 512 // docs.tile)  # 4096 keys a program
    la_progs = _blocks(zeros, np.asarray(docs.la_nbytes, dtype=np.int64), LA_BYTES_PER_PROGRAM)
    ca_progs = _blocks(zeros, np.asarray(docs.ca_nbytes, dtype=np.int64), ca_per_program)
    per_doc = [np.asarray(docs.starts), np.asarray(docs.cu_seqlens), lengths, np.cumsum(squares) - squares,
               np.asarray(docs.la_offsets), np.asarray(docs.ca_offsets), np.cumsum(pages) - pages]
    tables = [lse_blocks, fwd_blocks, stats_blocks, np.concatenate([la_progs, ca_progs])]
    # Every table starts 16-byte aligned (4 int32): Triton specialises a kernel on its pointers' alignment, so
    # tables packed back to back would compile a variant per pack whose document count moves an offset.
    starts = np.cumsum([0] + [-(-a.size // 4) * 4 for a in per_doc + tables])
    flat = np.zeros(int(starts[-1]), dtype=np.int32)
    for at, a in zip(starts, per_doc + tables):
        flat[at:at + a.size] = a.reshape(-1)
    host = torch.from_numpy(flat)
    device = torch.device(device)
    if device.type == "cuda":
        host = host.pin_memory()
    buf = host.to(device, non_blocking=True)
    views = [buf[at:at + a.size].view(a.shape) for at, a in zip(starts, per_doc + tables)]
    return PackPlan(docs, lse_cfg, stats_cfg, fwd_cfg, *views, n_la_progs=len(la_progs),
                    tmax_per_head=tmax_per_head, ca_per_program=ca_per_program)


def _check_kernel_inputs(q, k, *, scale, softcap, lse, total=None) -> None:
    for name, x in (("q", q), ("k", k)):
        if x.dtype not in DTYPES:
            raise ValueError(f"{name}.dtype={x.dtype} is unsupported; use one of {DTYPES}")
    if k.dtype != q.dtype or k.device != q.device:
        raise ValueError(f"q and k must share dtype and device; got {q.dtype}/{q.device}, {k.dtype}/{k.device}")
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the profiling kernels run on CUDA tensors (got {q.device}); use profile_ref on CPU")
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


def _score_muls(scale: float, softcap: float | None) -> tuple[float, float]:
    if softcap is None:
        return scale * LOG2E, 1.0
    return scale / softcap, softcap * LOG2E


def _device_of(x: torch.Tensor):
    # Triton launches on the current CUDA device, which need not be the tensors' one.
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


def _launch_attention(q, k, v, out, lse2, plan: PackPlan, blocks: torch.Tensor, cfg: ProfileKernelConfig, *,
                      scale, softcap) -> None:
    hq, _, d = q.shape
    qk_mul, cap_mul = _score_muls(scale, softcap)
    has_v = v is not None
    v_args = (*v.stride(), *out.stride()) if has_v else (0,) * 6
    with _device_of(q):
        _attention_kernel[(hq * blocks.shape[0],)](
            q, k, v if has_v else q, out if has_v else q, lse2, plan.seq0, plan.doc_len, blocks,
            *q.stride(), *k.stride(), *v_args, lse2.stride(0),
            plan.docs.n_prefix + plan.docs.n_reader, hq, qk_mul, cap_mul,
            GROUPS=hq // k.shape[0], HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, SOFTCAP=softcap is not None, DOT_PRECISION=_dot_precision(q.dtype), HAS_V=has_v,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )


def attention_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PackPlan, *, scale: float,
                     softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's attention over a pack, each sequence attending causally to itself only.

    q: [Hq, T, D], k / v: [Hkv, T, D] (any strides). Returns out [T, Hq, D] in q's dtype (the layout a
    transformers attention function returns, batch dimension aside) and lse2 [Hq, T] fp32, every row's
    log-sum-exp in log2 units (`profile_packed(lse2=...)` reads it)."""
    validate_profile_args(q, k, n_prefix=plan.docs.n_prefix, tile=plan.docs.tile, alpha=0.0, beta=0.0, gamma=0.0,
                          ca_normalize="causal")
    _check_kernel_inputs(q, k, scale=scale, softcap=softcap, lse=None)
    if v.dtype != q.dtype or v.device != q.device or tuple(v.shape) != tuple(k.shape) or q.shape[1] != plan.docs.total:
        raise ValueError(f"v must match k ({tuple(k.shape)} {k.dtype}) and q hold the pack's {plan.docs.total} rows; "
                         f"got v {tuple(v.shape)} {v.dtype}, q {tuple(q.shape)}")
    hq, t, d = q.shape
    out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    lse2 = torch.empty(hq, t, dtype=torch.float32, device=q.device)
    _launch_attention(q, k, v, out, lse2, plan, plan.fwd_blocks, plan.fwd_cfg, scale=scale, softcap=softcap)
    return out, lse2


def _fp32(x: float) -> float:
    """x rounded to float32, as the reference's torch.tensor(x, dtype=float32) compares it."""
    return float(torch.tensor(x, dtype=torch.float32))


@dataclass(frozen=True)
class _Lse:
    """Row lse as the stats pass reads it: tensor[h, row] * mul is the row's lse2 (log2 units)."""

    tensor: torch.Tensor
    mul: float


def _lse_input(lse, lse2, q, k, plan: PackPlan, *, scale, softcap) -> _Lse:
    """The forward's natural-log lse [Hq, T] (scaled to log2 in the kernel), a log2 one, else the first pass's."""
    if lse is not None and lse2 is not None:
        raise ValueError("pass lse (natural log) or lse2 (log2), not both")
    given, mul = (lse, LOG2E) if lse is not None else (lse2, 1.0)
    if given is None:
        lse2 = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
        _launch_attention(q, k, None, None, lse2, plan, plan.lse_blocks, plan.lse_cfg, scale=scale, softcap=softcap)
        return _Lse(lse2, 1.0)
    if given.dtype != torch.float32 or given.stride(1) != 1:
        given = given.to(torch.float32).contiguous()
    return _Lse(given, mul)


def _launch_stats(q, k, plan: PackPlan, lse: _Lse, key_counts, heads: range, *, beta, scale, softcap,
                  zero_upper: bool = True) -> torch.Tensor:
    """Fills key_counts[heads] and returns tile_max [len(heads), sum P^2] fp32 (each document's [P, P] at its
    `tmax_off`; above the diagonal: 0 when zero_upper, else whatever the allocation held, since the bits read
    only the lower triangle)."""
    hq, _, d = q.shape
    cfg = plan.stats_cfg
    alloc = torch.zeros if zero_upper else torch.empty
    tile_max = alloc(len(heads), plan.tmax_per_head, dtype=torch.float32, device=q.device)
    beta32 = _fp32(beta)
    count = beta32 > 0  # beta = 0: every causal cell counts, no comparisons needed
    log2_beta = math.log2(beta32) if count else 0.0
    qk_mul, cap_mul = _score_muls(scale, softcap)
    block_d = triton.next_power_of_2(d)
    q_arg = _q_descriptor(q, cfg.block_m, block_d) if cfg.tma else None
    with _device_of(q):
        _stats_kernel[(len(heads) * plan.stats_blocks.shape[0],)](
            q if q_arg is None else q_arg, k, lse.tensor, tile_max, key_counts, plan.seq0, plan.doc_len,
            plan.tmax_off, plan.stats_blocks,
            *q.stride(), *k.stride(), lse.tensor.stride(0), tile_max.stride(0), key_counts.stride(0),
            plan.docs.n_prefix, heads.start, len(heads), qk_mul, cap_mul, log2_beta, lse.mul,
            GROUPS=hq // k.shape[0], HEAD_DIM=d, BLOCK_D=block_d, TILE=plan.docs.tile,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, KEY_ROWS=cfg.key_rows, SOFTCAP=softcap is not None,
            DOT_PRECISION=_dot_precision(q.dtype), COUNT=count, TMA=q_arg is not None,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return tile_max


def _q_descriptor(q: torch.Tensor, block_m: int, block_d: int):
    """A TMA descriptor of q [Hq, T, D] (block [1, block_m, block_d]), or None where TMA cannot read q: it
    needs unit stride along D, 16-byte aligned base and strides, and a GPU that has it (sm_90+); the
    interpreter emulates it."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    esize = q.element_size()
    if q.stride(2) != 1 or q.data_ptr() % 16 or (q.stride(0) * esize) % 16 or (q.stride(1) * esize) % 16:
        return None
    if q.is_cuda and torch.cuda.get_device_capability(q.device)[0] < 9:
        return None
    return TensorDescriptor(q, list(q.shape), list(q.stride()), [1, block_m, block_d])


def _launch_mass(q, k, plan: PackPlan, lse: _Lse, tile_mass, page_mass, heads: range, *, scale, softcap) -> None:
    """The reader criterion's masses of heads `heads` into rows of tile_mass [Hq, sum P^2] / page_mass
    [Hq, sum P] fp32 (`_mass_kernel`; the stats pass's blocks, [queries, keys] scores, pointer loads)."""
    hq, _, d = q.shape
    cfg = plan.stats_cfg
    qk_mul, cap_mul = _score_muls(scale, softcap)
    tm, pm = tile_mass[heads.start:heads.stop], page_mass[heads.start:heads.stop]
    with _device_of(q):
        _mass_kernel[(len(heads) * plan.stats_blocks.shape[0],)](
            q, k, lse.tensor, tm, pm, plan.seq0, plan.doc_len, plan.tmax_off, plan.page_off, plan.stats_blocks,
            *q.stride(), *k.stride(), lse.tensor.stride(0), tm.stride(0), pm.stride(0),
            plan.docs.n_prefix, plan.docs.n_reader, heads.start, len(heads), qk_mul, cap_mul, lse.mul,
            GROUPS=hq // k.shape[0], HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), TILE=plan.docs.tile,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SOFTCAP=softcap is not None,
            DOT_PRECISION=_dot_precision(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )


def reader_masses(q: torch.Tensor, k: torch.Tensor, plan: PackPlan, *, scale: float, softcap: float | None = None,
                  lse: torch.Tensor | None = None, lse2: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reader criterion's masses of a pack whose sequences end with the reader (`plan.docs.n_reader > 0`):
    (tile masses [Hq, sum P^2], page masses [Hq, sum P]) fp32, as `reader_select.select_packed` reads them.
    q / k / lse / lse2 as `profile_packed`."""
    docs = plan.docs
    validate_profile_args(q, k, n_prefix=docs.n_prefix, tile=docs.tile, alpha=0.0, beta=0.0, gamma=0.0,
                          ca_normalize="causal")
    _check_kernel_inputs(q, k, scale=scale, softcap=softcap, lse=lse if lse is not None else lse2)
    if docs.n_reader < 1 or q.shape[1] != docs.total:
        raise ValueError(f"reader masses need a pack with the reader (n_reader={docs.n_reader}) and q of its "
                         f"{docs.total} rows; got q {tuple(q.shape)}")
    hq = q.shape[0]
    lse_in = _lse_input(lse, lse2, q, k, plan, scale=scale, softcap=softcap)
    tile_mass = torch.zeros(hq, plan.tmax_per_head, dtype=torch.float32, device=q.device)
    page_mass = torch.empty(hq, sum(docs.pages), dtype=torch.float32, device=q.device)
    _launch_mass(q, k, plan, lse_in, tile_mass, page_mass, range(hq), scale=scale, softcap=softcap)
    return tile_mass, page_mass


def _launch_bits(tile_max, key_counts, dense, la, ca, heads: range, plan: PackPlan, *, alpha, gamma,
                 ca_normalize, force_sink_page) -> None:
    """`finish_bits` as one kernel for every document of the pack: writes la[heads] / ca[heads] (rows of the
    layer's [Hq, la_total] / [Hq, ca_total] outputs).

    tile_max: [len(heads), sum P^2] fp32 (lower triangles read); key_counts: [Hq, T] int32; dense: [Hq] uint8
    (1 = dense head) or None.
    """
    with _device_of(tile_max):
        _bits_kernel[(plan.bits_progs.shape[0], len(heads))](
            tile_max, key_counts, dense if dense is not None else key_counts, la, ca, plan.seq0, plan.doc_len,
            plan.tmax_off, plan.la_off, plan.ca_off, plan.bits_progs,
            tile_max.stride(0), key_counts.stride(0), la.stride(0), ca.stride(0),
            plan.docs.n_prefix, heads.start, plan.n_la_progs, _fp32(alpha), _fp32(gamma),
            TILE=plan.docs.tile, LA_BYTES=LA_BYTES_PER_PROGRAM, CA_BYTES=plan.ca_per_program,
            KEY_INDEX=ca_normalize == "key_index", SINK=force_sink_page, HAS_DENSE=dense is not None,
            num_warps=4,
        )


def profile_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    plan: PackPlan,
    *,
    la_out: torch.Tensor,
    ca_out: torch.Tensor,
    scale: float,
    alpha: float,
    beta: float,
    gamma: float,
    softcap: float | None = None,
    ca_normalize: str = "causal",
    force_sink_page: bool = True,
    dense: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    lse2: torch.Tensor | None = None,
    stats_bytes: int = 256 << 20,
    criterion: str = "threshold",
    coverage: float = 0.95,
) -> None:
    """One layer's SIFT bits for every document of a pack, on the GPU; same meaning as `profile_packed_ref`.

    q: [Hq, T, D] rotated queries of the pack (`plan.docs`), k: [Hkv, T, D] rotated keys (Hq % Hkv == 0); any
    strides; fp32, fp16 or bf16. la_out / ca_out: uint8 [Hq, la_total] / [Hq, ca_total], written.
    dense: [Hq] uint8 flags on q's device (1: every bit of that head set), or None.
    lse / lse2: optional [Hq, T] row log-sum-exp of this layer's scores from the forward pass, natural log or log2
       (`attention_packed`); skips the first pass. Only document rows are read.
    stats_bytes: budget for the [heads, sum P^2] fp32 tile maxima; heads are processed in chunks that fit it.
    criterion: "threshold" (SPEC section 2's thresholds) or "reader" (the pack's sequences end with the reader,
       `plan.docs.n_reader`; `reader_masses` then `reader_select.select_packed` at `coverage`, every head at
       once; alpha, beta, gamma and ca_normalize are not read). The "mass" criterion runs on the reference only.
    """
    docs = plan.docs
    validate_profile_args(q, k, n_prefix=docs.n_prefix, tile=docs.tile, alpha=alpha, beta=beta, gamma=gamma,
                          ca_normalize=ca_normalize)
    validate_packed(q, k, docs, la_out, ca_out)
    validate_criterion(criterion, coverage, docs)
    if criterion == "mass":
        raise ValueError("criterion='mass' runs on the torch reference only (profile_packed_ref)")
    _check_kernel_inputs(q, k, scale=scale, softcap=softcap, lse=lse if lse is not None else lse2)
    hq = q.shape[0]
    if dense is not None and (dense.dtype != torch.uint8 or tuple(dense.shape) != (hq,) or dense.device != q.device):
        raise ValueError(f"dense must be uint8 [{hq}] flags on {q.device}; got {dense.dtype} {tuple(dense.shape)}")
    if criterion == "reader":
        tile_mass, page_mass = reader_masses(q, k, plan, scale=scale, softcap=softcap, lse=lse, lse2=lse2)
        kept, ca_kept = select_packed(tile_mass, page_mass, docs, coverage=coverage, force_sink_page=force_sink_page)
        if dense is not None:  # a dense head keeps every tile and page
            kept |= dense.bool()[:, None]
            ca_kept |= dense.bool()[:, None]
        finish_packed(tile_mass, None, docs, la_out=la_out, ca_out=ca_out, alpha=alpha, gamma=gamma,
                      ca_normalize=ca_normalize, force_sink_page=force_sink_page, kept=kept, ca_kept=ca_kept)
        return
    lse_in = _lse_input(lse, lse2, q, k, plan, scale=scale, softcap=softcap)
    key_counts = torch.empty(hq, docs.total, dtype=torch.int32, device=q.device)
    chunk = max(1, stats_bytes // (plan.tmax_per_head * 4))
    for h0 in range(0, hq, chunk):
        heads = range(h0, min(h0 + chunk, hq))
        tile_max = _launch_stats(q, k, plan, lse_in, key_counts, heads, beta=beta, scale=scale, softcap=softcap,
                                 zero_upper=False)
        _launch_bits(tile_max, key_counts, dense, la_out, ca_out, heads, plan, alpha=alpha, gamma=gamma,
                     ca_normalize=ca_normalize, force_sink_page=force_sink_page)


def dense_flags(dense_heads: Sequence[int], n_heads: int, device) -> torch.Tensor | None:
    """[n_heads] uint8 flags of the dense heads (None when there are none), for `profile_packed(dense=...)`."""
    bad = [h for h in dense_heads if not 0 <= int(h) < n_heads]
    if bad:
        raise ValueError(f"dense_heads {bad} out of range: heads are 0..{n_heads - 1}")
    if not dense_heads:
        return None
    flags = torch.zeros(n_heads, dtype=torch.uint8)
    flags[[int(h) for h in dense_heads]] = 1
    return flags.to(device)


def _one_doc(q, n_prefix: int, tile: int, configs) -> PackPlan:
    docs = PackedDocs(n_prefix, (q.shape[1] - n_prefix,), tile)
    return plan_pack(docs, head_dim=q.shape[-1], dtype=q.dtype, device=q.device, configs=configs)


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
    """The statistics behind `profile_layer`'s bits for one document, every query head (tests, debugging,
    benchmarks). q: [Hq, Lp, D], k: [Hkv, Lp, D] as in `profile_layer`. Holds all heads' tile maxima at once
    (O(Hq P^2)). configs: (first pass, stats pass) launch parameters; default `default_configs`.
    """
    validate_profile_args(q, k, n_prefix=n_prefix, tile=tile, alpha=0.0, beta=beta, gamma=0.0,
                          ca_normalize="causal")
    _check_kernel_inputs(q, k, scale=scale, softcap=softcap, lse=lse)
    plan = _one_doc(q, n_prefix, tile, configs)
    hq = q.shape[0]
    lse_in = _lse_input(lse, None, q, k, plan, scale=scale, softcap=softcap)
    key_counts = torch.empty(hq, q.shape[1], dtype=torch.int32, device=q.device)
    tile_max = _launch_stats(q, k, plan, lse_in, key_counts, range(hq), beta=beta, scale=scale, softcap=softcap)
    p = plan.docs.pages[0]
    doc_lse = lse_in.tensor[:, n_prefix:] * lse_in.mul / LOG2E
    return ProfileStats(tile_max=tile_max.view(hq, p, p), key_counts=key_counts[:, n_prefix:], lse=doc_lse)


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
    """One document's layer: its SIFT bits for every query head, on the GPU; same meaning as
    `profile_layer_ref` (a pack of one document, `profile_packed`).

    q: [Hq, Lp, D] rotated queries of (profiling prefix + document), Lp = n_prefix + L; k: [Hkv, Lp, D]
    rotated keys (Hq % Hkv == 0); any strides; fp32, fp16 or bf16.
    lse: optional [Hq, Lp] row log-sum-exp (natural log, fp32) of this layer's scores from the forward pass;
       skips the first pass. Only the document rows are read.
    stats_bytes: budget for the [heads, P, P] fp32 tile maxima; heads are processed in chunks that fit it.
    configs: launch parameters (first pass, stats pass); default `default_configs`.
    Returns (LayerBits(la [Hq, ceil(P(P+1)/2/8)] uint8, ca [Hq, ceil(P/8)] uint8), None).
    """
    validate_profile_args(q, k, n_prefix=n_prefix, tile=tile, alpha=alpha, beta=beta, gamma=gamma,
                          ca_normalize=ca_normalize)
    _check_kernel_inputs(q, k, scale=scale, softcap=softcap, lse=lse)
    dense = dense_flags(dense_heads, q.shape[0], q.device)
    plan = _one_doc(q, n_prefix, tile, configs)
    n_doc = q.shape[1] - n_prefix
    la = torch.empty(q.shape[0], la_nbytes(n_doc, tile), dtype=torch.uint8, device=q.device)
    ca = torch.empty(q.shape[0], ca_nbytes(n_doc, tile), dtype=torch.uint8, device=q.device)
    profile_packed(q, k, plan, la_out=la, ca_out=ca, scale=scale, alpha=alpha, beta=beta, gamma=gamma,
                   softcap=softcap, ca_normalize=ca_normalize, force_sink_page=force_sink_page, dense=dense,
                   lse=lse, stats_bytes=stats_bytes)
    return LayerBits(la=la, ca=ca), None
