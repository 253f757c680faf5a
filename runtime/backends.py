"""The engine's attention backends, chosen once when the engine is made.

    TritonBackend      CUDA (or TRITON_INTERPRET=1): the one-pass index decode over groups of layers, the sparse
                       prefill kernel (Gluon on sm_90, tl elsewhere) reading q and writing the output in token
                       order, the split-K decode kernel
    TorchBackend       CPU: the kernels' torch twins for the index decode and the decode step, and a whole-request
                       torch prefill attention equal to `sparse_attention_ref` but fast enough for whole models
    ReferenceBackend   the kernels' torch twins everywhere (small models only)

Each backend turns a batch's bits into `LayerCsr`s (`decode_indices`), attends a prefill layer
(`prefill`) and a decode step (`decode`), and says whether a CUDA graph can capture its decode (`capturable`);
the engine never compares backend names.
"""
from __future__ import annotations

import os

import torch

from sift.errors import SiftError

from ..kernels.block_indices import DocBits, block_indices_layers, block_indices_ref, dense_block_indices, dense_indptr
from ..kernels.decode_attention import decode_attention, decode_attention_ref
from ..kernels.layout import BatchLayout
from ..kernels.sparse_attention import sparse_attention, sparse_attention_ref, sparse_attention_torch
from .kv_cache import PagedKVCache, PoolKV
from .metadata import DecodeMetadata, LayerCsr, PrefillMetadata

NAMES = ("auto", "triton", "torch", "reference")
# Indices of up to this many bytes are decoded in one launch for consecutive layers (`block_indices_layers`):
# the decode is latency bound, so one launch for G layers costs far less than G launches.
DECODE_GROUP_BYTES = 64 << 20


def dense_layers(layout: BatchLayout, n_heads: int, n_layers: int) -> list[LayerCsr]:
    """mode "dense": every causal block of the request, the same CSR object for every layer."""
    csr = LayerCsr(*dense_block_indices(layout, n_heads), None)
    return [csr] * n_layers


class TorchBackend:
    name = "torch"
    capturable = False      # its decode reads the block table on the host: no CUDA graph

    def decode_indices(self, layout: BatchLayout, bits: DocBits, tile: int, n_heads: int) -> list[LayerCsr]:
        la_ptr, ca_ptr = bits.all_layer_ptrs()
        return [LayerCsr(*block_indices_ref(layout, bits.la_bytes, la_ptr[layer], bits.ca_bytes, ca_ptr[layer],
                                            tile), None)
                for layer in range(bits.n_layers)]

    def prefill(self, meta: PrefillMetadata, cache: PagedKVCache, layer: int, query, inv_freq,
                scale: float) -> torch.Tensor:
        """query [1, Hq, n, D], the forward's tokens in token order, over the layer's prompt KV in the cache (its
        blocks gathered in logical order) -> [1, n, Hq, D]."""
        lay = meta.layout
        k, v = cache.prompt_kv(layer)
        q = query.new_zeros(query.shape[1], lay.n_slots, query.shape[3])
        q[:, meta.token_phys] = query[0]
        out = self._attend(q, k, v, meta.layers[layer], meta, inv_freq, scale)
        return out[:, meta.token_phys].transpose(0, 1).unsqueeze(0)

    def _attend(self, q, k, v, csr: LayerCsr, meta: PrefillMetadata, inv_freq, scale: float):
        return sparse_attention_torch(q, k, v, csr.indptr, csr.indices, meta.layout, inv_freq, scale=scale,
                                      causal=not meta.sparse, row_end=csr.row_end, q_blocks=meta.q_blocks)

    def decode(self, meta: DecodeMetadata, cache: PoolKV, layer: int, q, inv_freq, scale: float):
        """q [B, Hq, D], one token per row -> [B, Hq, D]."""
        kc, vc = cache.layer_kv(layer)
        n = int(meta.kv_indptr[-1])          # the entries in use (the buffers are sized for the largest batch)
        return decode_attention_ref(q, kc, vc, meta.q_offset, meta.kv_indptr, meta.kv_indices[:n],
                                    cache.block_valid, meta.kv_offset[:n], inv_freq, scale=scale, block=meta.block)


class ReferenceBackend(TorchBackend):
    name = "reference"

    def _attend(self, q, k, v, csr: LayerCsr, meta: PrefillMetadata, inv_freq, scale: float):
        lay = meta.layout
        return sparse_attention_ref(q, k, v, csr.indptr, csr.indices, lay.block_valid, lay.block_offset, inv_freq,
                                    scale=scale, block=lay.block, row_end=csr.row_end, q_blocks=meta.q_blocks)


class TritonBackend:
    name = "triton"
    capturable = True       # its decode step launches kernels only: a CUDA graph captures it

    def decode_indices(self, layout: BatchLayout, bits: DocBits, tile: int, n_heads: int) -> list[LayerCsr]:
        """Rows at their dense starts (one pass, no count pass); as many consecutive layers per launch as
        DECODE_GROUP_BYTES of indices hold (every layer at 16K tokens of an 8B model, 3 at 64K)."""
        la_ptr, ca_ptr = bits.all_layer_ptrs()
        row_start = dense_indptr(layout, n_heads)
        per_layer = 4 * max(1, n_heads * layout.causal_block_pairs)
        group = max(1, DECODE_GROUP_BYTES // per_layer)
        layers: list[LayerCsr] = []
        for first in range(0, bits.n_layers, group):
            last = min(bits.n_layers, first + group)
            _, idx, ends = block_indices_layers(layout, bits.la_bytes, la_ptr[first:last], bits.ca_bytes,
                                                ca_ptr[first:last], tile, row_start=row_start)
            layers += [LayerCsr(row_start, idx[g], ends[g]) for g in range(last - first)]
        return layers

    def prefill(self, meta: PrefillMetadata, cache: PagedKVCache, layer: int, query, inv_freq,
                scale: float) -> torch.Tensor:
        """The kernel reads the cache's pages in place (`prompt_pages`)."""
        lay, csr = meta.layout, meta.layers[layer]
        k, v, pages = cache.prompt_pages(layer)
        hq, n, d = query.shape[1:]
        buf = torch.empty(n, hq, d, dtype=query.dtype, device=query.device)  # o_proj's layout
        sparse_attention(query[0], k, v, csr.indptr, csr.indices, lay.block_valid, lay.block_offset, inv_freq,
                         scale=scale, block=lay.block, out=buf.transpose(0, 1), q_block_start=meta.q_block_start,
                         row_end=csr.row_end, q_blocks=meta.q_blocks, kv_pages=pages)
        return buf.unsqueeze(0)

    def decode(self, meta: DecodeMetadata, cache: PoolKV, layer: int, q, inv_freq, scale: float):
        """The split count is the metadata's (fixed by capacity): a captured step replays with any tables."""
        kc, vc = cache.layer_kv(layer)
        return decode_attention(q, kc, vc, meta.q_offset, meta.kv_indptr, meta.kv_indices, cache.block_valid,
                                meta.kv_offset, inv_freq, scale=scale, block=meta.block, num_splits=meta.num_splits)


def select_backend(name: str, device: torch.device):
    """"auto" picks triton on CUDA and torch on CPU."""
    if name not in NAMES:
        raise SiftError(f"backend={name!r} must be one of {', '.join(NAMES)}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SiftError("backend='triton' needs the model on a CUDA device (or TRITON_INTERPRET=1); use "
                        "backend='torch' on CPU")
    return {"triton": TritonBackend, "torch": TorchBackend, "reference": ReferenceBackend}[name]()
