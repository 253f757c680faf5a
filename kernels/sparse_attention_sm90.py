"""Hopper (sm_90) block-sparse prefill attention in Gluon: warp-specialised, TMA-fed, wgmma, persistent.

The computation of `sparse_attention` (module docstring there: CSR rows of key blocks per (head, query block),
causal diagonal block, padding never attended) with keys at logical positions, written with explicit Hopper
machinery because a single-partition FA2 loop in Triton's tile language stops well short of cuDNN's dense
throughput on Hopper (docs/design.md):

  * one producer warp issues TMA loads: each tile's Q (two 64-row halves) into `q_raws`, then the K and V blocks
    listed by the tile's CSR row into rings of K_STAGES / STAGES buffers, signalled by mbarriers. K runs one
    block ahead of V, and each K entry carries its block id and valid slots in shared memory (`kinfo`), so the
    consumers do no global load per block; the tile number and the query offset travel the same way (`sched`);
  * two consumer warpgroups, one per 64-row half of the 128-row query block, share the K/V rings and run the FA3
    in-warpgroup pipeline: S_j = Q K_j^T is issued asynchronously before O += P_{j-1} V_{j-1}, and the softmax
    of S_j runs while that product is in flight. While a tile's last P V runs, each moves its half of the next
    tile's Q to logical positions (RoPE by the query block's offset; keys arrive at logical positions from
    `rope.rotate_key_blocks`) from `q_raws` into `q_rots`, so no rotation sits at a tile's start;
  * the grid is persistent (one CTA per SM) and dynamic: the producer draws the next tile (head, query block)
    from a global counter and hands its number to the consumers through shared memory, so a CTA that drew long
    rows takes fewer tiles, and it prefetches the next tile's Q and K while the consumers finish the current one.
    Tiles go KV head by KV head (the CTAs running at once share one KV head's K / V in L2), late query blocks (the
    longest rows) first (`_tile_coords`). With `q_blocks` only the listed query blocks are tiles (the Q_BLOCKS
    variant); the cos | sin table of the key pass stays indexed by block id.

Keys come from the pass, not rotated in this kernel: rotating the query tile by -delta on each change of segment,
or each key block in shared memory, costs a 128 x 128 rotation on the CUDA cores per (tile, block), a large share
of what the tensor cores need for the block's two products, where the pass rotates each key block once per layer
(about one copy of K). Rotating each block once inside this kernel, in a background partition, is no faster than
the pass.

Not runnable in the Triton interpreter: CI compiles it for sm_90 (tests/test_sparse_attention_sm90.py) and
bench/check_sm90.py compares it with `sparse_attention_ref` on a GPU. Supported: block 128, head_dim 128,
fp16 / bf16; `supports()` says when, and `sparse_attention` picks the tl kernel otherwise.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .device import sm_count
from .layout import gather_blocks
from .numerics import LOG2E
from .rope import rotate_key_blocks

BLOCK = gl.constexpr(128)  # layout block = query rows per tile = key rows per K/V buffer
ROWS = gl.constexpr(64)    # query rows per consumer warpgroup
# Ring depths: K runs one block ahead of V, so its ring is one deeper (with the four Q half-buffers: 230 KB of
# shared memory).
K_STAGES = gl.constexpr(3)
STAGES = gl.constexpr(2)
_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
# Launch shape: the default partition (consumer warpgroup 0) has NUM_WARPS warps, plus a 4-warp consumer and a
# 1-warp producer = 12 warps after rounding; MAXNREG * 384 threads fits the SM's 64K registers, and the
# partitions rebalance to 240 / 240 / 24 registers (setmaxnreg).
NUM_WARPS, MAXNREG = 4, 168


@gluon.jit
def _rotate_q(q_raw, q_rot, cs_smem, ROPE: gl.constexpr, HEAD_DIM: gl.constexpr):
    """q_rot = R(offset) q_raw for one consumer's Q half [ROWS, D]: the queries, stored rotated at segment-local
    positions, moved to logical positions (a copy without RoPE). Every load before every store (the compiler
    puts a warpgroup barrier between a shared-memory read and a write). cos | sin of the query block's offset
    come from `cs_smem` (the producer copies the block's row of the table the key pass writes: no angle
    arithmetic here). Packed 16-bit arithmetic (HMUL2 / HFMA2, two elements per instruction, no unpacking to
    fp32: about a quarter of the fp32 version's instructions), cos / sin rounded to q's dtype, two roundings per
    element: as accurate as the model's own RoPE, which transformers applies in q's dtype with cos / sin cast to
    it (bf16, offsets 3 / 2048 / 70000: mean relative error 1.6 / 2.0 / 2.0e-3 against 1.7 / 2.3 / 2.3e-3 for
    that, 1.2 / 1.4 / 1.4e-3 in fp32)."""
    HALF: gl.constexpr = HEAD_DIM // 2
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    x1 = q_raw.slice(0, HALF, dim=1).load(layout)
    x2 = q_raw.slice(HALF, HALF, dim=1).load(layout)
    if ROPE:
        cos = cs_smem.slice(0, HALF).load(gl.SliceLayout(0, layout))[None, :]
        sin = cs_smem.slice(HALF, HALF).load(gl.SliceLayout(0, layout))[None, :]
        cos = cos.to(x1.dtype)
        sin = sin.to(x1.dtype)
        y1 = gl.fma(x2, -sin, x1 * cos)
        x2 = gl.fma(x1, sin, x2 * cos)
        x1 = y1
    q_rot.slice(0, HALF, dim=1).store(x1)
    q_rot.slice(HALF, HALF, dim=1).store(x2)


@gluon.jit
def _block_info(kinfo, slot):
    """The two words of entry `slot` of a small producer -> consumer table in shared memory: (key block id, its
    valid slots) of a K ring entry, or (tile number, query offset) of a Q slot."""
    layout: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])   # every thread holds both words
    info = kinfo.index(slot).load(layout)
    r = gl.arange(0, 2, layout=layout)
    return gl.sum(gl.where(r == 0, info, 0), 0), gl.sum(gl.where(r == 1, info, 0), 0)


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
def _tile_coords(t, NQ, GROUP: gl.constexpr):
    """Tile t -> (query head, computed query block i in [0, NQ)): KV head by KV head (the CTAs running at once
    share one KV head's K / V in L2), inside one the query blocks from the last (longest rows first: a long row
    started late is a tail), the GROUP query heads of the KV head fastest."""
    per_kv = NQ * GROUP
    kvh = t // per_kv
    r = t - kvh * per_kv
    return kvh * GROUP + r % GROUP, NQ - 1 - r // GROUP


@gluon.jit
def _tile_row(t, Indptr, RowEnd, QBlocks, QTokStart, n_heads, NQ, GROUP: gl.constexpr, Q_TOKENS: gl.constexpr,
              Q_BLOCKS: gl.constexpr):
    """Tile t -> (head, query block id, its CSR row's [start, end), the q / out row of the block's first slot).
    Q_BLOCKS: the tile's block is QBlocks[i] (only those blocks are computed); otherwise i itself."""
    h, i = _tile_coords(t, NQ, GROUP)
    row = h * NQ + i
    if Q_BLOCKS:
        qb = gl.load(QBlocks + i)
    else:
        qb = i
    if Q_TOKENS:
        q_row0 = gl.load(QTokStart + qb)
    else:
        q_row0 = qb * BLOCK
    return h, qb, gl.load(Indptr + row), gl.load(RowEnd + row), q_row0


@gluon.jit
def _next_tile(tcount, q_raws, q_rots, sched, cs_smem, q_ready, q_empty, Indptr, RowEnd, QBlocks, QTokStart,
               n_heads, NQ, GROUP: gl.constexpr, ROPE: gl.constexpr, Q_TOKENS: gl.constexpr,
               Q_BLOCKS: gl.constexpr, WG: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Take the next tile from the producer (its Q is usually in `q_raws` already: the producer runs ahead) and
    move this warpgroup's Q half to logical positions in `q_rots` (free: every S of the previous tile is done;
    called while the previous tile's last P V runs), then release `q_raws` for the tile after."""
    mbarrier.wait(q_ready, tcount & 1)
    t, _ = _block_info(sched, tcount & 1)   # tile number (>= n_tiles: done)
    h, qb, start, end, q_row0 = _tile_row(gl.minimum(t, n_heads * NQ - 1), Indptr, RowEnd, QBlocks, QTokStart,
                                          n_heads, NQ, GROUP, Q_TOKENS, Q_BLOCKS)
    if t < n_heads * NQ:
        _rotate_q(q_raws.index(WG), q_rots.index(WG), cs_smem, ROPE, HEAD_DIM)
        fence_async_shared()
        gl.thread_barrier()   # every warp's rows are in q_rots (for the wgmma) and q_raws is read
    mbarrier.arrive(q_empty, count=1)
    return t, h, qb, start, end, q_row0


@gluon.jit
def _consumer(q_desc, k_desc, v_desc, bufs, bars, Out, Indptr, RowEnd, Indices, BlockValid, BlockOffset, QBlocks,
              QTokStart, KVPages, CosSin, Counter, n_heads, NQ, n_q, n_k, stride_oh, stride_on, qk_scale,
              GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, ROPE: gl.constexpr, Q_TOKENS: gl.constexpr,
              Q_BLOCKS: gl.constexpr, QHR: gl.constexpr, KHR: gl.constexpr, K_PAGED: gl.constexpr,
              V_PAGED: gl.constexpr, WG: gl.constexpr):
    q_raws, q_rots, k_bufs, v_bufs, kinfo, sched, cs_smem = bufs
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
    q_s = q_rots.index(WG)

    it = 0           # key blocks used so far (all tiles of this CTA, in the producer's order)
    tcount = 0
    t, h, qb, start, end, q_row0 = _next_tile(tcount, q_raws, q_rots, sched, cs_smem, q_ready, q_empty, Indptr,
                                              RowEnd, QBlocks, QTokStart, n_heads, NQ, GROUP, ROPE,
                                              Q_TOKENS, Q_BLOCKS, WG, HEAD_DIM)
    while t < n_heads * NQ:
        q_valid = gl.load(BlockValid + qb)
        tcount += 1
        m_i = gl.full([ROWS], -1.0e30, gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
        n = end - start
        if n > 0:
            # First key block: S_0 and its softmax, nothing to overlap yet.
            idx = it % K_STAGES
            mbarrier.wait(k_ready.index(idx), (it // K_STAGES) & 1)
            kb, k_valid = _block_info(kinfo, idx)
            s = warpgroup_mma(q_s, k_bufs.index(idx).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s])
            mbarrier.arrive(k_empty.index(idx), count=1)
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, kb, qb, k_valid, offs_m, offs_n, qk_scale)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            prev = it % STAGES
            prev_ph = (it // STAGES) & 1
            prev_valid = k_valid
            for j in range(1, n):
                idx = (it + j) % K_STAGES
                mbarrier.wait(k_ready.index(idx), ((it + j) // K_STAGES) & 1)
                kb, k_valid = _block_info(kinfo, idx)
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
                prev = (it + j) % STAGES
                prev_ph = ((it + j) // STAGES) & 1
                prev_valid = k_valid
            mbarrier.wait(v_ready.index(prev), prev_ph)
            if prev_valid < BLOCK:
                _zero_v_padding(v_bufs.index(prev), prev_valid, HEAD_DIM)
            acc = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
            # While the last P V runs: the next tile's Q to logical positions (every S of this one is done).
            t_n, h_n, qb_n, start_n, end_n, q_row0_n = _next_tile(
                tcount, q_raws, q_rots, sched, cs_smem, q_ready, q_empty, Indptr, RowEnd, QBlocks, QTokStart,
                n_heads, NQ, GROUP, ROPE, Q_TOKENS, Q_BLOCKS, WG, HEAD_DIM)
            acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
            mbarrier.arrive(v_empty.index(prev), count=1)
            it += n
        else:
            t_n, h_n, qb_n, start_n, end_n, q_row0_n = _next_tile(
                tcount, q_raws, q_rots, sched, cs_smem, q_ready, q_empty, Indptr, RowEnd, QBlocks, QTokStart,
                n_heads, NQ, GROUP, ROPE, Q_TOKENS, Q_BLOCKS, WG, HEAD_DIM)

        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        l_o = gl.where(l_o == 0.0, 1.0, l_o)     # rows that saw no key (empty CSR row) stay 0
        out = (acc * (1.0 / l_o)[:, None]).to(dtype)   # one division per row, not one per element
        ptrs = (Out + h.to(gl.int64) * stride_oh + (q_row0 + offs_mo).to(gl.int64)[:, None] * stride_on
                + offs_d[None, :])
        if Q_TOKENS:
            gl.store(ptrs, out, mask=(offs_mo < q_valid)[:, None])
        else:
            gl.store(ptrs, gl.where((offs_mo < q_valid)[:, None], out, gl.zeros_like(out)))
        t, h, qb, start, end, q_row0 = t_n, h_n, qb_n, start_n, end_n, q_row0_n


@gluon.jit
def _load_v(v_desc, v_bufs, v_ready, v_empty, pos, row, col):
    """TMA of the V block at [row, col] into ring entry `pos` (waits for the entry's previous use to be done)."""
    vidx = pos % STAGES
    mbarrier.wait(v_empty.index(vidx), ((pos // STAGES) & 1) ^ 1)
    mbarrier.expect(v_ready.index(vidx), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [row, col], v_ready.index(vidx), v_bufs.index(vidx))


@gluon.jit
def _producer(q_desc, k_desc, v_desc, bufs, bars, Out, Indptr, RowEnd, Indices, BlockValid, BlockOffset, QBlocks,
              QTokStart, KVPages, CosSin, Counter, n_heads, NQ, n_q, n_k, stride_oh, stride_on, qk_scale,
              GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, ROPE: gl.constexpr, Q_TOKENS: gl.constexpr,
              Q_BLOCKS: gl.constexpr, QHR: gl.constexpr, KHR: gl.constexpr, K_PAGED: gl.constexpr,
              V_PAGED: gl.constexpr, WG: gl.constexpr):
    q_raws, q_rots, k_bufs, v_bufs, kinfo, sched, cs_smem = bufs
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = bars
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    cs_layout: gl.constexpr = gl.BlockedLayout([HEAD_DIM // 32], [32], [1], [0])
    r2 = gl.arange(0, 2, layout=layout)
    n_tiles = n_heads * NQ
    it = 0
    tcount = 0
    t = gl.program_id(0)
    while t < n_tiles:
        h, qb, start, end, q_row0 = _tile_row(t, Indptr, RowEnd, QBlocks, QTokStart, n_heads, NQ, GROUP, Q_TOKENS,
                                              Q_BLOCKS)
        kvh = h // GROUP
        # Heads along rows (one [.., D] view, n_q / n_k rows per head) or along columns ([N, H * D] view).
        if QHR:
            q_r, q_c = h * n_q + q_row0, 0
        else:
            q_r, q_c = q_row0, h * HEAD_DIM
        if KHR:
            k_r, k_c = kvh * n_k, 0
        else:
            k_r, k_c = 0, kvh * HEAD_DIM

        if ROPE:   # the query block's cos | sin row, read ahead of the wait (held in 4 registers per lane)
            cs = gl.load(CosSin + qb * HEAD_DIM + gl.arange(0, HEAD_DIM, layout=cs_layout))
        mbarrier.wait(q_empty, (tcount & 1) ^ 1)
        # Publish the tile number and the angles of its query block (no global load and no angle arithmetic at
        # the consumers' rotation); the expect's arrive releases them to the consumers' wait on q_ready.
        sched.index(tcount & 1).store(gl.where(r2 == 0, t, 0))
        if ROPE:
            cs_smem.store(cs)
        mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_r, q_c], q_ready, q_raws.index(0))
        tma.async_copy_global_to_shared(q_desc, [q_r + ROWS, q_c], q_ready, q_raws.index(1))
        # K runs one block ahead of V inside a row: K_{j+1} is requested before V_j's slot is free (that waits
        # for P_{j-2} V_{j-2}), so it lands before the consumers reach it.
        v_prev = 0
        for e in range(start, end):
            kb = gl.load(Indices + e)
            # K_PAGED / V_PAGED: the block's keys / values sit in page KVPages[kb] (the KV store's pool).
            if K_PAGED or V_PAGED:
                page = gl.load(KVPages + kb)
            else:
                page = kb
            k_at = page if K_PAGED else kb
            idx = it % K_STAGES
            mbarrier.wait(k_empty.index(idx), ((it // K_STAGES) & 1) ^ 1)
            # The block's id and valid slots travel with it (released by the expect's arrive).
            kinfo.index(idx).store(gl.where(r2 == 0, kb, gl.load(BlockValid + kb)))
            mbarrier.expect(k_ready.index(idx), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [k_r + k_at * BLOCK, k_c], k_ready.index(idx), k_bufs.index(idx))
            if e > start:
                _load_v(v_desc, v_bufs, v_ready, v_empty, it - 1, k_r + v_prev * BLOCK, k_c)
            v_prev = page if V_PAGED else kb
            it += 1
        if end > start:
            _load_v(v_desc, v_bufs, v_ready, v_empty, it - 1, k_r + v_prev * BLOCK, k_c)
        tcount += 1
        # Next tile from the global counter: a CTA that drew long rows takes fewer tiles.
        t = gl.num_programs(0) + gl.atomic_add(Counter, 1)
    mbarrier.wait(q_empty, (tcount & 1) ^ 1)
    sched.index(tcount & 1).store(gl.where(r2 == 0, t, 0))
    mbarrier.arrive(q_ready, count=1)   # no Q: the consumers read t >= n_tiles and stop


@gluon.jit
def _sparse_attn_fwd_sm90(q_desc, k_desc, v_desc, Out, Indptr, RowEnd, Indices, BlockValid, BlockOffset, QBlocks,
                          QTokStart, KVPages, CosSin, Counter, n_heads, NQ, n_q, n_k, stride_oh, stride_on, qk_scale,
                          GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, ROPE: gl.constexpr, Q_TOKENS: gl.constexpr,
                          Q_BLOCKS: gl.constexpr, QHR: gl.constexpr, KHR: gl.constexpr, K_PAGED: gl.constexpr,
                          V_PAGED: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    q_raws = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_desc.layout)   # as loaded, per half
    q_rots = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_desc.layout)   # at logical positions
    k_bufs = gl.allocate_shared_memory(dtype, [K_STAGES, BLOCK, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK, HEAD_DIM], v_desc.layout)
    kinfo = gl.allocate_shared_memory(gl.int32, [K_STAGES, 2], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_empty, count=2)           # one arrival per consumer warpgroup
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    sched = gl.allocate_shared_memory(gl.int32, [2, 2], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    # cos | sin of the current tile's query offset (fp32 [D]), written by the producer with each Q (single
    # buffer like q_raws: the producer rewrites it only after both consumers released q_raws).
    cs_smem = gl.allocate_shared_memory(gl.float32, [HEAD_DIM], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bufs = (q_raws, q_rots, k_bufs, v_bufs, kinfo, sched, cs_smem)
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty)
    gl.warp_specialize([
        (_consumer, (q_desc, k_desc, v_desc, bufs, bars, Out, Indptr, RowEnd, Indices, BlockValid, BlockOffset,
                     QBlocks, QTokStart, KVPages, CosSin, Counter, n_heads, NQ, n_q, n_k, stride_oh, stride_on,
                     qk_scale, GROUP, HEAD_DIM, ROPE, Q_TOKENS, Q_BLOCKS, QHR, KHR, K_PAGED, V_PAGED, 0)),
        (_consumer, (q_desc, k_desc, v_desc, bufs, bars, Out, Indptr, RowEnd, Indices, BlockValid, BlockOffset,
                     QBlocks, QTokStart, KVPages, CosSin, Counter, n_heads, NQ, n_q, n_k, stride_oh, stride_on,
                     qk_scale, GROUP, HEAD_DIM, ROPE, Q_TOKENS, Q_BLOCKS, QHR, KHR, K_PAGED, V_PAGED, 1)),
        (_producer, (q_desc, k_desc, v_desc, bufs, bars, Out, Indptr, RowEnd, Indices, BlockValid, BlockOffset,
                     QBlocks, QTokStart, KVPages, CosSin, Counter, n_heads, NQ, n_q, n_k, stride_oh, stride_on,
                     qk_scale, GROUP, HEAD_DIM, ROPE, Q_TOKENS, Q_BLOCKS, QHR, KHR, K_PAGED, V_PAGED, 0)),
    ], [4, 1], [240, 24])


def _head_view(x: torch.Tensor):
    """[H, N, D] with unit last stride -> (2-D view, heads along rows?, rows per head) for a TMA descriptor, or
    None. Heads along rows: x[h] is N contiguous rows of one [.., D] matrix, head h starting at row h * pitch
    (pitch >= N: x may be the first N slots of a longer per-head buffer, as the engine's cache with room for
    generated tokens); along columns: x is the transpose view of an [N, H, D] buffer (the model's projections),
    one [N, H * D] matrix (pitch unused)."""
    h, n, d = x.shape
    if x.stride(2) != 1:
        return None
    if x.stride(1) == d and x.stride(0) % d == 0 and x.stride(0) >= n * d:
        pitch = x.stride(0) // d
        return torch.as_strided(x, ((h - 1) * pitch + n, d), (d, 1)), True, pitch
    if x.stride(0) == d and x.stride(1) == h * d:
        return torch.as_strided(x, (n, h * d), (h * d, 1)), False, 0
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


_NO_TABLE: dict[int, torch.Tensor] = {}


def _descriptors(q, k, v):
    """TMA descriptors of q, k, v (`_head_view`) -> (q_desc, k_desc, v_desc, q heads along rows?, q rows per head,
    k heads along rows?, k rows per head). K and V share one coordinate rule: when their views differ, both are
    copied (slow path; the key pass lays its output out as v)."""
    dt = _GL_DTYPES[q.dtype]
    d = q.shape[2]
    (q2, q_rows, q_pitch), (k2, k_rows, k_pitch), (v2, v_rows, v_pitch) = _head_view(q), _head_view(k), _head_view(v)
    if (k_rows, k_pitch) != (v_rows, v_pitch):
        (k2, k_rows, k_pitch), (v2, v_rows, v_pitch) = _head_view(k.contiguous()), _head_view(v.contiguous())
    rows, block = ROWS.value, BLOCK.value
    q_desc = TensorDescriptor.from_tensor(q2, [rows, d], gl.NVMMASharedLayout.get_default_for([rows, d], dt))
    kv_layout = gl.NVMMASharedLayout.get_default_for([block, d], dt)
    k_desc = TensorDescriptor.from_tensor(k2, [block, d], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v2, [block, d], kv_layout)
    return q_desc, k_desc, v_desc, q_rows, q_pitch, k_rows, k_pitch


def launch(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, *, scale, out, q_block_start=None,
           row_end=None, q_blocks=None, kv_pages=None):
    """Run the kernel: the arguments of `sparse_attention.sparse_attention` (validated there, `supports` true),
    out allocated. With inv_freq, one pass over K (`rope.rotate_key_blocks`) moves the keys to logical positions
    into a buffer laid out as v, and writes each block's cos | sin, with which the kernel rotates the query tiles
    (no other launch: the pass forms the fp64 angles from inv_freq itself). With kv_pages the pass also gathers
    K's pages into logical order, and the kernel reads V's pages in place. Returns out."""
    hq, _, d = q.shape
    nb = block_valid.numel()
    nq = nb if q_blocks is None else q_blocks.numel()
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if kv_pages is not None and inv_freq is not None and v.stride(0) != d:
        # Pages of a head-major pool: the rotated keys' buffer cannot share V's row pitch (one TMA coordinate
        # rule for both), so both are gathered into logical order (the engine's pools are token-major).
        k, v, kv_pages = gather_blocks(k, kv_pages, BLOCK.value), gather_blocks(v, kv_pages, BLOCK.value), None
    k_paged = kv_pages is not None
    if inv_freq is not None:
        cos_sin = torch.empty((nb, d), dtype=torch.float32, device=q.device)
        k = rotate_key_blocks(k, block_offset, inv_freq, block=BLOCK.value, cos_sin=cos_sin, pages=kv_pages,
                              out=_like_v(v, nb * BLOCK.value))
        k_paged = False
    else:   # not read (ROPE is off); any fp32 pointer
        if dev not in _NO_TABLE:
            _NO_TABLE[dev] = torch.zeros(1, dtype=torch.float32, device=q.device)
        cos_sin = _NO_TABLE[dev]
    q_desc, k_desc, v_desc, q_rows, q_pitch, k_rows, k_pitch = _descriptors(q, k, v)
    _sparse_attn_fwd_sm90[(min(sm_count(q.device), hq * nq),)](
        q_desc, k_desc, v_desc, out, indptr, indptr[1:] if row_end is None else row_end, indices, block_valid,
        block_offset, block_valid if q_blocks is None else q_blocks,   # QBlocks: not read without Q_BLOCKS
        block_valid if q_block_start is None else q_block_start,
        block_valid if kv_pages is None else kv_pages,         # KVPages: not read unpaged
        cos_sin,
        torch.zeros(1, dtype=torch.int32, device=q.device),   # the tile counter
        hq, nq, q_pitch, k_pitch, out.stride(0), out.stride(1), float(scale) * LOG2E,
        GROUP=hq // k.shape[0], HEAD_DIM=d, ROPE=inv_freq is not None, Q_TOKENS=q_block_start is not None,
        Q_BLOCKS=q_blocks is not None, QHR=q_rows, KHR=k_rows, K_PAGED=k_paged, V_PAGED=kv_pages is not None,
        num_warps=NUM_WARPS, maxnreg=MAXNREG)
    return out


def _like_v(v: torch.Tensor, n: int) -> torch.Tensor:
    """A new [Hkv, n, D] buffer laid out as v (heads along rows or along columns), so that K and V share one TMA
    coordinate rule (`_descriptors`): a pool's token-major pages give a token-major buffer."""
    h, _, d = v.shape
    if v.stride(0) == d:
        return torch.empty((n, h, d), dtype=v.dtype, device=v.device).transpose(0, 1)
    return torch.empty_strided((h, n, d), v.stride(), dtype=v.dtype, device=v.device)


def compile_for_sm90(*, rope: bool = True, q_tokens: bool = True, q_rows: bool = False, k_rows: bool = True,
                     q_blocks: bool = False, k_paged: bool = False, v_paged: bool = False, group: int = 4,
                     dtype: torch.dtype = torch.bfloat16):
    """Compile the kernel for sm_90 on any machine (no GPU needed: Triton's bundled ptxas) and return the
    CompiledKernel (`.metadata.shared` bytes, `.asm["ptx"]`, `.asm["cubin"]`). Used by CI to keep the kernel
    compiling and within shared memory, and by bench/aot_sm90.py for register / spill reports. q_blocks: the
    variant that computes only the query blocks the caller lists (`launch(..., q_blocks=...)`); k_paged /
    v_paged: the variants that read K / V from a pool's pages (`launch(..., kv_pages=...)`)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    dt = _GL_DTYPES[dtype]
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    ql = gl.NVMMASharedLayout.get_default_for([ROWS.value, 128], dt)
    kl = gl.NVMMASharedLayout.get_default_for([BLOCK.value, 128], dt)
    sig = {"q_desc": f"tensordesc<{name}[{ROWS.value}, 128],{ql!r}>",
           "k_desc": f"tensordesc<{name}[{BLOCK.value}, 128],{kl!r}>",
           "v_desc": f"tensordesc<{name}[{BLOCK.value}, 128],{kl!r}>", "Out": f"*{name}"}
    sig.update({p: "*i32" for p in ("Indptr", "RowEnd", "Indices", "BlockValid", "BlockOffset", "QBlocks",
                                    "QTokStart", "KVPages", "Counter")})
    sig.update(CosSin="*fp32", qk_scale="fp32")
    sig.update({p: "i32" for p in ("n_heads", "NQ", "n_q", "n_k", "stride_oh", "stride_on")})
    const = dict(GROUP=group, HEAD_DIM=128, ROPE=rope, Q_TOKENS=q_tokens, Q_BLOCKS=q_blocks, QHR=q_rows,
                 KHR=k_rows, K_PAGED=k_paged, V_PAGED=v_paged)
    sig.update({p: "constexpr" for p in const})
    missing = set(_sparse_attn_fwd_sm90.arg_names) - set(sig)
    if missing:
        raise RuntimeError(f"compile_for_sm90 does not know the kernel arguments {sorted(missing)}")
    target = GPUTarget("cuda", 90, 32)
    options = triton.compiler.make_backend(target).parse_options(dict(num_warps=NUM_WARPS, maxnreg=MAXNREG))
    # What the JIT assumes of a real call: 16-byte aligned pointers, strides that are multiples of 16 elements.
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(_sparse_attn_fwd_sm90.arg_names)
             if sig[p].startswith("*") or p.startswith("stride_")}
    return triton.compile(GluonASTSource(fn=_sparse_attn_fwd_sm90, signature=sig, constexprs=const, attrs=attrs),
                          target=target, options=options.__dict__)
