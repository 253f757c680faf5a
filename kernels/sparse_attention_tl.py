"""The block-sparse prefill attention kernel in Triton's tile language: any CUDA GPU and the Triton interpreter.

The computation, the layout and the CSR are `sparse_attention`'s (module docstring there). RoPE, by block size
(`default_config`):
  "pre" (block 128): `rope.rotate_key_blocks` moves the layer's keys to logical positions in a transient buffer
      (one pass over K), the kernel rotates each Q tile once by its block's offset, and the attention loop is the
      pre-rotated one. The rotated Q tile goes through the program's own output rows, so the loop reads it from
      memory like a pre-rotated Q (a shared-memory MMA operand) instead of holding it in registers, which spill
      at 128 x 128;
  "k" (smaller blocks): each loaded K tile is rotated by delta in registers (LazyAttention), cos / sin kept while
      delta holds; the diagonal block (delta 0) is not rotated.
With inv_freq None the keys are already at logical positions and nothing is rotated.

APE (kernels/ape.py; `parallel` / `ape` given): the row's parallel-encoded key blocks run first, at temperature T
(their own online softmax); that part is then folded into the running state as one pseudo key of log-mass
S * T * lse_P and value o_P (m = S * T * lse_P, l = 1, acc = o_P), and the other blocks continue the same online
softmax: one accumulator, two passes over the row's indices (the second skips the blocks the first took).
Without APE the loops are the plain ones (a compile-time switch).

Arguments are validated by `sparse_attention.sparse_attention`, which picks this kernel when the Gluon Hopper
kernel does not take the call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .numerics import LOG2E
from .rope import _cos_sin, _rotate, rotate_key_blocks

# How the kernel applies RoPE (compile-time): keys already at logical positions; each K tile rotated by delta in
# the loop; keys rotated by the pass before the kernel and the Q tile once.
ROPE_NONE, ROPE_ON_K, ROPE_PRE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
ROPE_MODES = ("k", "pre")


@dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters of `_sparse_attn_fwd`; rope_on: "k" or "pre" (module docstring)."""

    num_warps: int
    num_stages: int
    rope_on: str


def default_config(block: int) -> AttentionConfig:
    """Tuned on the H200 (docs/design.md); the interpreter ignores warps and stages."""
    if block == 128:
        return AttentionConfig(num_warps=8, num_stages=2, rope_on="pre")
    return AttentionConfig(num_warps=4, num_stages=2, rope_on="k")


@triton.jit
def _key_scores(q, q1, q2, q_off, kb, last_delta, cos, sin, BlockOffset, InvFreq, k_ptr, stride_kd,
                HEAD_DIM: tl.constexpr, ROPE: tl.constexpr, DIAG: tl.constexpr, DOT_PRECISION: tl.constexpr,
                FAST_TRIG: tl.constexpr):
    """Scores [BLOCK, BLOCK] of the Q tile against key block kb (rows at k_ptr), RoPE applied as ROPE says.
    q: the whole tile (ROPE_NONE / ROPE_PRE); q1, q2: its halves (ROPE_ON_K). -> (s, last_delta, cos, sin)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_d = tl.arange(0, HEAD_DIM)
    offs_h = tl.arange(0, HALF)
    if ROPE == ROPE_NONE or ROPE == ROPE_PRE:
        k = tl.load(k_ptr + offs_d[None, :] * stride_kd)                      # [BLOCK, D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    else:
        k1 = tl.load(k_ptr + offs_h[None, :] * stride_kd)                     # [BLOCK, D/2]
        k2 = tl.load(k_ptr + (offs_h + HALF)[None, :] * stride_kd)
        if DIAG:
            # The query block's own block: delta == 0 and R(0) is the identity.
            s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
            s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PRECISION)
        else:
            # k' = R(delta) k; cos / sin recomputed only when delta changes.
            delta = tl.load(BlockOffset + kb) - q_off
            if delta != last_delta:
                cos, sin = _cos_sin(delta, InvFreq, offs_h, FAST_TRIG)
                last_delta = delta
            k1r, k2r = _rotate(k1, k2, cos, sin)
            s = tl.dot(q1, tl.trans(k1r), input_precision=DOT_PRECISION)
            s = tl.dot(q2, tl.trans(k2r), s, input_precision=DOT_PRECISION)
    return s, last_delta, cos, sin


@triton.jit
def _softmax_pv(s, m_i, l_i, acc, kb, qb, k_valid, v_ptr, stride_vd, qk_scale, BLOCK: tl.constexpr,
                HEAD_DIM: tl.constexpr, DIAG: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Mask the scores s of key block kb (values at v_ptr), then the online-softmax update and P @ V.
    DIAG: the query block's own block (causal mask by slot); otherwise only padding is masked."""
    offs_m = tl.arange(0, BLOCK)
    offs_n = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    if DIAG:
        # Row r sees slot c iff c <= r (and c < k_valid): the diagonal block is the query block itself.
        lim = tl.where(kb == qb, tl.minimum(offs_m, k_valid - 1), k_valid - 1)
        s = tl.where(offs_n[None, :] <= lim[:, None], s, float("-inf"))
    elif k_valid < BLOCK:
        # Only a segment's last block is partial: its padding slots (which may hold anything) are masked.
        s = tl.where((offs_n < k_valid)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    # Padding slots of V may hold anything (NaN too): zero them, since 0 * NaN would poison the row.
    v = tl.load(v_ptr + offs_d[None, :] * stride_vd, mask=offs_n[:, None] < k_valid, other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _tile(j, q, q1, q2, q_off, qb, last_delta, cos, sin, m_i, l_i, acc, Indices, BlockValid, BlockOffset, InvFreq,
          KVPages, k_head, v_head, stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, BLOCK: tl.constexpr,
          HEAD_DIM: tl.constexpr, ROPE: tl.constexpr, DIAG: tl.constexpr, DOT_PRECISION: tl.constexpr,
          FAST_TRIG: tl.constexpr, K_PAGED: tl.constexpr, V_PAGED: tl.constexpr):
    """Entry j of the CSR row: key block kb's scores, mask, online softmax and P @ V. K_PAGED / V_PAGED: the
    block's keys / values are in page KVPages[kb] of K / V, not in block kb."""
    kb = tl.load(Indices + j)
    k_valid = tl.load(BlockValid + kb)
    slot = (kb * BLOCK).to(tl.int64)
    if K_PAGED or V_PAGED:
        page = (tl.load(KVPages + kb) * BLOCK).to(tl.int64)
    else:
        page = slot
    k_slot = page if K_PAGED else slot
    v_slot = page if V_PAGED else slot
    s, last_delta, cos, sin = _key_scores(q, q1, q2, q_off, kb, last_delta, cos, sin, BlockOffset, InvFreq,
                                          k_head + k_slot * stride_kn, stride_kd, HEAD_DIM, ROPE, DIAG,
                                          DOT_PRECISION, FAST_TRIG)
    m_i, l_i, acc = _softmax_pv(s, m_i, l_i, acc, kb, qb, k_valid, v_head + v_slot * stride_vn, stride_vd,
                                qk_scale, BLOCK, HEAD_DIM, DIAG, DOT_PRECISION)
    return last_delta, cos, sin, m_i, l_i, acc


@triton.jit
def _sparse_attn_fwd(
    Q, K, V, Out,                      # q [Hq, N, D]; k, v [Hkv, N, D]; out [Hq, N, D]
    Indptr, RowEnd, Indices,           # int32 [Hq * NQ + 1], int32 [Hq * NQ] (row r ends there), int32 [nnz]
    BlockValid, BlockOffset,           # int32 [NB], int32 [NB]
    QBlocks,                           # int32 [NQ]: Q_BLOCKS: the block id of computed query block i
    QTokStart,                         # int32 [NB]: Q_TOKENS: row of q / out holding block b's first slot
    InvFreq,                           # float [D/2]: RoPE inverse frequencies (unused with ROPE_NONE)
    KVPages,                           # int32 [NB]: K_PAGED / V_PAGED: the page of K / V holding key block b
    stride_qh, stride_qn, stride_qd,
    stride_kh, stride_kn, stride_kd,
    stride_vh, stride_vn, stride_vd,
    stride_oh, stride_on, stride_od,
    Parallel,                          # int32 [NB]: APE: nonzero for key blocks of parallel-encoded context
    NQ, qk_scale,                      # query blocks computed (NB without Q_BLOCKS); qk_scale = scale * log2(e)
    ape_qk_scale, ape_mass,            # APE: qk_scale / T and S * T
    GROUP: tl.constexpr,               # Hq // Hkv
    BLOCK: tl.constexpr,               # layout block = query rows per program = key rows per step
    HEAD_DIM: tl.constexpr,
    ROPE: tl.constexpr,                # ROPE_NONE / ROPE_ON_K / ROPE_PRE
    Q_TOKENS: tl.constexpr,            # q / out hold real tokens only (no padding rows), block b from QTokStart[b]
    Q_BLOCKS: tl.constexpr,            # only the query blocks QBlocks[0 .. NQ - 1]; CSR row h * NQ + i
    DOT_PRECISION: tl.constexpr,       # "ieee" for fp32 inputs, "tf32" otherwise (ignored for 16-bit)
    FAST_TRIG: tl.constexpr,           # MUFU sin/cos (GPU); False in the interpreter
    K_PAGED: tl.constexpr,             # K is a pool of pages: key block b at page KVPages[b]
    V_PAGED: tl.constexpr,             # the same for V
    APE: tl.constexpr,                 # rescale the attention to the Parallel blocks (module docstring)
):
    HALF: tl.constexpr = HEAD_DIM // 2
    # Heads vary fastest, so programs of one kv group run together (K/V reuse in L2), and late query blocks,
    # which list the most key blocks (causality), are launched first to shorten the tail.
    h = tl.program_id(0)
    qi = NQ - 1 - tl.program_id(1)
    if Q_BLOCKS:
        qb = tl.load(QBlocks + qi)
    else:
        qb = qi
    kvh = h // GROUP

    row = h * NQ + qi
    start = tl.load(Indptr + row)
    end = tl.load(RowEnd + row)
    q_valid = tl.load(BlockValid + qb)
    # The row's diagonal entry (its last, rows ascend) gets the causal mask after the unmasked main loop.
    has_diag = end > start
    if has_diag:
        has_diag = tl.load(Indices + end - 1) == qb
    mid = tl.where(has_diag, end - 1, end)

    offs_m = tl.arange(0, BLOCK)
    offs_n = tl.arange(0, BLOCK)
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
    elif ROPE == ROPE_PRE:
        # Keys arrive at logical positions: rotate Q to its logical positions once (by the block's offset).
        q1 = tl.load(q_ptr + offs_h[None, :] * stride_qd)                     # [BLOCK, D/2]
        q2 = tl.load(q_ptr + (offs_h + HALF)[None, :] * stride_qd)
        cos_q, sin_q = _cos_sin(q_off, InvFreq, offs_h, FAST_TRIG)
        q1, q2 = _rotate(q1, q2, cos_q, sin_q)
        q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), [BLOCK, HEAD_DIM])  # [q1 | q2]
        # Round trip through this program's own output rows (module docstring).
        o_q = Out + h.to(tl.int64) * stride_oh + q_row0.to(tl.int64) * stride_on + offs_d[None, :] * stride_od
        tl.store(o_q + offs_m[:, None] * stride_on, q.to(Out.dtype.element_ty), mask=(offs_m < q_valid)[:, None])
        tl.debug_barrier()
        q = tl.load(o_q + tl.minimum(offs_m, tl.maximum(q_valid - 1, 0))[:, None] * stride_on).to(q.dtype)
        q1 = q   # unused below
        q2 = q
    else:
        q = tl.zeros([1], Q.dtype.element_ty)  # unused
        q1 = tl.load(q_ptr + offs_h[None, :] * stride_qd)                     # [BLOCK, D/2]
        q2 = tl.load(q_ptr + (offs_h + HALF)[None, :] * stride_qd)
    # cos/sin of the last delta (loop-carried). Initial delta 0: cos = 1, sin = 0.
    last_delta = tl.zeros([], tl.int32)
    cos = tl.full([HALF], 1.0, tl.float32)
    sin = tl.zeros([HALF], tl.float32)
    if APE:
        for j in range(start, mid):
            if tl.load(Parallel + tl.load(Indices + j)) != 0:
                last_delta, cos, sin, m_i, l_i, acc = _tile(
                    j, q, q1, q2, q_off, qb, last_delta, cos, sin, m_i, l_i, acc, Indices, BlockValid, BlockOffset,
                    InvFreq, KVPages, k_head, v_head, stride_kn, stride_kd, stride_vn, stride_vd, ape_qk_scale,
                    BLOCK, HEAD_DIM, ROPE, False, DOT_PRECISION, FAST_TRIG, K_PAGED, V_PAGED)
        # The context part as one pseudo key: log2-mass S * T * lse_P, value o_P; rows that saw none stay empty.
        seen = l_i > 0.0
        acc = acc / tl.where(seen, l_i, 1.0)[:, None]
        m_i = tl.where(seen, ape_mass * (m_i + tl.log2(tl.where(seen, l_i, 1.0))), m_i)
        l_i = tl.where(seen, 1.0, 0.0)
        for j in range(start, mid):
            if tl.load(Parallel + tl.load(Indices + j)) == 0:
                last_delta, cos, sin, m_i, l_i, acc = _tile(
                    j, q, q1, q2, q_off, qb, last_delta, cos, sin, m_i, l_i, acc, Indices, BlockValid, BlockOffset,
                    InvFreq, KVPages, k_head, v_head, stride_kn, stride_kd, stride_vn, stride_vd, qk_scale,
                    BLOCK, HEAD_DIM, ROPE, False, DOT_PRECISION, FAST_TRIG, K_PAGED, V_PAGED)
    else:
        for j in range(start, mid):
            last_delta, cos, sin, m_i, l_i, acc = _tile(
                j, q, q1, q2, q_off, qb, last_delta, cos, sin, m_i, l_i, acc, Indices, BlockValid, BlockOffset,
                InvFreq, KVPages, k_head, v_head, stride_kn, stride_kd, stride_vn, stride_vd, qk_scale,
                BLOCK, HEAD_DIM, ROPE, False, DOT_PRECISION, FAST_TRIG, K_PAGED, V_PAGED)
    for j in range(mid, end):
        last_delta, cos, sin, m_i, l_i, acc = _tile(
            j, q, q1, q2, q_off, qb, last_delta, cos, sin, m_i, l_i, acc, Indices, BlockValid, BlockOffset,
            InvFreq, KVPages, k_head, v_head, stride_kn, stride_kd, stride_vn, stride_vd, qk_scale,
            BLOCK, HEAD_DIM, ROPE, True, DOT_PRECISION, FAST_TRIG, K_PAGED, V_PAGED)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # rows that saw no key (empty CSR row) stay 0
    out = acc / l_i[:, None]
    o_ptr = Out + h.to(tl.int64) * stride_oh + q_row0.to(tl.int64) * stride_on
    o_ptrs = o_ptr + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od
    if Q_TOKENS:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m < q_valid)[:, None])
    else:
        out = tl.where((offs_m < q_valid)[:, None], out, 0.0)
        tl.store(o_ptrs, out.to(Out.dtype.element_ty))


def launch(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, *, scale, block, out, q_block_start=None,
           row_end=None, q_blocks=None, kv_pages=None, parallel=None, ape=None,
           config: AttentionConfig | None = None):
    """Run the kernel: the arguments of `sparse_attention.sparse_attention` (validated there), out allocated.
    config: launch parameters and RoPE mode (default `default_config(block)`). Returns out. With kv_pages, the
    "pre" key pass gathers the pages into its buffer as it rotates them; V (and K in the other modes) is read
    from its pages in place. parallel / ape: the APE option (validated by the caller)."""
    cfg = config or default_config(block)
    if cfg.rope_on not in ROPE_MODES:
        raise ValueError(f"rope_on={cfg.rope_on!r} is unknown; use one of {ROPE_MODES}")
    hq, d = q.shape[0], q.shape[2]
    nb = block_valid.numel()
    nq = nb if q_blocks is None else q_blocks.numel()
    k_paged = kv_pages is not None
    if inv_freq is None:
        rope, freq = ROPE_NONE.value, block_offset   # any pointer: not read
    else:
        rope = {"k": ROPE_ON_K, "pre": ROPE_PRE}[cfg.rope_on].value
        freq = inv_freq.to(q.device)
        if cfg.rope_on == "pre":  # one pass over K: keys to logical positions, in a transient buffer
            k = rotate_key_blocks(k, block_offset, freq, block=block, pages=kv_pages)
            k_paged = False
    _sparse_attn_fwd[(hq, nq)](
        q, k, v, out, indptr, indptr[1:] if row_end is None else row_end, indices, block_valid, block_offset,
        block_valid if q_blocks is None else q_blocks,                   # QBlocks: not read without Q_BLOCKS
        block_valid if q_block_start is None else q_block_start, freq,   # QTokStart: not read without Q_TOKENS
        block_valid if kv_pages is None else kv_pages,                   # KVPages: not read unpaged
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        block_valid if parallel is None else parallel,                   # Parallel: not read without APE
        nq, float(scale) * LOG2E,
        float(scale) * LOG2E / (ape[0] if ape else 1.0), (ape[0] * ape[1]) if ape else 1.0,
        GROUP=hq // k.shape[0], BLOCK=block, HEAD_DIM=d, ROPE=rope, Q_TOKENS=q_block_start is not None,
        Q_BLOCKS=q_blocks is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FAST_TRIG=q.device.type == "cuda",
        K_PAGED=k_paged, V_PAGED=kv_pages is not None, APE=ape is not None, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
