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
