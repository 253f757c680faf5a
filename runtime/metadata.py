"""Per-batch attention metadata, built once before the forward; the attention callback only reads it.

    PrefillMetadata   layout + every layer's block CSR (decoded from the bits, in layer groups) + the row of the
                      forward's tokens holding each block's first slot + which query blocks the forward computes
    DecodeMetadata    the block table of each row of a decode step (the pages of its prompt, then of its generated
                      tokens), the rotation offset of each entry, the logical position of each request's
                      generated segment and the slot each row's new token goes to; with APE rows, which
                      entries are reused documents' blocks and each row's (temperature, scale)

The valid slots of each page belong to the KV the page holds: they live in the pool (runtime/kv_cache.py). A
rotation offset belongs to a block's place in a request: one page of a shared document has one offset per
request that holds it, so the decode table carries one per entry.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

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
    row of the forward's tokens holding each block's first slot (tokens are packed in physical order), so
    the kernel reads the model's q and writes the output in token order, with no padded copies of either.
    q_blocks: None (every block is a query block: the forward runs every token) or int32 [NQ], the blocks whose
    tokens the forward runs (modes "reuse" / "hybrid": the others' KV comes from the store); CSR rows are then
    h * NQ + i. token_phys: int64 [n forward tokens], each forward token's slot in the layout.
    parallel / ape: mode "ape": int32 [NB], nonzero for the document blocks read from the KV store, and the
    (temperature, scale) that rescales every computed row's attention to them (kernels/ape.py); None otherwise.
    """

    layout: BatchLayout
    layers: tuple[LayerCsr, ...]
    q_block_start: torch.Tensor
    sparse: bool                    # False: every row is dense causal (no bits read)
    token_phys: torch.Tensor
    q_blocks: torch.Tensor | None = None
    parallel: torch.Tensor | None = None
    ape: tuple[float, float] | None = None

    def nnz(self) -> torch.Tensor:
        """Computed (head, query block, key block) triples over all layers (0-d device tensor)."""
        if not self.sparse:
            return self.layers[0].nnz() * len(self.layers)
        return torch.stack([csr.nnz() for csr in self.layers]).sum()

    @classmethod
    def build(cls, layout: BatchLayout, layers: list[LayerCsr], *, sparse: bool,
              q_blocks: torch.Tensor | None = None) -> "PrefillMetadata":
        """q_blocks: int64 [NQ] ascending, the blocks the forward computes (None: all); `layers` then hold
        every block's row and are cut to those rows here."""
        token_phys = layout.token_phys.to(layout.device)
        if q_blocks is not None:
            computed = torch.zeros(layout.n_blocks, dtype=torch.bool, device=layout.device)
            computed[q_blocks] = True
            token_phys = token_phys[computed[token_phys // layout.block]]
            n_heads = (layers[0].indptr.numel() - 1) // layout.n_blocks
            layers = _select_rows(layers, q_blocks, n_heads, layout.n_blocks)
            q_blocks = q_blocks.to(torch.int32)
        q_block_start = torch.searchsorted(
            token_phys, torch.arange(layout.n_blocks, device=layout.device) * layout.block).to(torch.int32)
        return cls(layout=layout, layers=tuple(layers), q_block_start=q_block_start, sparse=sparse,
                   token_phys=token_phys, q_blocks=q_blocks)


def _select_rows(layers: list[LayerCsr], q_blocks: torch.Tensor, n_heads: int, nb: int) -> list[LayerCsr]:
    """Every layer's rows of the query blocks `q_blocks` only (row h * NQ + i <- h * NB + q_blocks[i]), as a
    row_end CSR over the same indices; layers that share one CSR object keep sharing the cut one."""
    rows = (torch.arange(n_heads, device=q_blocks.device)[:, None] * nb + q_blocks[None, :]).flatten()
    cut: dict[int, LayerCsr] = {}
    out = []
    for csr in layers:
        if id(csr) not in cut:
            starts = csr.indptr[:-1]
            ends = csr.indptr[1:] if csr.row_end is None else csr.row_end
            start, end = starts[rows], ends[rows]
            cut[id(csr)] = LayerCsr(torch.cat([start, end[-1:]]).to(torch.int32), csr.indices,
                                    end.to(torch.int32))
        out.append(cut[id(csr)])
    return out


@dataclass(frozen=True, eq=False)
class DecodeMetadata:
    """The block tables one decode step reads: views of the decode batch's static buffers (runtime/runner.py),
    made once per batch size and read by every replay while the runner rewrites their contents in place.

    Row b's KV in logical order is the pages kv_indices[kv_indptr[b]:kv_indptr[b + 1]] (its prompt blocks, then
    its generation pages); kv_offset, parallel to kv_indices, is the logical position of the first token of each
    entry's segment. q_offset: int32 [B], the logical position of each row's first generated token (its prompt
    length). slots: int64 [B], the pool slot each row's token of this step goes to. num_splits: programs per
    (row, kv head) of the split-K decode kernel, fixed by the buffers' capacity (never by the data, so a
    captured step replays with any tables).
    """

    block: int
    q_offset: torch.Tensor          # int32 [B]
    kv_indptr: torch.Tensor         # int32 [B + 1]
    kv_indices: torch.Tensor        # int32 [capacity]
    kv_offset: torch.Tensor         # int32 [capacity]
    slots: torch.Tensor             # int64 [B]
    num_splits: int | None = None
    kv_parallel: torch.Tensor | None = None   # int32 [capacity]: entry is a reused document's block (mode "ape")
    ape: torch.Tensor | None = None           # fp32 [B, 2]: each row's (temperature, scale); (1, 1) when plain
