"""The SIFT serving engine: RAG requests in, last-position logits and greedy generations out (SPEC sections 4, 5).

One request walks forward through these steps:

    Request(prefix, docs, query)      text; docs as (doc_id, text), the way retrieval returns them
      -> segments of token ids        prefix with the tokenizer's special tokens, docs and query without
      -> stale / unknown checks       each document's ids must hash to the index's content_hash
      -> BatchLayout                  segments padded to kernel blocks, logical and segment-local positions
      -> index.fetch                  all layers' bits of the batch's documents, once per batch, on the device
                                      (or the caller's `BatchBits`: the eval's in-context oracle)
      -> PrefillMetadata              every layer's block CSR decoded from the bits (or the dense CSR), once,
                                      before the forward (runtime/metadata.py)
      -> model forward                the unchanged transformers model on the packed real tokens [1, n_real],
                                      position_ids = segment-LOCAL positions, attention routed through
                                      AttentionInterface to `sift_attention`, which writes the layer's
                                      position-free K/V into the batch's `BatchKVCache` and attends with the
                                      backend's sparse kernel (RoPE by each block's segment offset)
      -> lm_head on each request's last position only

Generation appends a "generated" segment per request, starting at the request's next logical position: each
step runs the model on one token per request at its local position in that segment, writes its K/V into the
position-free cache and attends with the decode kernel, which rotates q once per segment (LazyAttention).

Modes "reuse" and "hybrid" (runtime/reuse_prefill.py, docs/SPEC.md section 6) take the documents' KV from a
KVStore (runtime/kv_store.py): a missing document is computed on its own after the index's profiling prefix
(inside the request's forward, straight into its pages), then the request's forward runs only its prefix,
query, last and recomputed blocks (`q_blocks`), the other blocks' KV read from the documents' pages through a
`PagedKVCache`.

Backends (runtime/backends.py): "triton" (CUDA kernels), "torch" (CPU), "reference" (the kernels' ref twins
everywhere; small models only); "auto" picks triton on CUDA and torch on CPU, once, when the engine is made;
the result records which one ran.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from sift.errors import SiftError
from sift.format import TILES, content_hash

from ..kernels.block_indices import DocBits
from ..kernels.layout import build_layout
from ..kernels.rope import rope_inv_freq
from ..kernels.sparse_attention import HEAD_DIMS
from . import reuse, reuse_prefill
from .backends import dense_layers, select_backend
from .forward import ATTN_NAME, DecodeAttention, PrefillAttention, Timer, sift_attention
from .kv_cache import BatchKVCache
from .kv_store import Geometry, KVStore
from .metadata import DecodeMetadata, PrefillMetadata
from .store import ON_UNKNOWN, SiftIndex

MODES = ("sift", "dense", "reuse", "hybrid")
GPU_BLOCK = 128


# ---------------------------------------------------------------------------------------------- public types


@dataclass(frozen=True, eq=False)
class BatchBits:
    """Bits of one call's documents given by the caller instead of fetched from the index (mode "sift"; the
    in-context oracle of quality/oracle.py). bits: every document of the batch, requests in order, each request's
    documents in prompt order; tile: their tile (one of TILES, at most the engine's block)."""

    bits: DocBits
    tile: int


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
    layers), attention (prefill attention, all layers), store (the KV store's bookkeeping: lookups, page
    allocation, eviction), rest (tokenisation, layout, the model's other work) and total. tile_fraction:
    computed (head, query block, key block) triples over the dense causal count, all layers (in the reuse
    modes: the request's own rows plus the documents computed on a miss). recomputed_fraction (reuse modes):
    share of the documents' tokens computed in this request's context. store: per call, documents found in
    HBM / in DRAM / computed (reuse modes; empty otherwise)."""

    logits: torch.Tensor
    ttft_s: tuple[float, ...]
    stages: dict[str, float]
    tile_fraction: float
    mode: str
    backend: str
    block: int
    n_tokens: tuple[int, ...]  # prompt tokens per request
    recomputed_fraction: float = 1.0
    store: dict = field(default_factory=dict)


@dataclass(frozen=True)
class GenerateResult:
    """texts: decoded generations (special tokens skipped); token_ids: generated ids per request, the eos
    included when one stopped it; prefill: the prefill of the batch; decode_s: seconds of the decode steps."""

    texts: list[str]
    token_ids: list[list[int]]
    prefill: PrefillResult
    decode_s: float


# ------------------------------------------------------------------------------------------------ engine


class SiftEngine:
    """Serve RAG prompts with SIFT's sparse, position-free prefill over an unchanged transformers model.

    model: a Llama / Qwen2 / Qwen3 / Mistral causal LM (any device, fp32 / bf16 / fp16); tokenizer: its
    tokenizer; index: the SiftIndex built for this model (None: dense mode only). block: kernel block (default
    128 on CUDA, the index tile on CPU; never below the index tile). on_unknown: "error" refuses documents the
    index lacks, "dense" attends to them densely. backend: "auto" | "triton" | "torch" | "reference".
    kv_store: a KVStore for modes "reuse" / "hybrid" (attached here: its pool takes the model's device, dtype
    and KV shape). hybrid_fraction: share of each reused document's blocks that mode "hybrid" recomputes.
    """

    def __init__(self, model, tokenizer, index: SiftIndex | None, *, block: int | None = None,
                 on_unknown: str = "error", backend: str = "auto", kv_store: KVStore | None = None,
                 hybrid_fraction: float = reuse.DEFAULT_FRACTION):
        from transformers import AttentionInterface

        if on_unknown not in ON_UNKNOWN:
            raise SiftError(f"on_unknown={on_unknown!r} must be one of {', '.join(ON_UNKNOWN)}")
        self.model, self.tokenizer, self.index, self.on_unknown = model, tokenizer, index, on_unknown
        self.device = next(model.parameters()).device
        cfg = model.config
        self.attention_backend = select_backend(backend, self.device)
        self.backend: str = self.attention_backend.name

        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if self.head_dim not in HEAD_DIMS:
            raise SiftError(f"head_dim={self.head_dim} is not supported by the attention kernels ({HEAD_DIMS})")
        try:
            rope = rope_inv_freq(cfg)
        except ValueError as e:
            raise SiftError(f"model {cfg.model_type!r} cannot be served with position-free KV: {e}") from None
        self.inv_freq = rope.inv_freq.to(self.device)
        self.window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        # The context the model declares (its RoPE scaling, where it has one, is already reflected here).
        self.max_positions: int | None = getattr(cfg, "max_position_embeddings", None)
        # One call at a time: a call swaps the model's attention implementation for its duration, and the GPU
        # runs one batch's layers in order anyway (batch concurrent requests into one call for throughput).
        self._lock = threading.Lock()
        self.eos_ids = self._eos_ids()

        self.tile = index.tile if index is not None else None
        if index is not None:
            index.check_model(model)
            if index.device != self.device:
                raise SiftError(f"the index fetches bits to {index.device} but the model is on {self.device}: "
                                f"open it with SiftIndex.open(path, device={str(self.device)!r})")
        if block is None:
            block = GPU_BLOCK if self.device.type == "cuda" else (self.tile or TILES[0])
        if block not in TILES:
            raise SiftError(f"block={block} must be one of {TILES}")
        if self.tile is not None and block < self.tile:
            raise SiftError(f"block={block} is smaller than the index tile {self.tile}: kernel blocks may only "
                            f"coarsen tiles; use block >= {self.tile}")
        self.block = block
        if not 0.0 <= hybrid_fraction <= 1.0:
            raise SiftError(f"hybrid_fraction={hybrid_fraction!r} must lie in [0, 1]")
        self.hybrid_fraction = hybrid_fraction
        self.kv_store = kv_store
        if index is not None:
            self.prefix_ids = list(index.prefix_token_ids)
        else:   # the builder's default profiling prefix: BOS where the tokenizer has one
            self.prefix_ids = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        if kv_store is not None:
            n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            dtype = next(model.parameters()).dtype
            kv_store.attach(Geometry(cfg.num_hidden_layers, n_kv, self.head_dim, block, dtype, self.device),
                            index.fingerprint if index is not None else f"{cfg.model_type}:{id(model)}")
        AttentionInterface.register(ATTN_NAME, sift_attention)
        previous = model.config._attn_implementation
        model.set_attn_implementation(ATTN_NAME)  # refuses models that do not dispatch through the interface
        model.set_attn_implementation(previous)

    def _eos_ids(self) -> set[int]:
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])

    # ------------------------------------------------------------------------------------------- steps
    # The steps of a call (tokenise and check, metadata, one forward, the routed attention) are public: the
    # reuse / hybrid prefill (runtime/reuse_prefill.py) composes its own calls from them.

    @contextlib.contextmanager
    def routed_attention(self):
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

    def check_docs(self, requests: Sequence[Request], segs: list[list[tuple[str, list[int]]]]) -> None:
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

    def validate_requests(self, requests, mode: str, indexed: bool = True) -> None:
        """Refuse an unknown mode, a mode the engine cannot serve (no index, no KV store) and bad requests.
        indexed=False: mode "sift" runs on bits the caller gives, without the index."""
        if mode.partition(":")[0] not in MODES:
            raise SiftError(f"mode={mode!r} must be one of {', '.join(MODES)} (or 'hybrid:<policy>[@<fraction>]')")
        if mode == "sift" and indexed and self.index is None:
            raise SiftError("mode='sift' needs an index: create the engine with SiftIndex.open(path)")
        if mode not in ("sift", "dense"):
            reuse.parse_mode(mode)
            if self.kv_store is None:
                raise SiftError(f"mode={mode!r} needs a KV store: create the engine with "
                                f"SiftEngine(..., kv_store=KVStore(hbm_bytes=..., dram_bytes=...))")
            if self.index is None and self.on_unknown == "error":
                raise SiftError(f"mode={mode!r} without an index treats every document as unknown: open the index "
                                f"or create the engine with on_unknown='dense'")
        if not requests:
            raise SiftError("no requests: pass at least one Request")
        for r in requests:
            if not isinstance(r, Request):
                raise SiftError(f"expected Request objects, got {type(r).__name__}")

    # ----------------------------------------------------------------------------------------- prefill

    @torch.inference_mode()
    def prefill(self, requests: Sequence[Request], mode: str = "sift", *,
                bits: BatchBits | None = None) -> PrefillResult:
        """Prefill a batch -> PrefillResult (logits at each request's last position). bits: mode "sift" with
        these bits rather than the index's."""
        with self._lock:
            result, _, cache = self._run_prefill(requests, mode, new_tokens=0, bits=bits)
            reuse_prefill.release(cache)
            return result

    def _run_prefill(self, requests: Sequence[Request], mode: str, new_tokens: int, bits: BatchBits | None = None):
        if bits is not None:
            self._check_supplied(mode, bits)
        if mode in ("sift", "dense") or mode.partition(":")[0] not in MODES:
            return self._prefill(requests, mode, new_tokens, bits)
        fields, layout, cache = reuse_prefill.prefill(self, requests, mode, new_tokens)
        return PrefillResult(mode=mode, backend=self.backend, block=self.block, **fields), layout, cache

    def _check_supplied(self, mode: str, bits: BatchBits) -> None:
        if mode != "sift":
            raise SiftError(f"bits were given with mode={mode!r}: supplied bits serve mode 'sift' only")
        if bits.tile not in TILES or bits.tile > self.block:
            raise SiftError(f"supplied bits of tile {bits.tile}: the tile must be one of {TILES} and at most the "
                            f"engine's block {self.block}")

    def _check_lengths(self, lengths: list[int], new_tokens: int) -> None:
        for r, n in enumerate(lengths):
            if n == 0:
                raise SiftError(f"request {r} has no tokens (empty prefix, no documents, empty query): give it "
                                f"a prefix, a document or a query")
            if self.max_positions and n + new_tokens > self.max_positions:
                more = f" + {new_tokens} to generate" if new_tokens else ""
                raise SiftError(f"request {r} has {n} prompt tokens{more}, more than the model's context of "
                                f"{self.max_positions} (max_position_embeddings): shorten the prompt"
                                f"{' or lower max_new_tokens' if new_tokens else ''}")

    def segments(self, requests: Sequence[Request], new_tokens: int):
        """Requests -> (segments per request, prompt lengths), lengths checked."""
        segs = [self.tokenize(r) for r in requests]
        lengths = [sum(len(ids) for _, ids in s) for s in segs]
        self._check_lengths(lengths, new_tokens)
        if self.window and max(lengths) > self.window:
            raise SiftError(f"a prompt of {max(lengths)} tokens exceeds the model's sliding window ({self.window}): "
                            f"the sparse pattern assumes full causal attention; shorten the prompt")
        return segs, lengths

    def _plan(self, requests: Sequence[Request], mode: str, timer: Timer, new_tokens: int,
              supplied: BatchBits | None = None):
        """Requests -> (token ids of the batch [1, n_real], layout, prompt lengths, the documents' bits or None)."""
        segs, lengths = self.segments(requests, new_tokens)
        if mode == "sift" and supplied is None:
            self.check_docs(requests, segs)
        layout = build_layout([[(k, len(ids)) for k, ids in s] for s in segs], self.block, self.device)
        bits = None
        if supplied is not None:
            if supplied.bits.la_base.numel() != layout.n_docs:
                raise SiftError(f"supplied bits hold {supplied.bits.la_base.numel()} documents, the batch has "
                                f"{layout.n_docs}: give one entry per document of every request, in order")
            bits = supplied.bits if layout.n_docs else None
        elif mode == "sift" and layout.n_docs:
            docs = [(doc_id, len(ids)) for r, s in zip(requests, segs)
                    for (doc_id, _), ids in zip(r.docs, [ids for k, ids in s if k == "doc"])]
            with timer("fetch"):
                bits = self.index.fetch(docs, on_unknown=self.on_unknown)
        ids = torch.tensor([[t for s in segs for _, seg in s for t in seg]], device=self.device)
        return ids, layout, lengths, bits

    def metadata(self, layout, bits, timer: Timer, q_blocks: torch.Tensor | None = None,
                 tile: int | None = None) -> PrefillMetadata:
        """Every layer's block CSR, before the forward: from the bits (of `tile`, default the index's), or dense
        when there are none; only the rows of `q_blocks` when given."""
        n_layers, n_heads = self.model.config.num_hidden_layers, self.model.config.num_attention_heads
        with timer("decode"):
            if bits is None:
                return PrefillMetadata.build(layout, dense_layers(layout, n_heads, n_layers), sparse=False,
                                             q_blocks=q_blocks)
            indices = self.attention_backend.decode_indices(layout, bits, tile or self.tile, n_heads)
            return PrefillMetadata.build(layout, indices, sparse=True, q_blocks=q_blocks)

    def _prefill(self, requests: Sequence[Request], mode: str, new_tokens: int, supplied: BatchBits | None = None):
        """-> (PrefillResult, layout, the batch's KV cache with room for new_tokens more per request)."""
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.validate_requests(requests, mode, indexed=supplied is None)
        timer = Timer(self.device)
        ids, layout, lengths, bits = self._plan(requests, mode, timer, new_tokens, supplied)
        meta = self.metadata(layout, bits, timer, tile=supplied.tile if supplied is not None else None)
        n_layers = self.model.config.num_hidden_layers
        cache = BatchKVCache(layout, n_layers, gen_blocks=-(-new_tokens // self.block))
        hidden = self.forward_tokens(ids, layout.token_local_pos, meta, cache, timer)
        last = (layout.req_first_token + layout.req_n_tokens - 1).long()
        logits = self.model.get_output_embeddings()(hidden[0, last]).float()
        stages = timer.totals()  # synchronises on CUDA
        total = time.perf_counter() - t0
        dense_pairs = n_layers * self.model.config.num_attention_heads * layout.causal_block_pairs
        frac = float(meta.nnz()) / dense_pairs if mode == "sift" else 1.0
        stages["rest"] = max(0.0, total - sum(stages.values()))
        stages["total"] = total
        result = PrefillResult(logits=logits, ttft_s=(total,) * len(requests), stages=stages, tile_fraction=frac,
                               mode=mode, backend=self.backend, block=self.block, n_tokens=tuple(lengths))
        return result, layout, cache

    def forward_tokens(self, ids: torch.Tensor, positions: torch.Tensor, meta: PrefillMetadata, cache, timer: Timer):
        """One prefill forward of the model over `ids` [1, n] at segment-local `positions` [n] -> last hidden
        states [1, n, hidden]; each layer's K / V go into `cache` and attention follows `meta`."""
        attention = PrefillAttention(self.attention_backend, meta, cache, self.inv_freq, timer)
        with self.routed_attention():
            hidden = self.model.base_model(input_ids=ids, position_ids=positions[None], use_cache=False,
                                           sift_state=attention).last_hidden_state
        n_layers = self.model.config.num_hidden_layers
        if cache.layers_written != n_layers:  # never serve a silently dense (or unrotated) forward
            raise SiftError(f"only {cache.layers_written} of {n_layers} layers ran the engine's attention: the model "
                            f"does not dispatch attention through transformers' AttentionInterface")
        return hidden

    @torch.inference_mode()
    def generate(self, requests: Sequence[Request], max_new_tokens: int = 32, mode: str = "sift", *,
                 bits: BatchBits | None = None) -> GenerateResult:
        """Greedy generation: prefill, then one token per request per step over the position-free cache,
        until eos or max_new_tokens. bits: mode "sift" with these bits rather than the index's."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise SiftError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
        with self._lock:
            return self._generate(requests, max_new_tokens, mode, bits)

    def _generate(self, requests: Sequence[Request], max_new_tokens: int, mode: str,
                  bits: BatchBits | None = None) -> GenerateResult:
        prefill, layout, cache = self._run_prefill(requests, mode, new_tokens=max_new_tokens, bits=bits)
        try:
            return self._decode_loop(requests, max_new_tokens, prefill, layout, cache)
        finally:
            reuse_prefill.release(cache)

    def _decode_loop(self, requests, max_new_tokens: int, prefill: PrefillResult, layout, cache) -> GenerateResult:
        t0 = time.perf_counter()
        b = len(requests)
        out: list[list[int]] = [[] for _ in range(b)]
        done = [False] * b
        token = prefill.logits.argmax(dim=-1)  # [B]
        meta = DecodeMetadata.build(layout, cache.block_pages, cache.gen_pages)
        dec = DecodeAttention(self.attention_backend, meta, cache, self.inv_freq)
        with self.routed_attention():
            for step in range(max_new_tokens):
                host = token.tolist()
                for r in range(b):
                    if not done[r]:
                        out[r].append(host[r])
                        done[r] = host[r] in self.eos_ids
                if all(done) or step == max_new_tokens - 1:
                    break
                dec.start_step(step)
                positions = torch.full((1, b), step, dtype=torch.long, device=self.device)
                hidden = self.model.base_model(input_ids=token[None], position_ids=positions, use_cache=False,
                                               sift_state=dec).last_hidden_state
                token = self.model.get_output_embeddings()(hidden[0]).float().argmax(dim=-1)
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) for ids in out]
        return GenerateResult(texts=texts, token_ids=out, prefill=prefill, decode_s=time.perf_counter() - t0)
