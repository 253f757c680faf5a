"""The engine's attention backends, chosen once when the engine is made.

    TritonBackend      "triton", CUDA (or TRITON_INTERPRET=1): the one-pass index decode over groups of layers,
                       the sparse prefill kernel (Gluon on sm_90, tl elsewhere) reading q and writing the output
                       in token order, the split-K decode kernel
    TorchBackend       "torch", CPU: the kernels' ref twins for the index decode and the decode step, and the
                       prefill attention `sparse_attention_sdpa` (torch's SDPA per request: the ref twin's result,
                       fast enough for whole models)
    ReferenceBackend   "reference": the kernels' ref twins everywhere (small models only)

Names. "triton", "torch" and "reference" are what users pass (`SiftEngine(backend=...)`, `sift-eval --backend`)
and, with the builder's `build.backend` ("torch": the profiling kernel's ref twin `profile_layer_ref`), what an
index's manifest records: they name a whole backend and do not change. Inside kernels/, "ref" names a kernel's
reference twin (`*_ref`: plain torch, the kernel's signature and result, loops that mirror it; the oracle of the
tests and the CPU fallback) and "sdpa" the vectorised CPU attention; "torch" is never a kernel's name there.

Each backend turns a batch's bits into `LayerCsr`s (`decode_indices`), attends a prefill layer
(`prefill`) and a decode step (`decode`), and says whether a CUDA graph can capture its decode (`capturable`);
the engine never compares backend names.
"""
from __future__ import annotations

import torch

from ..kernels.block_indices import DocBits, block_indices_layers, block_indices_ref, dense_block_indices, dense_indptr
from ..kernels.decode_attention import decode_attention, decode_attention_ref
from ..kernels.device import resolve_backend
from ..kernels.layout import BatchLayout
from ..kernels.sparse_attention import sparse_attention, sparse_attention_ref, sparse_attention_sdpa
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
        return sparse_attention_sdpa(q, k, v, csr.indptr, csr.indices, meta.layout, inv_freq, scale=scale,
                                      causal=not meta.sparse, row_end=csr.row_end, q_blocks=meta.q_blocks,
                                      parallel=meta.parallel, ape=meta.ape)

    def decode(self, meta: DecodeMetadata, cache: PoolKV, layer: int, q, inv_freq, scale: float):
        """q [B, Hq, D], one token per row -> [B, Hq, D]."""
        kc, vc = cache.layer_kv(layer)
        n = int(meta.kv_indptr[-1])          # the entries in use (the buffers are sized for the largest batch)
        rescale = {} if meta.ape is None else dict(parallel=meta.kv_parallel[:n], ape=meta.ape)
        return decode_attention_ref(q, kc, vc, meta.q_offset, meta.kv_indptr, meta.kv_indices[:n],
                                    cache.block_valid, meta.kv_offset[:n], inv_freq, scale=scale, block=meta.block,
                                    **rescale)


class ReferenceBackend(TorchBackend):
    name = "reference"

    def _attend(self, q, k, v, csr: LayerCsr, meta: PrefillMetadata, inv_freq, scale: float):
        lay = meta.layout
        return sparse_attention_ref(q, k, v, csr.indptr, csr.indices, lay.block_valid, lay.block_offset, inv_freq,
                                    scale=scale, block=lay.block, row_end=csr.row_end, q_blocks=meta.q_blocks,
                                    parallel=meta.parallel, ape=meta.ape)


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
                         row_end=csr.row_end, q_blocks=meta.q_blocks, kv_pages=pages, parallel=meta.parallel,
                         ape=meta.ape)
        return buf.unsqueeze(0)

    def decode(self, meta: DecodeMetadata, cache: PoolKV, layer: int, q, inv_freq, scale: float):
        """The split count is the metadata's (fixed by capacity): a captured step replays with any tables."""
        kc, vc = cache.layer_kv(layer)
        rescale = {} if meta.ape is None else dict(parallel=meta.kv_parallel, ape=meta.ape)
        return decode_attention(q, kc, vc, meta.q_offset, meta.kv_indptr, meta.kv_indices, cache.block_valid,
                                meta.kv_offset, inv_freq, scale=scale, block=meta.block, num_splits=meta.num_splits,
                                **rescale)


def select_backend(name: str, device: torch.device):
    """The backend `name` resolves to on `device` (`resolve_backend`: "auto" is triton on CUDA, torch on CPU)."""
    name = resolve_backend(name, device, choices=NAMES)
    return {"triton": TritonBackend, "torch": TorchBackend, "reference": ReferenceBackend}[name]()
