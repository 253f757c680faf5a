"""The position-free KV cache (docs/SPEC.md section 5) as the engine's forwards see it: every request's KV lives
in pages of the KV store's pool (runtime/kv_store.py), whatever the mode.

Keys are stored rotated at segment-local positions (each segment starts at local position 0) and each block
table entry records the logical position of its segment's first token: the attention kernels rotate by that
offset, so the stored keys never depend on where a segment sits in a prompt. Per page the pool records how many
of its slots hold real tokens (`block_valid`); padding slots may hold anything and are never attended.

    PoolKV          the pool as one decode step reads and appends to it (any request, through block tables)
    PagedKVCache    one prefill forward's view: logical block b of its layout lives in page `block_pages[b]`
                    (a document's shared page or a page of the request's own), the forward's computed tokens
                    are written to `token_slots`
    BatchKVCache    K / V of one forward in tensors of its own (the deviation policy's in-context keys, which
                    must not enter the pool)
"""
from __future__ import annotations

import torch

from ..kernels.layout import BatchLayout, gather_blocks


class PoolKV:
    """The store's pool: `layer_kv` views [Hkv, pool slots, D] of one layer (token-major underneath),
    `block_valid` int32 [pages]. Its methods are its whole contract."""

    def __init__(self, store):
        self.store = store
        self.block = store.geometry.block
        self.block_valid = store.page_valid

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[Hkv, pool slots, D] views of the whole pool (the kernels read the pages in place)."""
        return self.store.k_pool[layer].transpose(0, 1), self.store.v_pool[layer].transpose(0, 1)

    def claim(self, pages: torch.Tensor, valid: torch.Tensor) -> None:
        """Pages the caller is about to write: their real slot counts (int [n]) before the forward."""
        self.block_valid[pages] = valid.to(torch.int32)

    def advance(self, slots: torch.Tensor) -> None:
        """Make the slots of this step's generated tokens (int64 [B], one per request) valid in their pages
        (generation pages fill in slot order)."""
        self.block_valid[slots // self.block] = (slots % self.block + 1).to(torch.int32)

    def append(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """key / value: [Hkv, B, D], one generated token per request -> pool `slots` (int64 [B])."""
        self.store.k_pool[layer].index_copy_(0, slots, key.transpose(0, 1))
        self.store.v_pool[layer].index_copy_(0, slots, value.transpose(0, 1))

    def append_target(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What `append` writes to, for a kernel that appends the rows itself (kernels/rope.py `rotary_qk`'s
        append_to): the layer's token-major k and v pools [pool slots, Hkv, D] and `slots` (int64 [B])."""
        return self.store.k_pool[layer], self.store.v_pool[layer], slots


class PagedKVCache(PoolKV):
    """One prefill forward's KV in the pool: logical block b of `layout` is page `block_pages[b]` (int64 [NB]),
    so a document placed at different offsets by several requests is one physical copy. Only the tokens the
    forward computes are written (`token_slots`: their pool slots, in the forward's token order); the others are
    read from the pages as the store holds them. The prefill kernels read the pool in place through
    `prompt_pages`; `prompt_kv` gathers a layer's blocks in logical order for the ref twins. leases: the
    store leases whose promoted documents a layer's attention must wait for."""

    def __init__(self, layout: BatchLayout, store, leases, block_pages: torch.Tensor, token_slots: torch.Tensor):
        super().__init__(store)
        self.layout, self.leases = layout, list(leases)
        self.n_layers = store.geometry.n_layers
        self.block_pages = block_pages
        self.token_slots = token_slots
        self.kv_pages = block_pages.to(torch.int32)
        self._written: set[int] = set()

    @property
    def layers_written(self) -> int:
        """How many layers the forward wrote (every layer must: proof that each ran the engine's attention)."""
        return len(self._written)

    def write_prompt(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """key / value: [Hkv, n computed, D] -> their pool slots."""
        for lease in self.leases:   # a promotion into other pages of this layer may still be running
            lease.wait_layer(layer)
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


class BatchKVCache:
    """K / V of one forward's prompt in tensors of its own: [n_layers] x [Hkv, NB * block, D] in the layout's
    physical slots, allocated at the first write with the model's dtype (padding slots zero)."""

    def __init__(self, layout: BatchLayout, n_layers: int):
        self.layout, self.n_layers = layout, n_layers
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._written: set[int] = set()

    @property
    def layers_written(self) -> int:
        return len(self._written)

    def write_prompt(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """key / value: [Hkv, n_real, D], the batch's real tokens in packed order -> their physical slots."""
        if self._k is None:
            shape = (self.n_layers, key.shape[0], self.layout.n_slots, key.shape[2])
            self._k = torch.zeros(shape, dtype=key.dtype, device=key.device)
            self._v = torch.zeros(shape, dtype=key.dtype, device=key.device)
        slots = self.layout.token_phys
        self._k[layer].index_copy_(1, slots, key)
        self._v[layer].index_copy_(1, slots, value)
        self._written.add(layer)

    def prompt_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[Hkv, NB * block, D]: the layer's prompt slots."""
        return self._k[layer], self._v[layer]

    def prompt_pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, None]:
        """What the prefill kernels read: the prompt's blocks in logical order (no page table)."""
        return *self.prompt_kv(layer), None
