"""How the engine's attention runs inside an unchanged transformers forward: the model's attention calls are
routed through transformers' AttentionInterface to `sift_attention`, and the per-forward state (what to write
into the KV cache, which kernel and which block CSR to attend with) travels in the model's kwargs as
`sift_state`. Made by the runner (runtime/runner.py) for each prefill forward and once per decode batch size.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

from ..kernels.layout import QUERY
from ..kernels.rope import apply_rope_ref
from .kv_cache import PagedKVCache, PoolKV
from .metadata import DecodeMetadata, PrefillMetadata

ATTN_NAME = "sift_runtime"
STAGES = ("fetch", "decode", "attention", "store")


# ------------------------------------------------------------------------------------------------- timing


class Timer:
    """Stage totals: CUDA events on a GPU (read once, at the end), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self._events: dict[str, list] = defaultdict(list)

    @contextlib.contextmanager
    def __call__(self, stage: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events[stage].append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.seconds[stage] += time.perf_counter() - t0

    def add(self, stage: str, seconds: float) -> None:
        """Host seconds of a stage measured by the caller (the KV store's bookkeeping)."""
        self.seconds[stage] += seconds

    def totals(self) -> dict[str, float]:
        if self.cuda:
            # The call's own stream: the KV store's write-back to DRAM runs on, and outlives the call.
            torch.cuda.current_stream(self.device).synchronize()
            for stage, pairs in self._events.items():
                self.seconds[stage] += sum(s.elapsed_time(e) for s, e in pairs) / 1e3
            self._events.clear()
        return {s: self.seconds.get(s, 0.0) for s in STAGES}


# ------------------------------------------------------------------------------------ per-forward state


class PrefillAttention:
    """The attention of one prefill forward (handed to `sift_attention` through the model kwargs): writes each
    layer's position-free K/V into the cache, then attends with the backend over the metadata's CSR."""

    def __init__(self, backend, meta: PrefillMetadata, cache: PagedKVCache, inv_freq, timer: Timer):
        self.backend, self.meta, self.cache, self.inv_freq, self.timer = backend, meta, cache, inv_freq, timer

    def attend(self, layer: int, query, key, value, scale: float):
        """query [1, Hq, n_real, D], key / value [1, Hkv, n_real, D] -> [1, n_real, Hq, D]."""
        self.cache.write_prompt(layer, key[0], value[0])
        with self.timer("attention"):
            out = self.backend.prefill(self.meta, self.cache, layer, query, self.inv_freq, scale)
        return out, None


class DecodeAttention:
    """The attention of one decode step: one token per row, appended to the pool at the row's slot (here, or by
    the fast forward's rotary kernel) and attended over the row's block table. Nothing here reads the data on the
    host: a CUDA graph captures it."""

    def __init__(self, backend, meta: DecodeMetadata, cache: PoolKV, inv_freq):
        self.backend, self.meta, self.cache, self.inv_freq = backend, meta, cache, inv_freq

    def append_target(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where this step's K / V rows of `layer` go (PoolKV.append_target), for a forward whose rotary kernel
        writes them itself; it then attends with appended=True."""
        return self.cache.append_target(layer, self.meta.slots)

    def attend(self, layer: int, query, key, value, scale: float, appended: bool = False):
        """query [1, Hq, B, D], key / value [1, Hkv, B, D] -> [1, B, Hq, D]. appended: the caller has written key
        and value to `append_target(layer)` already."""
        if not appended:
            self.cache.append(layer, self.meta.slots, key[0], value[0])
        out = self.backend.decode(self.meta, self.cache, layer, query[0].transpose(0, 1), self.inv_freq, scale)
        return out.unsqueeze(0), None


def sift_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sift_state=None,
                    **kwargs):
    """AttentionInterface function of the engine: the per-forward state comes in through the model kwargs."""
    if sift_state is None:
        raise RuntimeError(f"attention implementation {ATTN_NAME!r} runs only inside a SiftEngine forward")
    return sift_state.attend(module.layer_idx, query, key, value, scaling)


class Stopped(Exception):
    """Raised inside a forward that only needs its first layers' keys."""


class StopAfter(PrefillAttention):
    """Attend normally up to layer `stop`, write that layer's K / V, then stop the forward."""

    def __init__(self, backend, meta, cache, inv_freq, timer, stop: int):
        super().__init__(backend, meta, cache, inv_freq, timer)
        self.stop = stop

    def attend(self, layer: int, query, key, value, scale: float):
        if layer == self.stop:
            self.cache.write_prompt(layer, key[0], value[0])
            raise Stopped
        return super().attend(layer, query, key, value, scale)


class QueryMass(PrefillAttention):
    """Attend as the forward does and, at each layer of `layers`, add to `mass` (fp32 [NB], the layout's blocks)
    the attention each request's last `rows` query rows (blocks of kind QUERY) put on each block of it: the
    softmax over every key the row attends to causally, summed over heads and rows. The forward stops after the
    last of `layers` (policy "query", runtime/reuse.py). The scores are recomputed in fp32 from the layer's q and the
    keys the kernels read (rotated to logical positions), since the kernels return no probabilities."""

    def __init__(self, backend, meta: PrefillMetadata, cache: PagedKVCache, inv_freq, timer: Timer, layers,
                 rows: int):
        super().__init__(backend, meta, cache, inv_freq, timer)
        self.layers, self.last = frozenset(layers), max(layers)
        lay = meta.layout
        self.mass = torch.zeros(lay.n_blocks, dtype=torch.float32, device=meta.token_phys.device)
        token_of = torch.full((lay.n_slots,), -1, dtype=torch.long, device=lay.token_phys.device)
        token_of[lay.token_phys.long()] = torch.arange(len(lay.token_phys), device=token_of.device)
        row_token = token_of[meta.token_phys.long()]                        # the forward's rows -> token index
        is_query = lay.block_kind[meta.token_phys.long() // lay.block] == QUERY
        offset = lay.token_logical_pos - lay.token_local_pos
        self.requests = []      # per request: its query rows, their offsets and causal mask; its keys
        for first, n in zip(lay.req_first_token.tolist(), lay.req_n_tokens.tolist()):
            mine = (is_query & (row_token >= first) & (row_token < first + n)).nonzero().flatten()[-rows:]
            if mine.numel():
                keys = lay.token_phys[first:first + n].long()
                causal = (row_token[mine, None] - first) >= torch.arange(n, device=mine.device)[None, :]
                self.requests.append((mine, offset[row_token[mine]], causal, keys, offset[first:first + n]))

    def attend(self, layer: int, query, key, value, scale: float):
        if layer not in self.layers:
            return super().attend(layer, query, key, value, scale)
        self.cache.write_prompt(layer, key[0], value[0])
        k, _, pages = self.cache.prompt_pages(layer)
        self._add(query[0], k, pages, scale)
        if layer == self.last:
            raise Stopped
        with self.timer("attention"):
            out = self.backend.prefill(self.meta, self.cache, layer, query, self.inv_freq, scale)
        return out, None

    def _add(self, q: torch.Tensor, k: torch.Tensor, pages: torch.Tensor | None, scale: float) -> None:
        """q [Hq, n rows, D] in the forward's row order; k [Hkv, slots, D]: the pool, logical block b in page
        pages[b] (None: k is in the layout's slots)."""
        hq, d = q.shape[0], q.shape[2]
        hkv = k.shape[0]
        blk = self.meta.layout.block
        for rows, row_off, causal, keys, key_off in self.requests:
            slots = keys if pages is None else pages[keys // blk].long() * blk + keys % blk
            qr = apply_rope_ref(q[:, rows].float(), row_off, self.inv_freq)           # [Hq, m, D]
            kr = apply_rope_ref(k[:, slots].float(), key_off, self.inv_freq)          # [Hkv, n, D]
            m = rows.numel()
            s = torch.matmul(qr.view(hkv, hq // hkv * m, d), kr.transpose(1, 2)) * scale
            s = s.view(hkv, hq // hkv, m, -1).masked_fill(~causal, float("-inf"))
            self.mass.index_add_(0, keys // blk, torch.softmax(s, dim=-1).sum(dim=(0, 1, 2)))
