"""The position-free KV cache of one batch (docs/SPEC.md section 5): its own tensors (`BatchKVCache`, modes "sift"
and "dense") or pages of the document KV store's pool (`PagedKVCache`, modes "reuse" and "hybrid").

Keys are stored rotated at segment-local positions (each segment starts at local position 0) and each block
records the logical position of its segment's first token (`block_offset`): the attention kernels rotate by
that offset, so the stored keys never depend on where a segment sits in a prompt. The cache holds every
layer's K and V in the batch's physical slots (the prompt's blocks, then `gen_blocks` blocks per request for
generated tokens) and, per block, how many of its slots hold real tokens (`block_valid`); padding slots are
zero and never attended.

Both caches give the decode step the same view: `layer_kv(layer)` is a tensor of physical blocks (pages),
`block_valid` the real slots of each physical block, `block_pages` the physical block of each of the prompt's
logical blocks and `gen_pages` [B, gen_blocks] those of each request's generated tokens.
"""
from __future__ import annotations

import torch

from ..kernels.layout import BatchLayout, gather_blocks


class BatchKVCache:
    """K / V: [n_layers] x [Hkv, slots, D], allocated at the first write with the model's dtype. Its methods
    are its whole contract: `write_prompt` / `prompt_kv` during the prefill, `append` / `layer_kv` during
    generation, `advance` before each generation step."""

    def __init__(self, layout: BatchLayout, n_layers: int, *, gen_blocks: int = 0):
        dev, b = layout.device, layout.n_requests
        self.layout = layout
        self.n_layers = n_layers
        self.n_slots = (layout.n_blocks + b * gen_blocks) * layout.block
        self.block_valid = torch.cat([layout.block_valid, torch.zeros(b * gen_blocks, dtype=torch.int32, device=dev)])
        # A request's generated segment starts at its next logical position: its prompt length.
        self.block_offset = torch.cat([layout.block_offset, layout.req_n_tokens.repeat_interleave(gen_blocks)])
        nb = layout.n_blocks
        self.block_pages = torch.arange(nb, dtype=torch.int64, device=dev)
        self.gen_pages = nb + torch.arange(b * gen_blocks, dtype=torch.int64, device=dev).view(b, gen_blocks)
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._written: set[int] = set()

    def _allocate(self, like: torch.Tensor) -> None:
        shape = (self.n_layers, like.shape[0], self.n_slots, like.shape[2])
        self._k = torch.zeros(shape, dtype=like.dtype, device=like.device)
        self._v = torch.zeros(shape, dtype=like.dtype, device=like.device)

    @property
    def layers_written(self) -> int:
        """How many layers the prefill wrote (every layer must: proof that each ran the engine's attention)."""
        return len(self._written)

    def write_prompt(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """key / value: [Hkv, n_real, D], the batch's real tokens in packed order -> their physical slots."""
        if self._k is None:
            self._allocate(key)
        slots = self.layout.token_phys
        self._k[layer].index_copy_(1, slots, key)
        self._v[layer].index_copy_(1, slots, value)
        self._written.add(layer)

    def prompt_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[Hkv, NB * block, D] views of the prompt's slots (the first slots of the layer's cache)."""
        n = self.layout.n_slots
        return self._k[layer][:, :n], self._v[layer][:, :n]

    def prompt_pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, None]:
        """What the prefill kernels read: the prompt's blocks are the cache's first blocks, in logical order
        (no page table)."""
        return *self.prompt_kv(layer), None

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[Hkv, slots, D]: the layer's whole cache, generated blocks included."""
        return self._k[layer], self._v[layer]

    def advance(self, slots: torch.Tensor) -> None:
        """Make the slots of the next generated tokens (int64 [B], one per request) valid in their blocks."""
        block = self.layout.block
        self.block_valid[slots // block] = (slots % block + 1).to(torch.int32)

    def append(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """key / value: [Hkv, B, D], one generated token per request -> `slots` (int64 [B])."""
        self._k[layer].index_copy_(1, slots, key)
        self._v[layer].index_copy_(1, slots, value)


class PagedKVCache:
    """A batch's KV inside the KV store's pool (runtime/kv_store.py): logical block b of the layout lives in pool
    page `block_pages[b]` (a document's shared page, or one of the call's scratch pages), so a document placed
    at different offsets by several requests is one physical copy. Only the tokens the forward computes
    (`token_slots`: their pool slots, in the forward's token order) are written; the others are read from the
    pages as the store holds them. The kernels read the pool in place: the decode through its block table,
    the prefill through `prompt_pages` (the page of each logical block); `prompt_kv` gathers a layer's blocks in
    logical order for the ref twins."""

    def __init__(self, layout: BatchLayout, store, lease, block_pages: torch.Tensor, token_slots: torch.Tensor,
                 gen_pages: torch.Tensor):
        self.layout, self.store, self.lease = layout, store, lease
        self.n_layers = store.geometry.n_layers
        self.block_pages = block_pages              # int64 [NB]
        self.gen_pages = gen_pages                  # int64 [B, gen_blocks]
        self.token_slots = token_slots              # int64 [n computed tokens]
        self.block_valid = store.page_valid         # int32 [pool pages]
        self.kv_pages = block_pages.to(torch.int32)
        self._written: set[int] = set()

    @property
    def layers_written(self) -> int:
        return len(self._written)

    def write_prompt(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """key / value: [Hkv, n computed, D] -> their pool slots."""
        self.lease.wait_layer(layer)   # a promotion into other pages of this layer may still be running
        self.store.k_pool[layer].index_copy_(0, self.token_slots, key.transpose(0, 1))
        self.store.v_pool[layer].index_copy_(0, self.token_slots, value.transpose(0, 1))
        self._written.add(layer)

    def prompt_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[Hkv, NB * block, D]: the prompt's blocks in logical order, gathered from their pages (a copy)."""
        k, v, pages = self.prompt_pages(layer)
        return gather_blocks(k, pages, self.layout.block), gather_blocks(v, pages, self.layout.block)

    def prompt_pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[Hkv, pool slots, D] views of the layer's pool and int32 [NB], the page of each logical block: what the
        prefill kernels read in place (`sparse_attention(..., kv_pages=)`)."""
        return *self.layer_kv(layer), self.kv_pages

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[Hkv, pool slots, D] views of the whole pool (the decode kernel reads the pages in place)."""
        return self.store.k_pool[layer].transpose(0, 1), self.store.v_pool[layer].transpose(0, 1)

    def advance(self, slots: torch.Tensor) -> None:
        block = self.layout.block
        self.block_valid[slots // block] = (slots % block + 1).to(torch.int32)

    def append(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        self.store.k_pool[layer].index_copy_(0, slots, key.transpose(0, 1))
        self.store.v_pool[layer].index_copy_(0, slots, value.transpose(0, 1))
