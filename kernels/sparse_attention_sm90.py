"""Hopper (sm_90) block-sparse prefill attention in Gluon: warp-specialised, TMA-fed, wgmma, persistent.

The same computation as `sparse_attention._sparse_attn_fwd` with `rope_on="pre"` or pre-rotated keys (module
docstring there: CSR rows of key blocks per (head, query block), causal diagonal block, padding never attended),
written with explicit Hopper machinery because the tl kernel's single-partition FA2 loop stops at ~470 TFLOP/s
dense on the H200 while cuDNN reaches ~600 (bench/README_attention.md):

  * one producer warp issues TMA loads: each tile's Q (two 64-row halves) into `q_raw`, then the K and V blocks
    listed by the tile's CSR row into a ring of STAGES buffers, signalled by mbarriers;
  * two consumer warpgroups, one per 64-row half of the 128-row query block, share the K/V ring. Each rotates its
    Q half once to logical positions (RoPE by the block's offset; keys arrive at logical positions from
    `rotate_key_blocks`) into `q_smem`, then runs the FA3 in-warpgroup pipeline: S_j = Q K_j^T is issued
    asynchronously before O += P_{j-1} V_{j-1}, and the softmax of S_j runs while that product is in flight;
  * the grid is persistent (one CTA per SM) and dynamic: the producer draws the next tile (head, query block)
    from a global counter and hands its number to the consumers through shared memory, so a CTA that drew long
    rows takes fewer tiles, and it prefetches the next tile's Q and K while the consumers finish the current one.
    Tiles go KV head by KV head (the CTAs running at once share one KV head's K / V in L2), late query blocks (the
    longest rows) first (`_tile_coords`).

Not runnable in the Triton interpreter: CI compiles it for sm_90 (tests/test_sparse_attention_sm90.py) and the
H200 run compares it with `sparse_attention_ref` (bench/bench_attention.py). Supported: block 128, head_dim 128,
fp16 / bf16; `supports()` says when, and `sparse_attention` falls back to the tl kernel otherwise.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra import libdevice

BLOCK = gl.constexpr(128)  # layout block = query rows per tile = key rows per K/V buffer
ROWS = gl.constexpr(64)    # query rows per consumer warpgroup
_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
# Launch shape: the default partition (consumer warpgroup 0) has NUM_WARPS warps, plus a 4-warp consumer and a
# 1-warp producer = 12 warps after rounding; MAXNREG * 384 threads fits the SM's 64K registers, and the
# partitions rebalance to 240 / 240 / 24 registers (setmaxnreg).
NUM_WARPS, MAXNREG = 4, 168


@gluon.jit
def _q_angles(q_off, turns_smem, HEAD_DIM: gl.constexpr):
    """cos, sin [1, D/2] of the query block's offset (fp64 turns reduced to one period, then fp32): computed
    before Q arrives, from the turns staged in shared memory, so no global load sits at a tile's start."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    t = q_off.to(gl.float64) * turns_smem.load(gl.SliceLayout(0, layout))
    t = t - gl.floor(t + 0.5)
    angle = t.to(gl.float32) * 6.283185307179586
    return libdevice.fast_cosf(angle)[None, :], libdevice.fast_sinf(angle)[None, :]  # |angle| <= pi: ~5e-7


@gluon.jit
def _rotate_q_half(q_raw, q_smem, cos, sin, ROPE: gl.constexpr, HEAD_DIM: gl.constexpr):
    """q_smem = R(q_off) q_raw for one 64-row half (rotate_half RoPE by the angles of `_q_angles`)."""
    HALF: gl.constexpr = HEAD_DIM // 2
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    x1 = q_raw.slice(0, HALF, dim=1).load(layout)
    x2 = q_raw.slice(HALF, HALF, dim=1).load(layout)
    if ROPE:
        x1f = x1.to(gl.float32)
        x2f = x2.to(gl.float32)
        x1 = (x1f * cos - x2f * sin).to(x1.dtype)
        x2 = (x2f * cos + x1f * sin).to(x2.dtype)
    q_smem.slice(0, HALF, dim=1).store(x1)
    q_smem.slice(HALF, HALF, dim=1).store(x2)


@gluon.jit
def _zero_v_padding(v_buf, k_valid, HEAD_DIM: gl.constexpr):
    """Rows >= k_valid of a partial V block may hold anything (NaN too) and 0 * NaN poisons P @ V: zero them in
    shared memory (rare: only a segment's last block). Both warpgroups write the same zeros."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    v = v_buf.load(layout)
    rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
    v_buf.store(gl.where((rows < k_valid)[:, None], v, gl.zeros_like(v)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _softmax_step(s, m_i, l_i, kb, qb, k_valid, offs_m, offs_n, qk_scale):
    """Mask (diagonal block: causal by slot; partial block: padding slots) and the online-softmax update."""
    if (kb == qb) | (k_valid < BLOCK):
        lim = gl.where(kb == qb, gl.minimum(offs_m, k_valid - 1), k_valid - 1)
        s = gl.where(offs_n[None, :] <= lim[:, None], s, gl.full_like(s, float("-inf")))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _tile_coords(t, n_heads, NB, band, sec, GROUP: gl.constexpr):
    """Tile t -> (query head, query block). Query blocks go in bands of `band` from the last (longest rows first:
    a long row started late is a tail); inside a band, sections of `sec` KV heads, then query blocks from the
    last, then the sec * GROUP query heads fastest. band = NB, sec = Hkv: every head of one query block together;
    small sec: the CTAs running at once share few KV heads' K / V in L2."""
    b = t // (band * n_heads)
    r = t - b * band * n_heads
    bsize = gl.minimum(band, NB - b * band)
    width = sec * GROUP
    sec_tiles = bsize * width
    si = r // sec_tiles
    r2 = r - si * sec_tiles
    qb = NB - 1 - b * band - r2 // width
    h = si * width + r2 % width
    return h, qb


@gluon.jit
def _tile_row(t, Indptr, RowEnd, QTokStart, n_heads, NB, band, sec, GROUP: gl.constexpr, Q_TOKENS: gl.constexpr):
    """Tile t -> (head, query block, its CSR row's [start, end), the q / out row of the block's first slot)."""
    h, qb = _tile_coords(t, n_heads, NB, band, sec, GROUP)
    row = h * NB + qb
    if Q_TOKENS:
        q_row0 = gl.load(QTokStart + qb)
    else:
        q_row0 = qb * BLOCK
    return h, qb, gl.load(Indptr + row), gl.load(RowEnd + row), q_row0


@gluon.jit
def _consumer(q_desc, k_desc, v_desc, bufs, bars, Out, Indptr, RowEnd, Indices, BlockValid, BlockOffset, QTokStart,
              Turns, Counter, n_heads, NB, n_q, n_k, band, sec, stride_oh, stride_on, qk_scale,
              GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, ROPE: gl.constexpr,
              Q_TOKENS: gl.constexpr, QHR: gl.constexpr, KHR: gl.constexpr, DYNAMIC: gl.constexpr,
              WG: gl.constexpr):
    q_raw, q_smem, k_bufs, v_bufs, sched, turns_smem = bufs
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = bars
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    offs_m = WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    offs_n = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, s_layout))
    offs_mo = WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    zero_s = gl.zeros([ROWS, BLOCK], gl.float32, s_layout)
    q_s = q_smem.index(WG)

    sched_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    it = 0
    tcount = 0
    mbarrier.wait(q_ready, 0)
    t = gl.max(sched.index(0).load(sched_layout), 0)   # the producer's tile number (>= n_tiles: done)
    while t < n_heads * NB:
        h, qb, start, end, q_row0 = _tile_row(t, Indptr, RowEnd, QTokStart, n_heads, NB, band, sec, GROUP, Q_TOKENS)
        q_valid = gl.load(BlockValid + qb)

        cos, sin = _q_angles(gl.load(BlockOffset + qb), turns_smem, HEAD_DIM)
        mbarrier.wait(q_ready, tcount & 1)
        _rotate_q_half(q_raw.index(WG), q_s, cos, sin, ROPE, HEAD_DIM)
        fence_async_shared()
        gl.thread_barrier()                     # every warp's Q rows are in q_smem and q_raw is read
        mbarrier.arrive(q_empty, count=1)

        m_i = gl.full([ROWS], -1.0e30, gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
        n = end - start
        if n > 0:
            # First key block: S_0 and its softmax, nothing to overlap yet.
            idx = it % STAGES
            ph = (it // STAGES) & 1
            kb = gl.load(Indices + start)
            k_valid = gl.load(BlockValid + kb)
            mbarrier.wait(k_ready.index(idx), ph)
            s = warpgroup_mma(q_s, k_bufs.index(idx).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s])
            mbarrier.arrive(k_empty.index(idx), count=1)
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, kb, qb, k_valid, offs_m, offs_n, qk_scale)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            prev, prev_ph, prev_valid = idx, ph, k_valid
            for j in range(1, n):
                idx = (it + j) % STAGES
                ph = ((it + j) // STAGES) & 1
                kb = gl.load(Indices + start + j)
                k_valid = gl.load(BlockValid + kb)
                mbarrier.wait(k_ready.index(idx), ph)
                s = warpgroup_mma(q_s, k_bufs.index(idx).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                mbarrier.wait(v_ready.index(prev), prev_ph)
                if prev_valid < BLOCK:
                    _zero_v_padding(v_bufs.index(prev), prev_valid, HEAD_DIM)
                acc = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
                s = warpgroup_mma_wait(1, deps=[s])          # S_j done; P_{j-1} V_{j-1} may still run
                mbarrier.arrive(k_empty.index(idx), count=1)
                p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, kb, qb, k_valid, offs_m, offs_n, qk_scale)
                acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
                mbarrier.arrive(v_empty.index(prev), count=1)
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                prev, prev_ph, prev_valid = idx, ph, k_valid
            mbarrier.wait(v_ready.index(prev), prev_ph)
            if prev_valid < BLOCK:
                _zero_v_padding(v_bufs.index(prev), prev_valid, HEAD_DIM)
            acc = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
            acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
            mbarrier.arrive(v_empty.index(prev), count=1)
            it += n

        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        l_o = gl.where(l_o == 0.0, 1.0, l_o)     # rows that saw no key (empty CSR row) stay 0
        out = (acc / l_o[:, None]).to(dtype)
        ptrs = (Out + h.to(gl.int64) * stride_oh + (q_row0 + offs_mo).to(gl.int64)[:, None] * stride_on
                + offs_d[None, :])
        if Q_TOKENS:
            gl.store(ptrs, out, mask=(offs_mo < q_valid)[:, None])
        else:
            gl.store(ptrs, gl.where((offs_mo < q_valid)[:, None], out, gl.zeros_like(out)))
        tcount += 1
        mbarrier.wait(q_ready, tcount & 1)
        t = gl.max(sched.index(tcount & 1).load(sched_layout), 0)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, bufs, bars, Out, Indptr, RowEnd, Indices, BlockValid, BlockOffset, QTokStart,
              Turns, Counter, n_heads, NB, n_q, n_k, band, sec, stride_oh, stride_on, qk_scale,
              GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, ROPE: gl.constexpr,
              Q_TOKENS: gl.constexpr, QHR: gl.constexpr, KHR: gl.constexpr, DYNAMIC: gl.constexpr,
              WG: gl.constexpr):
    q_raw, q_smem, k_bufs, v_bufs, sched, turns_smem = bufs
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = bars
    sched_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    n_tiles = n_heads * NB
    it = 0
    tcount = 0
    t = gl.program_id(0)
    while t < n_tiles:
        h, qb, start, end, q_row0 = _tile_row(t, Indptr, RowEnd, QTokStart, n_heads, NB, band, sec, GROUP, Q_TOKENS)
        kvh = h // GROUP
        # Heads along rows ([H * N, D] view) or along columns ([N, H * D] view).
        if QHR:
            q_r, q_c = h * n_q + q_row0, 0
        else:
            q_r, q_c = q_row0, h * HEAD_DIM
        if KHR:
            k_r, k_c = kvh * n_k, 0
        else:
            k_r, k_c = 0, kvh * HEAD_DIM

        mbarrier.wait(q_empty, (tcount & 1) ^ 1)
        # Publish the tile number; the expect's arrive releases it to the consumers' wait on q_ready.
        sched.index(tcount & 1).store(gl.full([1], t, gl.int32, sched_layout))
        mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_r, q_c], q_ready, q_raw.index(0))
        tma.async_copy_global_to_shared(q_desc, [q_r + ROWS, q_c], q_ready, q_raw.index(1))
        for e in range(start, end):
            kb = gl.load(Indices + e)
            idx = it % STAGES
            ph = (it // STAGES) & 1
            mbarrier.wait(k_empty.index(idx), ph ^ 1)
            mbarrier.expect(k_ready.index(idx), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [k_r + kb * BLOCK, k_c], k_ready.index(idx), k_bufs.index(idx))
            mbarrier.wait(v_empty.index(idx), ph ^ 1)
            mbarrier.expect(v_ready.index(idx), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [k_r + kb * BLOCK, k_c], v_ready.index(idx), v_bufs.index(idx))
            it += 1
        tcount += 1
        if DYNAMIC:   # next tile from the global counter: a CTA that drew long rows takes fewer tiles
            t = gl.num_programs(0) + gl.atomic_add(Counter, 1)
        else:
            t += gl.num_programs(0)
    mbarrier.wait(q_empty, (tcount & 1) ^ 1)
    sched.index(tcount & 1).store(gl.full([1], t, gl.int32, sched_layout))
    mbarrier.arrive(q_ready, count=1)   # no Q: the consumers read t >= n_tiles and stop


@gluon.jit
def _sparse_attn_fwd_sm90(q_desc, k_desc, v_desc, Out, Indptr, RowEnd, Indices, BlockValid, BlockOffset, QTokStart,
                          Turns, Counter, n_heads, NB, n_q, n_k, band, sec, stride_oh, stride_on, qk_scale,
                          GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, ROPE: gl.constexpr,
                          Q_TOKENS: gl.constexpr, QHR: gl.constexpr, KHR: gl.constexpr, DYNAMIC: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    q_raw = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK, HEAD_DIM], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_empty, count=2)           # one arrival per consumer warpgroup
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    sched = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    turns_smem = gl.allocate_shared_memory(gl.float64, [HEAD_DIM // 2], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    turns_smem.store(gl.load(Turns + gl.arange(0, HEAD_DIM // 2, layout=gl.BlockedLayout([1], [32], [4], [0]))))
    bufs = (q_raw, q_smem, k_bufs, v_bufs, sched, turns_smem)
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty)
    gl.warp_specialize([
        (_consumer, (q_desc, k_desc, v_desc, bufs, bars, Out, Indptr, RowEnd, Indices, BlockValid, BlockOffset,
                     QTokStart, Turns, Counter, n_heads, NB, n_q, n_k, band, sec, stride_oh, stride_on, qk_scale,
                     GROUP, HEAD_DIM, STAGES, ROPE, Q_TOKENS, QHR, KHR, DYNAMIC, 0)),
        (_consumer, (q_desc, k_desc, v_desc, bufs, bars, Out, Indptr, RowEnd, Indices, BlockValid, BlockOffset,
                     QTokStart, Turns, Counter, n_heads, NB, n_q, n_k, band, sec, stride_oh, stride_on, qk_scale,
                     GROUP, HEAD_DIM, STAGES, ROPE, Q_TOKENS, QHR, KHR, DYNAMIC, 1)),
        (_producer, (q_desc, k_desc, v_desc, bufs, bars, Out, Indptr, RowEnd, Indices, BlockValid, BlockOffset,
                     QTokStart, Turns, Counter, n_heads, NB, n_q, n_k, band, sec, stride_oh, stride_on, qk_scale,
                     GROUP, HEAD_DIM, STAGES, ROPE, Q_TOKENS, QHR, KHR, DYNAMIC, 0)),
    ], [4, 1], [240, 24])


def _head_view(x: torch.Tensor):
    """[H, N, D] with unit last stride -> (2-D view, heads along rows?) for a TMA descriptor, or None.
    Heads along rows: x[h] rows are contiguous blocks of one [H * N, D] matrix; along columns: x is the transpose
    view of an [N, H, D] buffer (the model's projections), one [N, H * D] matrix."""
    h, n, d = x.shape
    if x.stride(2) != 1:
        return None
    if x.stride(0) == n * x.stride(1) and x.stride(1) == d:
        return x.reshape(h * n, d), True
    if x.stride(0) == d and x.stride(1) == h * d:
        return torch.as_strided(x, (n, h * d), (h * d, 1)), False
    return None


def supports(q, k, v, block: int, out: torch.Tensor | None) -> bool:
    """Whether this kernel takes the call: an sm_90 device, block 128, head_dim 128, fp16 / bf16, q / k / v
    viewable as 2-D TMA matrices (`_head_view`), out with unit last stride."""
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    if block != BLOCK.value or q.shape[2] != 128 or q.dtype not in _GL_DTYPES:
        return False
    if out is not None and out.stride(2) != 1:
        return False
    return all(_head_view(x) is not None for x in (q, k, v))


_SM_COUNT: dict[int, int] = {}


def launch(q, k, v, out, indptr, row_end, indices, block_valid, block_offset, tok_start, turns, *, scale_log2: float,
           rope: bool, q_tokens: bool, stages: int = 2, band: int | None = None, sec: int | None = 1,
           dynamic: bool = True):
    """Run the kernel (arguments validated and prepared by `sparse_attention._launch`). k at logical positions.
    Tile order (`_tile_coords`): bands of `band` query blocks (None: one band), sections of `sec` KV heads
    (None: all); dynamic: CTAs draw tiles from a global counter. Default (one band, one KV head per section,
    dynamic) measured best on the H200 (bench/README_attention.md, check_sm90 run 5): mask (a) 0.83 / 2.08 /
    5.82 ms at 16K / 32K / 64K against 0.80 / 2.17 / 6.45 with all heads of a query block together."""
    hq, _, d = q.shape
    nb = k.shape[1] // BLOCK.value
    dt = _GL_DTYPES[q.dtype]
    (q2, q_rows), (k2, k_rows), (v2, v_rows) = _head_view(q), _head_view(k), _head_view(v)
    if k_rows != v_rows:  # one coordinate rule serves K and V
        v2, v_rows = v.contiguous().reshape(-1, d), True
        if not k_rows:
            k2, k_rows = k.contiguous().reshape(-1, d), True
    rows, block = ROWS.value, BLOCK.value
    q_desc = TensorDescriptor.from_tensor(q2, [rows, d], gl.NVMMASharedLayout.get_default_for([rows, d], dt))
    kv_layout = gl.NVMMASharedLayout.get_default_for([block, d], dt)
    k_desc = TensorDescriptor.from_tensor(k2, [block, d], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v2, [block, d], kv_layout)
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if dev not in _SM_COUNT:
        _SM_COUNT[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    grid = (min(_SM_COUNT[dev], hq * nb), )
    _sparse_attn_fwd_sm90[grid](
        q_desc, k_desc, v_desc, out, indptr, row_end, indices, block_valid, block_offset, tok_start, turns,
        torch.zeros(1, dtype=torch.int32, device=q.device),
        hq, nb, q.shape[1], k.shape[1], min(band or nb, nb), sec or k.shape[0], out.stride(0), out.stride(1),
        scale_log2,
        GROUP=hq // k.shape[0], HEAD_DIM=d, STAGES=stages, ROPE=rope, Q_TOKENS=q_tokens, QHR=q_rows, KHR=k_rows, DYNAMIC=dynamic,
        num_warps=NUM_WARPS, maxnreg=MAXNREG)
    return out


def compile_for_sm90(*, rope: bool = True, q_tokens: bool = True, q_rows: bool = False, k_rows: bool = True,
                     group: int = 4, stages: int = 2, dtype: torch.dtype = torch.bfloat16):
    """Compile the kernel for sm_90 on any machine (no GPU needed: Triton's bundled ptxas) and return the
    CompiledKernel (`.metadata.shared` bytes, `.asm["ptx"]`, `.asm["cubin"]`). Used by CI to keep the kernel
    compiling and within shared memory, and by bench/aot_sm90.py for register / spill reports."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    dt = _GL_DTYPES[dtype]
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    ql = gl.NVMMASharedLayout.get_default_for([ROWS.value, 128], dt)
    kl = gl.NVMMASharedLayout.get_default_for([BLOCK.value, 128], dt)
    sig = {"q_desc": f"tensordesc<{name}[{ROWS.value}, 128],{ql!r}>",
           "k_desc": f"tensordesc<{name}[{BLOCK.value}, 128],{kl!r}>",
           "v_desc": f"tensordesc<{name}[{BLOCK.value}, 128],{kl!r}>", "Out": f"*{name}"}
    sig.update({p: "*i32" for p in ("Indptr", "RowEnd", "Indices", "BlockValid", "BlockOffset", "QTokStart",
                                    "Counter")})
    sig.update(Turns="*fp64", qk_scale="fp32")
    sig.update({p: "i32" for p in ("n_heads", "NB", "n_q", "n_k", "band", "sec", "stride_oh", "stride_on")})
    const = dict(GROUP=group, HEAD_DIM=128, STAGES=stages, ROPE=rope, Q_TOKENS=q_tokens, QHR=q_rows, KHR=k_rows,
                 DYNAMIC=True)
    sig.update({p: "constexpr" for p in const})
    missing = set(_sparse_attn_fwd_sm90.arg_names) - set(sig)
    if missing:
        raise RuntimeError(f"compile_for_sm90 does not know the kernel arguments {sorted(missing)}")
    target = GPUTarget("cuda", 90, 32)
    options = triton.compiler.make_backend(target).parse_options(dict(num_warps=NUM_WARPS, maxnreg=MAXNREG))
    return triton.compile(GluonASTSource(fn=_sparse_attn_fwd_sm90, signature=sig, constexprs=const), target=target,
                          options=options.__dict__)
