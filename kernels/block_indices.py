"""Decode one layer's SIFT bit vectors into the sparse block pattern of SPEC section 4, as CSR block indices.

Output, for every (query head h, query block qb) row r = h * NB + qb (head-major):
    indices[indptr[r]:indptr[r + 1]]: int32 global key-block ids, ascending,
the contract of `sparse_attention`. The pattern (SIFT's):
  * prefix and query rows: every block of the request up to and including the diagonal (dense causal);
  * document rows: every prefix block of the request; the blocks of every earlier document d_i of the request
    that cover a CA page of d_i set to 1; the blocks of its own document that cover an LA tile (ti, tj), tj <= ti,
    set to 1, with ti a tile of the query block. The diagonal block is always kept (SPEC: LA(i, i) = 1; the
    bits already hold it, forcing it again only guards rows from being left without keys).
Coarsening: the index tile T may be smaller than the kernel block (T <= block, both powers of two); a kernel
block is kept iff any of the tiles it covers is 1, over the tiles that exist (a document's last page may be
partial). T > block would need refinement and is refused.

Bits on the device: one flat uint8 buffer per kind (`la_bytes`, `ca_bytes`) and int64 byte offsets
`la_ptr` / `ca_ptr: [n_docs, Hq]` of each (document, head) vector, documents indexed by the layout's document
ordinals. `pack_doc_bits` uploads the index's per-document `la_bits` / `ca_bits` blobs (all layers) once per
batch; `DocBits.layer_ptrs(layer)` then yields a layer's offsets with arithmetic on the device, so a layer's
decode needs no gather of bits and no host round trip.

`block_indices(..., padded=True)` decodes in one pass (rows at their dense starts, each with its end), and
`block_indices_layers` does that for several layers in one launch (the decode is latency bound: what the engine
runs). The compact form takes two passes on the GPU: count per row, `cumsum` into indptr, fill. No host
synchronisation: `indices` is allocated with the upper bound `Hq * layout.causal_block_pairs` (every row dense
causal); entries past `indptr[-1]` are unspecified.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from sift.format import TILES, ca_nbytes, la_nbytes, n_pages

from .bits import tril_to_square, unpack_msb
from .device import triton_runs_on
from .layout import PREFIX, BatchLayout


# --------------------------------------------------------------------------------------------------- bits


@dataclass(frozen=True, eq=False)
class DocBits:
    """Packed bits of all documents of a batch (all layers), on the device.

    la_bytes / ca_bytes: uint8 [total]; la_base / ca_base: int64 [n_docs] byte offset of each document's blob;
    la_head_nbytes / ca_head_nbytes: int64 [n_docs] bytes of one (layer, head) vector of each document.
    """

    la_bytes: torch.Tensor
    ca_bytes: torch.Tensor
    la_base: torch.Tensor
    ca_base: torch.Tensor
    la_head_nbytes: torch.Tensor
    ca_head_nbytes: torch.Tensor
    n_layers: int
    n_heads: int

    def all_layer_ptrs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (la_ptr, ca_ptr): int64 [n_layers, n_docs, Hq]; [layer] is `layer_ptrs(layer)`, built once per
        batch so that no layer pays `layer_ptrs`' four small device ops."""
        vec = torch.arange(self.n_layers * self.n_heads, device=self.la_base.device, dtype=torch.int64)
        vec = vec.view(self.n_layers, 1, self.n_heads)
        la = self.la_base[None, :, None] + vec * self.la_head_nbytes[None, :, None]
        ca = self.ca_base[None, :, None] + vec * self.ca_head_nbytes[None, :, None]
        return la, ca

    def layer_ptrs(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (la_ptr, ca_ptr): int64 [n_docs, Hq] byte offsets of layer `layer`'s vectors (device arithmetic)."""
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer={layer} is out of range for {self.n_layers} layers")
        heads = torch.arange(self.n_heads, device=self.la_base.device, dtype=torch.int64)
        vec = layer * self.n_heads + heads  # vector index of (layer, head) inside a document's blob
        la = self.la_base[:, None] + vec[None, :] * self.la_head_nbytes[:, None]
        ca = self.ca_base[:, None] + vec[None, :] * self.ca_head_nbytes[:, None]
        return la, ca


def pack_doc_bits(
    la_blobs: Sequence[bytes],
    ca_blobs: Sequence[bytes],
    n_tokens: Sequence[int],
    *,
    tile: int,
    n_layers: int,
    n_heads: int,
    device: torch.device | str = "cpu",
) -> DocBits:
    """Concatenate the index rows' `la_bits` / `ca_bits` (SPEC section 3: for layer, for head, each vector
    byte-aligned) of the batch's documents, in the layout's document order, and upload them in one copy each.
    A document used twice in a batch may be passed twice."""
    if not len(la_blobs) == len(ca_blobs) == len(n_tokens):
        raise ValueError(f"got {len(la_blobs)} la blobs, {len(ca_blobs)} ca blobs, {len(n_tokens)} lengths")
    la_nb = [la_nbytes(n, tile) for n in n_tokens]
    ca_nb = [ca_nbytes(n, tile) for n in n_tokens]
    vectors = n_layers * n_heads
    for d, (la, ca, n) in enumerate(zip(la_blobs, ca_blobs, n_tokens)):
        if len(la) != vectors * la_nb[d] or len(ca) != vectors * ca_nb[d]:
            raise ValueError(
                f"document {d} ({n} tokens, tile {tile}): la_bits has {len(la)} bytes, ca_bits {len(ca)}; "
                f"{n_layers} layers x {n_heads} heads need {vectors * la_nb[d]} and {vectors * ca_nb[d]}"
            )

    def upload(blobs: Sequence[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        sizes = torch.tensor([len(b) for b in blobs], dtype=torch.int64)
        base = torch.cumsum(sizes, 0) - sizes
        flat = torch.frombuffer(bytearray(b"".join(blobs)) or bytearray(1), dtype=torch.uint8)
        return flat.to(device), base.to(device)

    la_bytes, la_base = upload(la_blobs)
    ca_bytes, ca_base = upload(ca_blobs)
    return DocBits(
        la_bytes=la_bytes,
        ca_bytes=ca_bytes,
        la_base=la_base,
        ca_base=ca_base,
        la_head_nbytes=torch.tensor(la_nb, dtype=torch.int64, device=device),
        ca_head_nbytes=torch.tensor(ca_nb, dtype=torch.int64, device=device),
        n_layers=n_layers,
        n_heads=n_heads,
    )


# ------------------------------------------------------------------------------------------------- kernel


@triton.jit
def _block_indices_kernel(
    indptr_ptr,  # int32 [Hq * NB + 1]: read in the fill pass
    indices_ptr,  # int32 [cap]: written in the fill pass
    counts_ptr,  # int32 [Hq * NB]: row counts (count pass); row ends, indptr[row] + count (fill pass)
    block_kind_ptr,
    block_request_ptr,
    block_doc_ptr,
    req_first_block_ptr,
    doc_first_block_ptr,
    doc_n_tokens_ptr,
    la_bytes_ptr,
    la_ptr_ptr,  # int64 [n_docs, Hq]
    ca_bytes_ptr,
    ca_ptr_ptr,
    NB,
    HQ,
    stride_lap_d,
    stride_lap_h,
    stride_cap_d,
    stride_cap_h,
    stride_lap_l,  # layer strides (grid axis 2 = layer of a multi-layer decode; 0 for one layer)
    stride_cap_l,
    stride_idx_l,
    stride_cnt_l,
    TILE: tl.constexpr,
    R: tl.constexpr,  # tiles per kernel block, block // TILE
    HB: tl.constexpr,  # query heads per program
    BLOCK_J: tl.constexpr,  # key blocks examined per step
    FILL: tl.constexpr,
):
    # One program: query block qb for heads [h0, h0 + HB). Row of head h: h * NB + qb.
    qb = tl.program_id(0)
    hh = tl.program_id(1) * HB + tl.arange(0, HB)
    layer = tl.program_id(2).to(tl.int64)
    la_ptr_ptr += layer * stride_lap_l
    ca_ptr_ptr += layer * stride_cap_l
    indices_ptr += layer * stride_idx_l
    counts_ptr += layer * stride_cnt_l
    h_ok = hh < HQ
    rows = hh * NB + qb
    kind = tl.load(block_kind_ptr + qb)
    rb0 = tl.load(req_first_block_ptr + tl.load(block_request_ptr + qb))
    jj = tl.arange(0, BLOCK_J)
    base = tl.zeros([HB], dtype=tl.int32)
    if FILL:
        base = tl.load(indptr_ptr + rows, mask=h_ok, other=0)

    if kind != 1:  # not DOC: a prefix or query row is dense causal over the request
        if FILL:
            for start in range(rb0, qb + 1, BLOCK_J):
                kb = start + jj
                dst = indices_ptr + base[:, None] + (kb - rb0)[None, :]
                tl.store(dst, tl.broadcast_to(kb[None, :], (HB, BLOCK_J)), mask=h_ok[:, None] & (kb <= qb)[None, :])
            tl.store(counts_ptr + rows, base + (qb - rb0 + 1), mask=h_ok)
        else:
            tl.store(counts_ptr + rows, tl.zeros([HB], dtype=tl.int32) + (qb - rb0 + 1), mask=h_ok)
    else:
        d = tl.load(block_doc_ptr + qb)
        df = tl.load(doc_first_block_ptr + d)
        n_pg = tl.cdiv(tl.load(doc_n_tokens_ptr + d), TILE)
        la_base = tl.load(la_ptr_ptr + d * stride_lap_d + hh * stride_lap_h, mask=h_ok, other=0)  # [HB]
        # Own-document tiles: ti runs over the query block's tiles, tj over a key block's, row-major in R x R.
        rr = tl.arange(0, R * R)
        ti = (qb - df) * R + rr // R
        ti_ok = ti < n_pg
        la_row = ti * (ti + 1) // 2
        r1 = tl.arange(0, R)
        count = tl.zeros([HB], dtype=tl.int32)
        for start in range(rb0, qb + 1, BLOCK_J):
            kb = start + jj  # [J]
            inb = kb <= qb
            kkind = tl.load(block_kind_ptr + kb, mask=inb, other=0)
            kdoc = tl.load(block_doc_ptr + kb, mask=inb, other=0)

            # CA pages of earlier documents of the request: [HB, J, R].
            is_ca = inb & (kkind == 1) & (kdoc != d)
            kdf = tl.load(doc_first_block_ptr + kdoc, mask=is_ca, other=0)
            k_pg = tl.cdiv(tl.load(doc_n_tokens_ptr + kdoc, mask=is_ca, other=0), TILE)
            page = (kb - kdf)[:, None] * R + r1[None, :]  # [J, R]
            pm = is_ca[:, None] & (page < k_pg[:, None])
            cam = h_ok[:, None] & is_ca[None, :]
            ca_base = tl.load(ca_ptr_ptr + kdoc[None, :] * stride_cap_d + hh[:, None] * stride_cap_h, mask=cam, other=0)
            cm = h_ok[:, None, None] & pm[None, :, :]
            cbyte = tl.load(ca_bytes_ptr + ca_base[:, :, None] + (page // 8)[None, :, :], mask=cm, other=0)
            cbit = (cbyte.to(tl.int32) >> (7 - page % 8)[None, :, :]) & 1
            ca_keep = tl.max(tl.where(cm, cbit, 0), axis=2) > 0  # [HB, J]

            # LA tiles of the own document, causal (tj <= ti) and existing (ti < P): [HB, J, R * R].
            is_la = inb & (kb >= df)
            tj = (kb - df)[:, None] * R + (rr % R)[None, :]  # [J, R * R]
            lm = is_la[:, None] & ti_ok[None, :] & (tj <= ti[None, :])
            n = la_row[None, :] + tj
            lmh = h_ok[:, None, None] & lm[None, :, :]
            lbyte = tl.load(la_bytes_ptr + la_base[:, None, None] + (n // 8)[None, :, :], mask=lmh, other=0)
            lbit = (lbyte.to(tl.int32) >> (7 - n % 8)[None, :, :]) & 1
            la_keep = (tl.max(tl.where(lmh, lbit, 0), axis=2) > 0) | (kb == qb)[None, :]

            keep = inb[None, :] & ((kkind == 0)[None, :] | ca_keep | la_keep)  # [HB, J]
            k32 = keep.to(tl.int32)
            if FILL:
                pos = tl.cumsum(k32, axis=1) - k32
                dst = indices_ptr + (base + count)[:, None] + pos
                tl.store(dst, tl.broadcast_to(kb[None, :], (HB, BLOCK_J)), mask=keep & h_ok[:, None])
            count += tl.sum(k32, axis=1)
        if FILL:
            tl.store(counts_ptr + rows, base + count, mask=h_ok)
        else:
            tl.store(counts_ptr + rows, count, mask=h_ok)


def _validate(layout: BatchLayout, la_bytes, la_ptr, ca_bytes, ca_ptr, tile: int) -> int:
    if tile not in TILES:
        raise ValueError(f"tile={tile} must be one of {TILES}")
    if tile > layout.block:
        raise ValueError(
            f"index tile {tile} is larger than the kernel block {layout.block}: blocks may only coarsen tiles; "
            f"build the layout with block >= {tile}"
        )
    for name, t, dtype in (("la_bytes", la_bytes, torch.uint8), ("ca_bytes", ca_bytes, torch.uint8),
                           ("la_ptr", la_ptr, torch.int64), ("ca_ptr", ca_ptr, torch.int64)):
        if t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
        if t.device != layout.device:
            raise ValueError(f"{name} is on {t.device}; the layout is on {layout.device} (use layout.to)")
    if la_ptr.dim() != 2 or la_ptr.shape != ca_ptr.shape or la_ptr.shape[0] != layout.n_docs:
        raise ValueError(
            f"la_ptr {tuple(la_ptr.shape)} and ca_ptr {tuple(ca_ptr.shape)} must both be [n_docs={layout.n_docs}, Hq]"
        )
    if la_ptr.shape[1] < 1:
        raise ValueError("need at least one head")
    return la_ptr.shape[1]


def _launch_shape(layout: BatchLayout, tile: int, n_heads: int, hb, block_j, num_warps) -> tuple[int, int, int]:
    """(heads per program, key blocks per step, warps), defaults filled in."""
    r = layout.block // tile
    if layout.device.type == "cuda":
        # One head per program, 32 key blocks per step, one warp: each program's work is a short dependent
        # gather, so many small programs fill the GPU better than fewer large ones (bench/bench_decode.py
        # sweeps these).
        hb = hb or 1
        return hb, block_j or max(8, min(32, 8192 // (hb * r * r))), num_warps or 1
    # the interpreter runs programs one after another: fewer, larger ones
    hb = hb or min(triton.next_power_of_2(n_heads), 8)
    # The LA test holds [HB, BLOCK_J, R * R] values: keep it near 8K elements so it stays in registers.
    return hb, block_j or max(8, min(64, 8192 // (hb * r * r))), num_warps or 4


def _run(layout: BatchLayout, la_bytes, la_ptr, ca_bytes, ca_ptr, tile: int, indptr, indices, counts, *, fill: bool,
         hb: int, block_j: int, num_warps: int) -> None:
    """One launch over G layers (grid axis 2): la_ptr / ca_ptr int64 [G, n_docs, Hq], indices [G, cap],
    counts [G, Hq * NB]; indptr (count pass: unused; fill pass: the row starts) is shared by the G layers."""
    g, n_heads = la_ptr.shape[0], la_ptr.shape[2]
    if layout.n_docs == 0:  # no document rows read them, but the pointer arguments must be valid
        la_ptr = ca_ptr = torch.zeros(g, 1, n_heads, dtype=torch.int64, device=layout.device)
        la_bytes = ca_bytes = torch.zeros(1, dtype=torch.uint8, device=layout.device)
    nb = layout.n_blocks
    _block_indices_kernel[(nb, triton.cdiv(n_heads, hb), g)](
        indptr, indices, counts, layout.block_kind, layout.block_request, layout.block_doc, layout.req_first_block,
        layout.doc_first_block if layout.n_docs else layout.block_kind,
        layout.doc_n_tokens if layout.n_docs else layout.block_kind,
        la_bytes, la_ptr, ca_bytes, ca_ptr,
        nb, n_heads, la_ptr.stride(1), la_ptr.stride(2), ca_ptr.stride(1), ca_ptr.stride(2),
        la_ptr.stride(0), ca_ptr.stride(0), indices.stride(0), counts.stride(0),
        FILL=fill, TILE=tile, R=layout.block // tile, HB=hb, BLOCK_J=block_j, num_warps=num_warps)


def _row_start(layout: BatchLayout, n_heads: int, row_start: torch.Tensor | None) -> torch.Tensor:
    starts = dense_indptr(layout, n_heads) if row_start is None else row_start
    n_rows, dev = n_heads * layout.n_blocks, layout.device
    if starts.dtype != torch.int32 or starts.shape != (n_rows + 1,) or starts.device != dev:
        raise ValueError(f"row_start must be int32 [Hq * NB + 1]={n_rows + 1} on {dev} (dense_indptr)")
    return starts


def _check_device(layout: BatchLayout) -> None:
    if not triton_runs_on(layout.device):
        raise ValueError(f"block_indices runs on CUDA tensors (got {layout.device}); use block_indices_ref on CPU")


def block_indices_layers(layout: BatchLayout, la_bytes: torch.Tensor, la_ptr: torch.Tensor, ca_bytes: torch.Tensor,
                         ca_ptr: torch.Tensor, tile: int, *, row_start: torch.Tensor | None = None):
    """Several layers' bits -> block indices in one launch, the one-pass form of `block_indices(...,
    padded=True)`: la_ptr / ca_ptr int64 [G, n_docs, Hq] (e.g. `DocBits.all_layer_ptrs()[a:b]`) ->
    (row_start int32 [Hq * NB + 1], indices int32 [G, Hq * causal_block_pairs], row_end int32 [G, Hq * NB]);
    layer g's row r is indices[g, row_start[r]:row_end[g, r]]. The decode is latency bound (short dependent
    gathers per program), so G layers in one grid cost far less than G launches (bench/bench_decode.py)."""
    if la_ptr.dim() != 3 or la_ptr.shape != ca_ptr.shape:
        raise ValueError(f"la_ptr {tuple(la_ptr.shape)} and ca_ptr {tuple(ca_ptr.shape)} must both be "
                         f"[layers, n_docs={layout.n_docs}, Hq]")
    g = la_ptr.shape[0]
    n_heads = _validate(layout, la_bytes, la_ptr[0], ca_bytes, ca_ptr[0], tile)
    _check_device(layout)
    starts = _row_start(layout, n_heads, row_start)
    indices = torch.empty(g, max(1, n_heads * layout.causal_block_pairs), dtype=torch.int32, device=layout.device)
    ends = torch.empty(g, n_heads * layout.n_blocks, dtype=torch.int32, device=layout.device)
    hb, block_j, num_warps = _launch_shape(layout, tile, n_heads, None, None, None)
    _run(layout, la_bytes, la_ptr, ca_bytes, ca_ptr, tile, starts, indices, ends, fill=True, hb=hb,
         block_j=block_j, num_warps=num_warps)
    return starts, indices, ends


def block_indices(
    layout: BatchLayout,
    la_bytes: torch.Tensor,
    la_ptr: torch.Tensor,
    ca_bytes: torch.Tensor,
    ca_ptr: torch.Tensor,
    tile: int,
    *,
    heads_per_program: int | None = None,
    padded: bool = False,
    row_start: torch.Tensor | None = None,
    block_j: int | None = None,
    num_warps: int | None = None,
):
    """One layer's bits -> CSR (indptr: int32 [Hq * NB + 1], indices: int32 [Hq * layout.causal_block_pairs]).

    padded=True: one pass instead of count, prefix sum and fill. Row r is written at the start it would have
    with every block kept (`dense_indptr`, or `row_start` if given: compute it once per layout), and the result
    is (row_start, indices, row_end) with row r's blocks in indices[row_start[r]:row_end[r]]: what
    `sparse_attention(..., row_end=...)` reads.

    la_bytes / ca_bytes: uint8 flat buffers; la_ptr / ca_ptr: int64 [n_docs, Hq] byte offset of each
    (document, head) vector, documents in layout order. Only indices[:indptr[-1]] is defined.
    heads_per_program: a power of two, query heads decoded by one program; block_j: key blocks per step;
    num_warps. Defaults: many small programs on CUDA, fewer larger ones for the interpreter (`_launch_shape`).
    """
    n_heads = _validate(layout, la_bytes, la_ptr, ca_bytes, ca_ptr, tile)
    if heads_per_program is not None and (heads_per_program < 1 or heads_per_program & (heads_per_program - 1)):
        raise ValueError(f"heads_per_program={heads_per_program} must be a power of two")
    _check_device(layout)
    nb, dev = layout.n_blocks, layout.device
    counts = torch.empty(1, n_heads * nb, dtype=torch.int32, device=dev)
    indices = torch.empty(1, max(1, n_heads * layout.causal_block_pairs), dtype=torch.int32, device=dev)
    hb, block_j, num_warps = _launch_shape(layout, tile, n_heads, heads_per_program, block_j, num_warps)
    run = lambda indptr, fill: _run(layout, la_bytes, la_ptr[None], ca_bytes, ca_ptr[None], tile,  # noqa: E731
                                    indptr, indices, counts, fill=fill, hb=hb, block_j=block_j, num_warps=num_warps)
    if padded:
        starts = _row_start(layout, n_heads, row_start)
        run(starts, True)
        return starts, indices[0], counts[0]
    indptr = torch.zeros(n_heads * nb + 1, dtype=torch.int32, device=dev)
    run(indptr, False)
    torch.cumsum(counts[0], 0, dtype=torch.int32, out=indptr[1:])
    run(indptr, True)
    return indptr, indices[0]


# ---------------------------------------------------------------------------------------------- reference


def _any_pool(x: torch.Tensor, r: int, n_out: int, dim: int) -> torch.Tensor:
    """OR-merge groups of r along `dim` (zero-padded to n_out * r)."""
    pad = n_out * r - x.shape[dim]
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, torch.zeros(shape, dtype=x.dtype, device=x.device)], dim=dim)
    shape = list(x.shape)
    shape[dim : dim + 1] = [n_out, r]
    return x.reshape(shape).any(dim=dim + 1)


def block_indices_ref(
    layout: BatchLayout,
    la_bytes: torch.Tensor,
    la_ptr: torch.Tensor,
    ca_bytes: torch.Tensor,
    ca_ptr: torch.Tensor,
    tile: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ref twin of `block_indices` (same arguments and outputs; indices here has exactly indptr[-1] entries).
    Builds the block-level keep matrix [Hq, NB, NB] and reads it out row by row."""
    n_heads = _validate(layout, la_bytes, la_ptr, ca_bytes, ca_ptr, tile)
    nb, dev, r = layout.n_blocks, layout.device, layout.block // tile
    keep = torch.zeros(n_heads, nb, nb, dtype=torch.bool, device=dev)
    kinds = layout.block_kind.tolist()
    la_ptr_h, ca_ptr_h = la_ptr.tolist(), ca_ptr.tolist()

    def vec(buf: torch.Tensor, ptrs: list[int], nbytes: int, nbits: int) -> torch.Tensor:
        rows = torch.stack([buf[p : p + nbytes] for p in ptrs])
        return unpack_msb(rows, nbits)  # [Hq, nbits]

    for req, (f, n) in enumerate(layout.request_blocks):
        keep[:, f : f + n, f : f + n] = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        first_doc, n_docs = int(layout.req_first_doc[req]), int(layout.req_n_docs[req])
        n_prefix = sum(1 for b in range(f, f + n) if kinds[b] == PREFIX)
        docs = range(first_doc, first_doc + n_docs)
        spans = {d: (int(layout.doc_first_block[d]), int(layout.doc_n_blocks[d])) for d in docs}
        for d in docs:  # document rows see only the prefix plus what their bits select below
            df, dn = spans[d]
            keep[:, df : df + dn, f + n_prefix : f + n] = False
        for d in docs:
            (df, dn), n_tok = spans[d], int(layout.doc_n_tokens[d])
            p = n_pages(n_tok, tile)
            la = tril_to_square(vec(la_bytes, la_ptr_h[d], la_nbytes(n_tok, tile), p * (p + 1) // 2), p)
            la |= torch.eye(p, dtype=torch.bool, device=dev)
            keep[:, df : df + dn, df : df + dn] = _any_pool(_any_pool(la, r, dn, 1), r, dn, 2)
            ca_blocks = _any_pool(vec(ca_bytes, ca_ptr_h[d], ca_nbytes(n_tok, tile), p), r, dn, 1)  # [Hq, dn]
            for later in docs[d - first_doc + 1 :]:
                lf, ln = spans[later]
                keep[:, lf : lf + ln, df : df + dn] = ca_blocks[:, None, :]

    counts = keep.sum(dim=2).reshape(-1)
    indptr = torch.zeros(n_heads * nb + 1, dtype=torch.int32, device=dev)
    indptr[1:] = torch.cumsum(counts, 0)
    indices = keep.nonzero()[:, 2].to(torch.int32)
    return indptr, indices


def dense_indptr(layout: BatchLayout, n_heads: int) -> torch.Tensor:
    """indptr of the dense pattern (every block of the request up to the diagonal), int32 [Hq * NB + 1], on the
    layout's device without a host synchronisation: the row starts of `block_indices(..., padded=True)`."""
    nb, dev = layout.n_blocks, layout.device
    first = layout.req_first_block.long()[layout.block_request.long()]  # [NB]
    counts = (torch.arange(nb, device=dev) - first + 1).repeat(n_heads)  # [Hq * NB]
    indptr = torch.zeros(n_heads * nb + 1, dtype=torch.int32, device=dev)
    torch.cumsum(counts, 0, dtype=torch.int32, out=indptr[1:])
    return indptr


def dense_block_indices(layout: BatchLayout, n_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """mode="dense": every block of the request up to the diagonal, for every head. Same outputs as
    `block_indices`, built on the device without a host synchronisation (indices exactly Hq *
    causal_block_pairs long)."""
    nb, dev = layout.n_blocks, layout.device
    first = layout.req_first_block.long()[layout.block_request.long()]  # [NB]
    counts = (torch.arange(nb, device=dev) - first + 1).repeat(n_heads)  # [Hq * NB]
    indptr = dense_indptr(layout, n_heads)
    total = n_heads * layout.causal_block_pairs
    row_of = torch.repeat_interleave(torch.arange(n_heads * nb, device=dev), counts, output_size=total)
    within = torch.arange(total, device=dev) - indptr[:-1].long()[row_of]
    indices = (first.repeat(n_heads)[row_of] + within).to(torch.int32)
    return indptr, indices
