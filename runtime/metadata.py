"""Per-batch attention metadata, built once before the forward; the attention callback only reads it.

    PrefillMetadata   layout + every layer's block CSR (decoded from the bits, in layer groups) + the row of the
                      packed tokens holding each block's first slot
    DecodeMetadata    the logical block table of each request (its prompt blocks, then its generated blocks)
                      and the logical position of each request's generated segment

Rotation offsets (the logical position of each block's segment, `block_offset`) and the valid slots of each
block belong to the KV the blocks hold: they live in `BatchKVCache` (runtime/kv_cache.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.decode_attention import layout_kv_table
from ..kernels.layout import BatchLayout


@dataclass(frozen=True, eq=False)
class LayerCsr:
    """One layer's sparsity: row `h * NB + qb` (head h, query block qb) attends to the key blocks
    indices[indptr[r]:row_end[r]] (row_end None: indices[indptr[r]:indptr[r + 1]], a compact CSR)."""

    indptr: torch.Tensor            # int32 [Hq * NB + 1]
    indices: torch.Tensor           # int32 [>= nnz]
    row_end: torch.Tensor | None    # int32 [Hq * NB]

    def nnz(self) -> torch.Tensor:
        """Computed (head, query block, key block) triples, a 0-d device tensor (no host synchronisation)."""
        if self.row_end is None:
            return self.indptr[-1].long()
        return (self.row_end - self.indptr[:-1]).sum(dtype=torch.int64)


@dataclass(frozen=True, eq=False)
class PrefillMetadata:
    """What one prefill forward's attention reads, for every layer.

    layers: one LayerCsr per model layer (in mode "dense" the same object for all). Layers decoded in one
    launch share their buffers: `layers[l]` are views into the group's tensors. q_block_start: int32 [NB], the
    row of the packed real tokens holding each block's first slot (tokens are packed in physical order), so
    the kernel reads the model's q and writes the output in token order, with no padded copies of either.
    """

    layout: BatchLayout
    layers: tuple[LayerCsr, ...]
    q_block_start: torch.Tensor
    sparse: bool                    # False: mode "dense" (every causal block, no bits read)

    def nnz(self) -> torch.Tensor:
        """Computed (head, query block, key block) triples over all layers (0-d device tensor)."""
        if not self.sparse:
            return self.layers[0].nnz() * len(self.layers)
        return torch.stack([csr.nnz() for csr in self.layers]).sum()

    @classmethod
    def build(cls, layout: BatchLayout, layers: list[LayerCsr], *, sparse: bool) -> "PrefillMetadata":
        q_block_start = torch.searchsorted(
            layout.token_phys.to(layout.device),
            torch.arange(layout.n_blocks, device=layout.device) * layout.block).to(torch.int32)
        return cls(layout=layout, layers=tuple(layers), q_block_start=q_block_start, sparse=sparse)


@dataclass(frozen=True, eq=False)
class DecodeMetadata:
    """The block table one generation step's decode attention reads.

    Request b's generated tokens fill `gen_blocks` blocks of its own after the prompt blocks; its KV in
    logical order is kv_indices[kv_indptr[b]:kv_indptr[b + 1]] (its prompt blocks, then its generated blocks).
    q_offset: int64 [B], the logical position of each request's first generated token (its prompt length).
    gen_slot0: int64 [B], the physical slot of that token.
    """

    block: int
    gen_blocks: int
    q_offset: torch.Tensor
    gen_slot0: torch.Tensor
    kv_indptr: torch.Tensor         # int32 [B + 1]
    kv_indices: torch.Tensor        # int32 [total blocks]

    @classmethod
    def build(cls, layout: BatchLayout, gen_blocks: int) -> "DecodeMetadata":
        dev, b, nb = layout.device, layout.n_requests, layout.n_blocks
        gen_first = nb + torch.arange(b, device=dev, dtype=torch.int64) * gen_blocks  # [B]
        indptr, prompt_idx = layout_kv_table(layout)
        per_req = [torch.cat([prompt_idx[f:f + n], (gen_first[r] + torch.arange(gen_blocks, device=dev)).int()])
                   for r, (f, n) in enumerate(layout.request_blocks)]
        return cls(block=layout.block, gen_blocks=gen_blocks, q_offset=layout.req_n_tokens.clone(),
                   gen_slot0=gen_first * layout.block,
                   kv_indptr=indptr + torch.arange(b + 1, device=dev, dtype=torch.int32) * gen_blocks,
                   kv_indices=torch.cat(per_req).to(torch.int32))

    def step_slots(self, step: int) -> torch.Tensor:
        """int64 [B]: the physical slot of each request's generated token of decode step `step`."""
        return self.gen_slot0 + step
