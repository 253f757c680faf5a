"""The SIFT serving engine: RAG requests in, last-position logits and greedy generations out (SPEC sections 4, 5).

One request walks forward through these steps:

    Request(prefix, docs, query)      text; docs as (doc_id, text), the way retrieval returns them
      -> segments of token ids        prefix with the tokenizer's special tokens, docs and query without
      -> stale / unknown checks       each document's ids must hash to the index's content_hash
      -> BatchLayout                  segments padded to kernel blocks, logical and segment-local positions
      -> index.fetch                  all layers' bits of the batch's documents, once per batch, on the device
      -> model forward                the unchanged transformers model on the packed real tokens [1, n_real],
                                      position_ids = segment-LOCAL positions, attention routed through
                                      AttentionInterface to `_sift_attention`:
                                        scatter q/k/v to the physical layout, decode the layer's CSR from the
                                        bits (or the dense CSR), sparse attention with the relative RoPE of
                                        each K tile, gather back; keep the layer's position-free K/V
      -> lm_head on each request's last position only

Generation appends a "generated" segment per request, starting at the request's next logical position: each
step runs the model on one token per request at its local position in that segment, writes its K/V into the
position-free cache and attends with the decode kernel, which rotates q once per segment (LazyAttention).

Backends: "triton" (CUDA kernels), "torch" (CPU: the kernels' torch twins for the CSR decode and the decode
step, and a vectorised torch prefill attention equal to `sparse_attention_ref`, whose per-(head, block) loops are
too slow for whole models), "reference" (the kernels' torch twins everywhere; small models only). "auto" picks
triton on CUDA and torch on CPU; the result records which one ran.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import torch

from sift.errors import SiftError
from sift.format import content_hash

from ..kernels.block_indices import (DocBits, block_indices_layers, block_indices_ref, dense_block_indices,
                                     dense_indptr)
from ..kernels.decode_attention import decode_attention, decode_attention_ref, layout_kv_table
from ..kernels.layout import BatchLayout, build_layout
from ..kernels.rope import apply_rope_ref, rope_inv_freq
from ..kernels.sparse_attention import BLOCKS, HEAD_DIMS, sparse_attention, sparse_attention_ref

from .store import SiftIndex

ATTN_NAME = "sift_runtime"
MODES = ("sift", "dense")
BACKENDS = ("auto", "triton", "torch", "reference")
ON_UNKNOWN = ("error", "dense")
GPU_BLOCK = 128
STAGES = ("fetch", "decode", "attention")
# Indices of up to this many bytes are decoded in one launch for consecutive layers (`block_indices_layers`).
DECODE_GROUP_BYTES = 64 << 20


# ---------------------------------------------------------------------------------------------- public types


@dataclass(frozen=True)
class Request:
    """One RAG prompt: prefix (system prompt), retrieved documents as (doc_id, text), query."""

    prefix: str
    docs: Sequence[tuple[str, str]]
    query: str


@dataclass(frozen=True)
class PrefillResult:
    """logits: fp32 [B, vocab] at each request's last prompt position. ttft_s: per request, the end-to-end
    prefill time of its batch. stages: seconds of the batch in fetch (index.fetch), decode (bits -> CSR, all
    layers), attention (prefill attention, all layers), rest (tokenisation, layout, the model's other work) and
    total. tile_fraction: computed (head, query block, key block) triples over the dense causal count, all
    layers."""

    logits: torch.Tensor
    ttft_s: tuple[float, ...]
    stages: dict[str, float]
    tile_fraction: float
    mode: str
    backend: str
    block: int
    n_tokens: tuple[int, ...]  # prompt tokens per request


@dataclass(frozen=True)
class GenerateResult:
    """texts: decoded generations (special tokens skipped); token_ids: generated ids per request, the eos
    included when one stopped it; prefill: the prefill of the batch; decode_s: seconds of the decode steps."""

    texts: list[str]
    token_ids: list[list[int]]
    prefill: PrefillResult
    decode_s: float


# ------------------------------------------------------------------------------------------------- timing


class _Timer:
    """Stage totals: CUDA events on a GPU (read once, at the end), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
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

    def totals(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
            for stage, pairs in self._events.items():
                self.seconds[stage] += sum(s.elapsed_time(e) for s, e in pairs) / 1e3
            self._events.clear()
        return {s: self.seconds.get(s, 0.0) for s in STAGES}


# ----------------------------------------------------------------------------------- CPU prefill attention


def sparse_attention_torch(q, k, v, indptr, indices, layout: BatchLayout, inv_freq, *, scale, causal=False):
    """Torch equivalent of `sparse_attention_ref` for one layer (same result), fast enough for whole models on
    CPU. q: [Hq, N, D], k / v: [Hkv, N, D] in `layout` (segment-local RoPE); -> [Hq, N, D], padding rows 0.

    Per request, on its real tokens only: rotating q and k by their segment's offset puts both at logical
    positions, so scores equal the kernel's `q . R(delta) k`; the CSR becomes a token mask (block kept and
    causal) for torch's SDPA. causal=True: the CSR is known to be dense causal (mode "dense"), so no mask is
    built."""
    hq, nb, blk = q.shape[0], layout.n_blocks, layout.block
    out = torch.zeros_like(q)
    keep = None
    if not causal:
        counts = (indptr[1:] - indptr[:-1]).long()
        rows = torch.repeat_interleave(torch.arange(hq * nb, device=q.device), counts)
        keep = torch.zeros(hq * nb, nb, dtype=torch.bool, device=q.device)
        keep[rows, indices[: int(indptr[-1])].long()] = True
        keep = keep.view(hq, nb, nb)
    offset = layout.token_logical_pos - layout.token_local_pos  # [n_tokens] segment offset of each token
    for (b0, nbr), first, n in zip(layout.request_blocks, layout.req_first_token.tolist(),
                                   layout.req_n_tokens.tolist()):
        phys = layout.token_phys[first : first + n]
        # A request whose every causal block is kept (all-ones bits, tiny documents) needs no mask.
        full = causal or int(keep[:, b0 : b0 + nbr, b0 : b0 + nbr].tril().sum()) == hq * nbr * (nbr + 1) // 2
        qr, kr, vr = q[:, phys], k[:, phys], v[:, phys]
        if inv_freq is not None:
            qr = apply_rope_ref(qr, offset[first : first + n], inv_freq)
            kr = apply_rope_ref(kr, offset[first : first + n], inv_freq)
        args = dict(scale=scale, enable_gqa=True)
        if full:
            args["is_causal"] = True
        else:
            tb = phys // blk
            mask = keep.index_select(1, tb).index_select(2, tb)  # [Hq, n, n]
            args["attn_mask"] = (mask & torch.ones(n, n, dtype=torch.bool, device=q.device).tril())[None]
        o = torch.nn.functional.scaled_dot_product_attention(qr[None].float(), kr[None].float(), vr[None].float(),
                                                             **args)[0]
        out[:, phys] = o.nan_to_num(0.0).to(out.dtype)  # a row with no key (empty CSR row) is 0, as in the kernel
    return out


# ------------------------------------------------------------------------------------ per-forward state


class _Prefill:
    """What the attention function needs during one prefill forward (handed over through the model kwargs)."""

    def __init__(self, engine: "SiftEngine", layout: BatchLayout, bits: DocBits | None, timer: _Timer,
                 reserve_slots: int):
        self.engine = engine
        self.layout = layout
        self.bits = bits
        self.timer = timer
        self.nnz = torch.zeros((), dtype=torch.int64, device=layout.device)
        self.k_cache: dict[int, torch.Tensor] = {}  # layer -> [Hkv, N + reserve_slots, D], position-free
        self.v_cache: dict[int, torch.Tensor] = {}
        self._n_slots = layout.n_slots + reserve_slots
        self._dense_csr = None
        self._row_start = None
        self._ptrs = None
        self._group = None  # (first layer, indices [G, cap], row_end [G, Hq * NB]) of the last multi-layer decode
        # Row of the packed real tokens holding each block's first slot (tokens are packed in physical order), so
        # the kernel reads the model's q and writes the output in token order: no padded copies of either.
        self.q_block_start = torch.searchsorted(
            layout.token_phys.to(layout.device),
            torch.arange(layout.n_blocks, device=layout.device) * layout.block).to(torch.int32)

    def _csr(self, layer: int, n_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """-> (indptr, indices, row_end): row r is indices[indptr[r]:row_end[r]] (row_end None: compact CSR)."""
        if self.bits is None:
            if self._dense_csr is None:
                self._dense_csr = dense_block_indices(self.layout, n_heads)
            return (*self._dense_csr, None)
        if self._ptrs is None:  # every layer's vector offsets, once per prefill
            self._ptrs = self.bits.all_layer_ptrs()
        if self.engine.backend == "triton":  # one pass: rows at their dense starts (computed once per prefill)
            if self._row_start is None:
                self._row_start = dense_indptr(self.layout, n_heads)
            first, idx, ends = self._group if self._group is not None else (-1, None, None)
            if not 0 <= layer - first < (0 if idx is None else idx.shape[0]):
                # Several layers per launch (the decode is latency bound), as many as DECODE_GROUP_BYTES of
                # indices hold: all of them at 16K tokens, 3 at 64K.
                per_layer = 4 * max(1, n_heads * self.layout.causal_block_pairs)
                g = max(1, min(self.bits.n_layers - layer, DECODE_GROUP_BYTES // per_layer))
                _, idx, ends = block_indices_layers(
                    self.layout, self.bits.la_bytes, self._ptrs[0][layer:layer + g], self.bits.ca_bytes,
                    self._ptrs[1][layer:layer + g], self.engine.tile, row_start=self._row_start)
                first = layer
                self._group = (first, idx, ends)
            return self._row_start, idx[layer - first], ends[layer - first]
        return (*block_indices_ref(self.layout, self.bits.la_bytes, self._ptrs[0][layer], self.bits.ca_bytes,
                                   self._ptrs[1][layer], self.engine.tile), None)

    def _to_cache(self, x: torch.Tensor) -> torch.Tensor:
        """[H, n_real, D] -> [H, N + reserve, D]: real tokens at their physical slots, padding 0."""
        buf = torch.zeros(x.shape[0], self._n_slots, x.shape[2], dtype=x.dtype, device=x.device)
        return buf.index_copy_(1, self.layout.token_phys, x)

    def attend(self, layer: int, query, key, value, scale: float):
        """query [1, Hq, n_real, D], key / value [1, Hkv, n_real, D] -> [1, n_real, Hq, D]."""
        eng, lay = self.engine, self.layout
        k_all, v_all = self._to_cache(key[0]), self._to_cache(value[0])
        k, v = k_all[:, : lay.n_slots], v_all[:, : lay.n_slots]
        with self.timer("decode"):
            indptr, indices, row_end = self._csr(layer, query.shape[1])
        self.nnz += indptr[-1] if row_end is None else (row_end - indptr[:-1]).sum()
        if eng.backend == "triton":
            with self.timer("attention"):
                hq, n, d = query.shape[1:]
                buf = torch.empty(n, hq, d, dtype=query.dtype, device=query.device)  # o_proj's layout
                sparse_attention(query[0], k, v, indptr, indices, lay.block_valid, lay.block_offset, eng.inv_freq,
                                 scale=scale, block=lay.block, out=buf.transpose(0, 1),
                                 q_block_start=self.q_block_start, row_end=row_end)
            self.k_cache[layer], self.v_cache[layer] = k_all, v_all
            return buf.unsqueeze(0), None
        q = lay.scatter(query[0], dim=1)
        with self.timer("attention"):
            if eng.backend == "reference":
                out = sparse_attention_ref(q, k, v, indptr, indices, lay.block_valid, lay.block_offset,
                                           eng.inv_freq, scale=scale, block=lay.block)
            else:
                out = sparse_attention_torch(q, k, v, indptr, indices, lay, eng.inv_freq, scale=scale,
                                             causal=self.bits is None)
        self.k_cache[layer], self.v_cache[layer] = k_all, v_all  # also the proof that this layer came here
        return lay.gather(out, dim=1).transpose(0, 1).unsqueeze(0), None


class _Decode:
    """The position-free KV cache of a prefilled batch plus one "generated" segment per request, and what one
    decode step's attention function needs. Request b's generated tokens fill `gen_blocks` blocks of its own,
    after the prefill blocks, whose segment offset is the request's prompt length."""

    def __init__(self, engine: "SiftEngine", prefill: _Prefill, gen_blocks: int):
        lay, dev = prefill.layout, prefill.layout.device
        self.engine = engine
        self.block = lay.block
        self.k_cache, self.v_cache = prefill.k_cache, prefill.v_cache
        b, nb = lay.n_requests, lay.n_blocks
        gen_first = nb + torch.arange(b, device=dev, dtype=torch.int64) * gen_blocks  # [B]
        self.gen_slot0 = gen_first * lay.block
        self.q_offset = lay.req_n_tokens.clone()  # logical position of each generated segment's first token
        self.block_valid = torch.cat([lay.block_valid, torch.zeros(b * gen_blocks, dtype=torch.int32, device=dev)])
        self.block_offset = torch.cat([lay.block_offset, self.q_offset.repeat_interleave(gen_blocks)])
        # Request b's blocks in logical order: its prompt blocks, then its generated blocks.
        indptr, prompt_idx = layout_kv_table(lay)
        per_req = [torch.cat([prompt_idx[f:f + n], (gen_first[r] + torch.arange(gen_blocks, device=dev)).int()])
                   for r, (f, n) in enumerate(lay.request_blocks)]
        self.kv_indices = torch.cat(per_req).to(torch.int32)
        self.kv_indptr = indptr + torch.arange(b + 1, device=dev, dtype=torch.int32) * gen_blocks
        self.step = 0

    def advance(self) -> None:
        """Make room for step `self.step`'s token in every request's generated segment."""
        t = self.step
        blocks = (self.gen_slot0 + t) // self.block
        self.block_valid[blocks] = (t % self.block) + 1
        self.write_slots = self.gen_slot0 + t

    def attend(self, layer: int, query, key, value, scale: float):
        """query [1, Hq, B, D] (one token per request), key / value [1, Hkv, B, D] -> [1, B, Hq, D]."""
        eng = self.engine
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        kc.index_copy_(1, self.write_slots, key[0])
        vc.index_copy_(1, self.write_slots, value[0])
        q = query[0].transpose(0, 1)  # [B, Hq, D]
        fn = decode_attention if eng.backend == "triton" else decode_attention_ref
        out = fn(q, kc, vc, self.q_offset, self.kv_indptr, self.kv_indices, self.block_valid, self.block_offset,
                 eng.inv_freq, scale=scale, block=self.block)
        return out.unsqueeze(0), None


def _sift_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sift_state=None,
                    **kwargs):
    """AttentionInterface function of the engine: the per-forward state comes in through the model kwargs."""
    if sift_state is None:
        raise RuntimeError(f"attention implementation {ATTN_NAME!r} runs only inside SiftEngine.prefill/generate")
    return sift_state.attend(module.layer_idx, query, key, value, scaling)


# ------------------------------------------------------------------------------------------------ engine


class SiftEngine:
    """Serve RAG prompts with SIFT's sparse, position-free prefill over an unchanged transformers model.

    model: a Llama / Qwen2 / Qwen3 / Mistral causal LM (any device, fp32 / bf16 / fp16); tokenizer: its
    tokenizer; index: the SiftIndex built for this model (None: dense mode only). block: kernel block (default
    128 on CUDA, the index tile on CPU; never below the index tile). on_unknown: "error" refuses documents the
    index lacks, "dense" attends to them densely. backend: "auto" | "triton" | "torch" | "reference".
    """

    def __init__(self, model, tokenizer, index: SiftIndex | None, *, block: int | None = None,
                 on_unknown: str = "error", backend: str = "auto"):
        from transformers import AttentionInterface

        if on_unknown not in ON_UNKNOWN:
            raise SiftError(f"on_unknown={on_unknown!r} must be one of {', '.join(ON_UNKNOWN)}")
        if backend not in BACKENDS:
            raise SiftError(f"backend={backend!r} must be one of {', '.join(BACKENDS)}")
        self.model, self.tokenizer, self.index, self.on_unknown = model, tokenizer, index, on_unknown
        self.device = next(model.parameters()).device
        cfg = model.config
        self.backend = ("triton" if self.device.type == "cuda" else "torch") if backend == "auto" else backend
        if self.backend == "triton" and self.device.type != "cuda":
            import os
            if os.environ.get("TRITON_INTERPRET") != "1":
                raise SiftError("backend='triton' needs the model on a CUDA device (or TRITON_INTERPRET=1); use "
                                "backend='torch' on CPU")

        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if self.head_dim not in HEAD_DIMS:
            raise SiftError(f"head_dim={self.head_dim} is not supported by the attention kernels ({HEAD_DIMS})")
        try:
            rope = rope_inv_freq(cfg)
        except ValueError as e:
            raise SiftError(f"model {cfg.model_type!r} cannot be served with position-free KV: {e}") from None
        self.inv_freq = rope.inv_freq.to(self.device)
        self.window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        self.eos_ids = self._eos_ids()

        self.tile = index.tile if index is not None else None
        if index is not None:
            index.check_model(model)
            if index.device != self.device:
                raise SiftError(f"the index fetches bits to {index.device} but the model is on {self.device}: "
                                f"open it with SiftIndex.open(path, device={str(self.device)!r})")
        if block is None:
            block = GPU_BLOCK if self.device.type == "cuda" else (self.tile or BLOCKS[0])
        if block not in BLOCKS:
            raise SiftError(f"block={block} must be one of {BLOCKS}")
        if self.tile is not None and block < self.tile:
            raise SiftError(f"block={block} is smaller than the index tile {self.tile}: kernel blocks may only "
                            f"coarsen tiles; use block >= {self.tile}")
        self.block = block
        AttentionInterface.register(ATTN_NAME, _sift_attention)
        previous = model.config._attn_implementation
        model.set_attn_implementation(ATTN_NAME)  # refuses models that do not dispatch through the interface
        model.set_attn_implementation(previous)

    def _eos_ids(self) -> set[int]:
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])

    # ------------------------------------------------------------------------------------------ helpers

    @contextlib.contextmanager
    def _attn_impl(self):
        """Route the model's attention to the engine for the duration of a call, then restore it. The config
        attribute is swapped directly (microseconds; `set_attn_implementation` walks every module, ~5 ms),
        after `__init__` validated the switch once through `set_attn_implementation`."""
        config = self.model.config
        previous = config._attn_implementation
        config._attn_implementation = ATTN_NAME
        try:
            yield
        finally:
            config._attn_implementation = previous

    def tokenize(self, request: Request) -> list[tuple[str, list[int]]]:
        """-> segments (kind, token ids) in prompt order, as SPEC section 4 tokenises them."""
        tok = self.tokenizer
        segments = [("prefix", list(tok(request.prefix, add_special_tokens=True).input_ids))]
        for doc_id, text in request.docs:
            ids = list(tok(text, add_special_tokens=False).input_ids)
            if not ids:
                raise SiftError(f"document {doc_id!r} has no tokens: drop it from the request")
            segments.append(("doc", ids))
        segments.append(("query", list(tok(request.query, add_special_tokens=False).input_ids)))
        return segments

    def prompt_ids(self, request: Request) -> list[int]:
        """The unsegmented prompt: the concatenation of the segments' token ids."""
        return [t for _, ids in self.tokenize(request) for t in ids]

    def _check_docs(self, requests: Sequence[Request], segs: list[list[tuple[str, list[int]]]]) -> None:
        """Stale or unknown documents are refused (unknown ones pass with on_unknown="dense")."""
        index = self.index
        for request, segments in zip(requests, segs):
            doc_ids = [ids for kind, ids in segments if kind == "doc"]
            for (doc_id, _), ids in zip(request.docs, doc_ids):
                if doc_id not in index:
                    if self.on_unknown == "error":
                        raise SiftError(
                            f"document {doc_id!r} is not in index {index.path} (generation {index.generation}): "
                            f"add it to the corpus and rebuild with `sift-build`, or create the engine with "
                            f"on_unknown='dense' to attend to it densely")
                    continue
                entry = index.entry(doc_id)
                h = content_hash(ids)
                if h != entry.content_hash or len(ids) != entry.n_tokens:
                    raise SiftError(
                        f"stale index: document {doc_id!r} tokenises to {len(ids)} tokens (content_hash "
                        f"{h[:16]}...) but index {index.path} (generation {index.generation}) holds {entry.n_tokens} "
                        f"tokens (content_hash {entry.content_hash[:16]}...): its text changed since it was indexed; "
                        f"rebuild the index (`sift-build CORPUS --out {index.path}` re-profiles changed documents)")

    def _validate_requests(self, requests, mode: str) -> None:
        if mode not in MODES:
            raise SiftError(f"mode={mode!r} must be one of {', '.join(MODES)}")
        if mode == "sift" and self.index is None:
            raise SiftError("mode='sift' needs an index: create the engine with SiftIndex.open(path)")
        if not requests:
            raise SiftError("no requests: pass at least one Request")
        for r in requests:
            if not isinstance(r, Request):
                raise SiftError(f"expected Request objects, got {type(r).__name__}")

    # ----------------------------------------------------------------------------------------- prefill

    @torch.inference_mode()
    def prefill(self, requests: Sequence[Request], mode: str = "sift") -> PrefillResult:
        """Prefill a batch -> PrefillResult (logits at each request's last position)."""
        result, _ = self._prefill(requests, mode, gen_blocks=0)
        return result

    def _prefill(self, requests: Sequence[Request], mode: str, gen_blocks: int):
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._validate_requests(requests, mode)
        timer = _Timer(self.device)
        segs = [self.tokenize(r) for r in requests]
        lengths = [sum(len(ids) for _, ids in s) for s in segs]
        if self.window and max(lengths) > self.window:
            raise SiftError(f"a prompt of {max(lengths)} tokens exceeds the model's sliding window ({self.window}): "
                            f"the sparse pattern assumes full causal attention; shorten the prompt")
        if mode == "sift":
            self._check_docs(requests, segs)
        layout = build_layout([[(k, len(ids)) for k, ids in s] for s in segs], self.block, self.device)
        bits = None
        if mode == "sift" and layout.n_docs:
            docs = [(doc_id, len(ids)) for r, s in zip(requests, segs)
                    for (doc_id, _), ids in zip(r.docs, [ids for k, ids in s if k == "doc"])]
            with timer("fetch"):
                bits = self.index.fetch(docs, on_unknown=self.on_unknown)
        ids = torch.tensor([[t for s in segs for _, seg in s for t in seg]], device=self.device)
        positions = layout.token_local_pos[None]
        state = _Prefill(self, layout, bits, timer, reserve_slots=layout.n_requests * gen_blocks * self.block)
        with self._attn_impl():
            hidden = self.model.base_model(input_ids=ids, position_ids=positions, use_cache=False,
                                           sift_state=state).last_hidden_state
        n_layers = self.model.config.num_hidden_layers
        if len(state.k_cache) != n_layers:  # never serve a silently dense (or unrotated) forward
            raise SiftError(f"only {len(state.k_cache)} of {n_layers} layers ran the engine's attention: the model "
                            f"does not dispatch attention through transformers' AttentionInterface")
        last = (layout.req_first_token + layout.req_n_tokens - 1).long()
        logits = self.model.get_output_embeddings()(hidden[0, last]).float()
        stages = timer.totals()  # synchronises on CUDA
        total = time.perf_counter() - t0
        dense_pairs = n_layers * self.model.config.num_attention_heads * layout.causal_block_pairs
        frac = float(state.nnz) / dense_pairs if mode == "sift" else 1.0
        stages["rest"] = max(0.0, total - sum(stages.values()))
        stages["total"] = total
        result = PrefillResult(logits=logits, ttft_s=(total,) * len(requests), stages=stages, tile_fraction=frac,
                               mode=mode, backend=self.backend, block=self.block, n_tokens=tuple(lengths))
        return result, state

    # ---------------------------------------------------------------------------------------- generate

    @torch.inference_mode()
    def generate(self, requests: Sequence[Request], max_new_tokens: int = 32, mode: str = "sift") -> GenerateResult:
        """Greedy generation: prefill, then one token per request per step over the position-free cache,
        until eos or max_new_tokens."""
        if max_new_tokens < 1:
            raise SiftError(f"max_new_tokens={max_new_tokens} must be >= 1")
        gen_blocks = -(-max_new_tokens // self.block)
        prefill, state = self._prefill(requests, mode, gen_blocks=gen_blocks)
        t0 = time.perf_counter()
        b = len(requests)
        out: list[list[int]] = [[] for _ in range(b)]
        done = [False] * b
        token = prefill.logits.argmax(dim=-1)  # [B]
        dec = _Decode(self, state, gen_blocks)
        with self._attn_impl():
            for step in range(max_new_tokens):
                host = token.tolist()
                for r in range(b):
                    if not done[r]:
                        out[r].append(host[r])
                        done[r] = host[r] in self.eos_ids
                if all(done) or step == max_new_tokens - 1:
                    break
                dec.step = step
                dec.advance()
                positions = torch.full((1, b), step, dtype=torch.long, device=self.device)
                hidden = self.model.base_model(input_ids=token[None], position_ids=positions, use_cache=False,
                                               sift_state=dec).last_hidden_state
                token = self.model.get_output_embeddings()(hidden[0]).float().argmax(dim=-1)
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in out]
        return GenerateResult(texts=texts, token_ids=out, prefill=prefill, decode_s=time.perf_counter() - t0)
