"""The SIFT serving engine: RAG requests in, tokens out, with SIFT's sparse, position-free prefill over an
unchanged transformers model and continuous batching of the decode (SPEC sections 4-7).

One request walks forward through these steps:

    add_request(Request, SamplingParams, mode)     validated and tokenised at once (SPEC section 4: prefix with
                                                   the tokenizer's special tokens, docs and query without; stale
                                                   or unknown documents refused), its KV pages counted
      -> Scheduler (runtime/scheduler.py)          waits until the KV pool has its pages, then leases them: its
                                                   documents (reuse modes), its own blocks, its generation pages
      -> PrefillPlan (runtime/plan.py,             the group's layout, every layer's block CSR (from the index's
         runtime/reuse_prefill.py)                 bits, or dense), the pages each block lives in, frozen before
                                                   the forward
      -> ModelRunner.forward (runtime/runner.py)   the unchanged model over the packed tokens at segment-LOCAL
                                                   positions, attention routed through AttentionInterface to the
                                                   engine's kernels, K / V written into the request's pages
      -> the first token                           drawn on the device from the last position's logits
      -> decode steps                              one token per running request per step, every request of the
                                                   batch in one step whatever its mode or prefill, over the pages
                                                   of the paged pool; captured in CUDA graphs on CUDA
      -> RequestOutput                             ids, text (stop strings cut), finish reason, per step

`step()` runs one iteration of that loop for every request; `generate`, `stream` and `prefill` are loops over
it. Backends (runtime/backends.py): "triton" (CUDA kernels), "torch" (CPU), "reference" (the kernels' ref twins
everywhere; small models only); "auto" picks triton on CUDA and torch on CPU, once, when the engine is made.

Threads: `add_request` and `abort` may be called from any thread at any time (they validate on the caller's
thread and leave the request in a lock-protected inbox that `step` drains first); `step`, `generate`, `stream`,
`prefill` and `warmup` run one at a time (an engine lock). One thread should drive `step` in a serving loop;
`generate` and `stream` drive it themselves, so call them when no loop does (they may run concurrently with
each other: each reads its own requests' outputs).
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from sift.errors import SiftError
from sift.format import TILES, ModelGeometry, content_hash

from ..kernels.rope import rope_inv_freq
from ..kernels.sparse_attention import HEAD_DIMS
from . import reuse
from .backends import select_backend
from .forward import ATTN_NAME, Timer, sift_attention
from .kv_store import Geometry, KVStore
from .modes import Mode
from .plan import PlanContext, n_blocks, page_need, sift_plan
from .reuse_prefill import reuse_plan
from .request import OutputText, Request, RequestOutput, RequestState
from .runner import BUCKETS, HostCopy, ModelRunner
from .sampling import MAX_STOP_TOKEN_IDS, SamplingParams, seed_key
from .scheduler import Group, Scheduler
from .store import ON_UNKNOWN, SiftIndex
GPU_BLOCK = 128
# The KV pool when the caller gives no KVStore: this share of the device memory free when the engine is made,
# or this many bytes on a CPU.
KV_CACHE_FRACTION = 0.5
CPU_KV_CACHE_BYTES = 256 << 20
MAX_PREFILL_TOKENS = 1 << 16
FINISHED_IDS_KEPT = 4096


# ---------------------------------------------------------------------------------------------- public types


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
    """texts: the generations (special tokens skipped, cut at a stop string); token_ids: generated ids per
    request, the eos or stop token included when one stopped it; prefill: the prefill of the batch; decode_s:
    seconds from the end of the prefill to the last request's end."""

    texts: list[str]
    token_ids: list[list[int]]
    prefill: PrefillResult
    decode_s: float


# ------------------------------------------------------------------------------------------------ engine


class SiftEngine:
    """Serve RAG prompts with SIFT's sparse, position-free prefill and continuously batched decoding over an
    unchanged transformers model (module docstring).

    model: a Llama / Qwen2 / Qwen3 / Mistral causal LM (any device, fp32 / bf16 / fp16); tokenizer: its
    tokenizer; index: the SiftIndex built for this model (None: modes other than "sift" only). block: kernel
    block (default 128 on CUDA, the index tile on CPU; never below the index tile). on_unknown: "error" refuses
    documents the index lacks, "dense" attends to them densely. backend: "auto" | "triton" | "torch" |
    "reference". kv_store: the KVStore holding every request's KV (documents kept across requests, and each
    request's own pages); without one the engine makes one of `kv_cache_bytes` (default: KV_CACHE_FRACTION of
    the device memory free now on CUDA, CPU_KV_CACHE_BYTES on a CPU), with no DRAM tier. hybrid_fraction: share
    of each reused document's blocks that mode "hybrid" recomputes. cuda_graphs: capture the decode step in CUDA
    graphs (default: on CUDA with backend "triton"), at `warmup()` or else at the first `step()`. max_running:
    requests decoding at once (at most 64); max_prefill_tokens: prompt tokens prefilled per step beyond the
    first waiting group.
    """

    def __init__(self, model, tokenizer, index: SiftIndex | None, *, block: int | None = None,
                 on_unknown: str = "error", backend: str = "auto", kv_store: KVStore | None = None,
                 kv_cache_bytes: int | None = None, hybrid_fraction: float = reuse.DEFAULT_FRACTION,
                 cuda_graphs: bool | None = None, max_running: int = BUCKETS[-1],
                 max_prefill_tokens: int = MAX_PREFILL_TOKENS):
        from transformers import AttentionInterface

        if on_unknown not in ON_UNKNOWN:
            raise SiftError(f"on_unknown={on_unknown!r} must be one of {', '.join(ON_UNKNOWN)}")
        self.model, self.tokenizer, self.index, self.on_unknown = model, tokenizer, index, on_unknown
        self.device = next(model.parameters()).device
        cfg = model.config
        self.attention_backend = select_backend(backend, self.device)
        self.backend: str = self.attention_backend.name

        self.geometry = ModelGeometry.from_config(cfg)
        self.head_dim = self.geometry.head_dim
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
        self.eos_ids = self._eos_ids()
        self.vocab = model.get_output_embeddings().weight.shape[0]

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
        for name, value, top in (("max_running", max_running, BUCKETS[-1]), ("max_prefill_tokens",
                                                                             max_prefill_tokens, None)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (top and value > top):
                raise SiftError(f"{name}={value!r} must be an integer >= 1{f' and <= {top}' if top else ''}")
        if index is not None:
            self.prefix_ids = list(index.prefix_token_ids)
        else:   # the builder's default profiling prefix: BOS where the tokenizer has one
            self.prefix_ids = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []

        self.kv_store = self._store(kv_store, kv_cache_bytes)
        dtype = next(model.parameters()).dtype
        self.kv_store.attach(Geometry.of(self.geometry, block, dtype, self.device),
                             index.fingerprint if index is not None else f"{cfg.model_type}:{id(model)}")
        AttentionInterface.register(ATTN_NAME, sift_attention)
        previous = model.config._attn_implementation
        model.set_attn_implementation(ATTN_NAME)  # refuses models that do not dispatch through the interface
        model.set_attn_implementation(previous)

        self.ctx = PlanContext(block=block, device=self.device, n_layers=cfg.num_hidden_layers,
                               n_heads=cfg.num_attention_heads, index=index, on_unknown=on_unknown,
                               prefix_ids=tuple(self.prefix_ids), store=self.kv_store,
                               backend=self.attention_backend, hybrid_fraction=hybrid_fraction)
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and self.attention_backend.capturable
        context = self.max_positions or self.kv_store.n_pages * block
        self.runner = ModelRunner(model, self.attention_backend, self.inv_freq, self.kv_store, block=block,
                                  max_positions=context, cuda_graphs=cuda_graphs,
                                  fused_norms=self.attention_backend.name == "triton",
                                  fast_decode=self.attention_backend.name == "triton")
        self.scheduler = Scheduler(self.kv_store, max_running=max_running, max_prefill_tokens=max_prefill_tokens)
        # One step at a time: a step swaps the model's attention implementation for its forwards, and the GPU
        # runs one step's work in order anyway.
        self._lock = threading.RLock()
        # add_request / abort from any thread: the inbox the next step drains, and every request not yet dropped.
        self._inbox_lock = threading.Lock()
        self._inbox: list[tuple[str, object]] = []
        self._states: dict[str, RequestState] = {}
        self._finished_ids: deque[str] = deque(maxlen=FINISHED_IDS_KEPT)
        self._ids = itertools.count()
        # The tokenizer is used from the callers' threads (encoding) and the stepping thread (decoding): a fast
        # tokenizer refuses concurrent use ("Already borrowed").
        self._tok_lock = threading.Lock()
        self._pending: tuple[HostCopy, list[RequestState]] | None = None
        self._carry: list[RequestOutput] = []

    def _store(self, kv_store: KVStore | None, kv_cache_bytes: int | None) -> KVStore:
        if kv_store is not None:
            if kv_cache_bytes is not None:
                raise SiftError("give either kv_store= or kv_cache_bytes=, not both (a KVStore has its own budget)")
            return kv_store
        if kv_cache_bytes is None:
            if self.device.type == "cuda":
                kv_cache_bytes = int(KV_CACHE_FRACTION * torch.cuda.mem_get_info(self.device)[0])
            else:
                kv_cache_bytes = CPU_KV_CACHE_BYTES
        elif isinstance(kv_cache_bytes, bool) or not isinstance(kv_cache_bytes, int) or kv_cache_bytes < 1:
            raise SiftError(f"kv_cache_bytes={kv_cache_bytes!r} must be an integer number of bytes >= 1")
        return KVStore(hbm_bytes=kv_cache_bytes)

    def _eos_ids(self) -> set[int]:
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])

    # ------------------------------------------------------------------------------------ tokenisation

    def tokenize(self, request: Request) -> list[tuple[str, list[int]]]:
        """-> segments (kind, token ids) in prompt order, as SPEC section 4 tokenises them."""
        tok = self.tokenizer
        with self._tok_lock:
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

    def _check_docs(self, request: Request, segments) -> None:
        """Stale or unknown documents are refused (unknown ones pass with on_unknown="dense")."""
        index = self.index
        for (doc_id, _), ids in zip(request.docs, [ids for kind, ids in segments if kind == "doc"]):
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

    # ------------------------------------------------------------------------------------ admission

    def _mode(self, mode) -> Mode:
        mode = Mode.parse(mode)
        if mode.kind == "sift" and self.index is None:
            raise SiftError("mode='sift' needs an index: create the engine with SiftIndex.open(path)")
        if mode.reuses and self.index is None and self.on_unknown == "error":
            raise SiftError(f"mode={mode.text!r} without an index treats every document as unknown: open the index "
                            f"or create the engine with on_unknown='dense'")
        return mode

    def _state(self, r: int, request: Request, params: SamplingParams, mode: Mode, request_id: str | None,
               check_docs: bool) -> RequestState:
        """Validate and tokenise one request -> its state (waiting)."""
        if not isinstance(request, Request):
            raise SiftError(f"expected Request objects, got {type(request).__name__}")
        if not isinstance(params, SamplingParams):
            raise SiftError(f"params must be a SamplingParams, got {type(params).__name__}")
        bad = [i for i in params.stop_token_ids if i >= self.vocab]
        if bad:
            raise SiftError(f"stop_token_ids {bad} are outside the model's vocabulary of {self.vocab}")
        segments = self.tokenize(request)
        n = sum(len(ids) for _, ids in segments)
        new = params.max_tokens
        if n == 0:
            raise SiftError(f"request {r} has no tokens (empty prefix, no documents, empty query): give it a prefix, "
                            f"a document or a query")
        if self.max_positions and n + new > self.max_positions:
            raise SiftError(f"request {r} has {n} prompt tokens + {new} to generate, more than the model's context "
                            f"of {self.max_positions} (max_position_embeddings): shorten the prompt or lower "
                            f"max_new_tokens / max_tokens")
        if self.window and n > self.window:
            raise SiftError(f"a prompt of {n} tokens exceeds the model's sliding window ({self.window}): the "
                            f"sparse pattern assumes full causal attention; shorten the prompt")
        if check_docs and self.index is not None and mode.kind != "dense":
            self._check_docs(request, segments)
        need = page_need(self.ctx, mode, segments, new)
        entries = sum(n_blocks(len(ids), self.block) for _, ids in segments) + need.gen
        if entries > self.runner.max_row_entries:
            raise SiftError(f"request {r} spans {entries} blocks in {len(segments)} segments, more than a decode "
                            f"row's {self.runner.max_row_entries}: give it fewer documents")
        stop_ids = tuple(sorted(self.eos_ids)) + tuple(i for i in params.stop_token_ids if i not in self.eos_ids)
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise SiftError(f"{len(stop_ids)} stop token ids (the model's eos ids and stop_token_ids): give at most "
                            f"{MAX_STOP_TOKEN_IDS - len(self.eos_ids)} stop_token_ids")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise SiftError(f"request_id={request_id!r} must be a non-empty string")
        text = OutputText(_LockedTokenizer(self.tokenizer, self._tok_lock), params.stop)
        return RequestState(request_id, request, params, mode, segments, stop_ids, seed_key(params.seed), text,
                            n_prompt=n, need=need)

    def _group(self, requests: Sequence[Request], params, mode, *, timed: bool, supplied=None,
               request_ids=None) -> Group:
        """Validate a batch -> its Group (nothing leased yet). Refuses what could never run. supplied: bits
        given instead of the index's (runtime/supplied_bits.py; mode "sift", no index needed)."""
        mode = self._mode(mode) if supplied is None else mode
        if isinstance(requests, Request) or not requests:
            raise SiftError("no requests: pass a list of at least one Request")
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(requests)
        if len(params) != len(requests):
            raise SiftError(f"{len(params)} SamplingParams for {len(requests)} requests: give one, or one per request")
        ids = request_ids or [None] * len(requests)
        states = [self._state(r, q, p, mode, i, check_docs=supplied is None)
                  for r, (q, p, i) in enumerate(zip(requests, params, ids))]
        group = Group(states, mode, supplied=supplied, timed=timed)
        for s in states:
            s.group = group
        usable = self.kv_store.n_pages - 1   # the engine holds one page for the decode batch's idle rows
        need = group.worst_pages(self.block)
        if need > usable:
            page = self.kv_store.geometry.page_bytes
            raise SiftError(
                f"this batch needs {need} KV pages ({need * page / 2**30:.2f} GiB: its documents plus its prefix, "
                f"query and generated tokens) but the KV pool holds {usable} ({usable * page / 2**30:.2f} GiB): "
                f"raise KVStore(hbm_bytes=...) or SiftEngine(kv_cache_bytes=...), or send fewer or shorter "
                f"requests per call")
        return group

    def _submit(self, group: Group) -> None:
        with self._inbox_lock:
            for s in group.states:
                if s.request_id in self._states:
                    raise SiftError(f"request_id {s.request_id!r} is already in use: give each request its own id")
            for s in group.states:
                self._states[s.request_id] = s
            self._inbox.append(("add", group))

    # ---------------------------------------------------------------------------------------- step API

    def add_request(self, request: Request, params: SamplingParams | None = None, mode: str = "sift", *,
                    request_id: str | None = None) -> str:
        """Queue one request -> its id (`request_id`, or one made here). Validated now (a bad value raises
        SiftError here); it starts at a later `step()`, when the KV pool has its pages. params: default
        SamplingParams() (temperature 1, 16 tokens). Thread-safe."""
        group = self._group([request], params if params is not None else SamplingParams(), mode, timed=False,
                            request_ids=[request_id])
        self._submit(group)
        return group.states[0].request_id

    def abort(self, request_id: str) -> None:
        """Stop a request: it ends with finish_reason "abort" at the next step, which returns its pages to the
        pool. Aborting a finished request does nothing; an id never added raises SiftError. Thread-safe."""
        with self._inbox_lock:
            if request_id not in self._states and request_id not in self._finished_ids:
                raise SiftError(f"unknown request id {request_id!r}: abort takes an id add_request returned")
            self._inbox.append(("abort", request_id))

    def has_unfinished(self) -> bool:
        """Whether a request is queued or running, or a step's outputs are still to be returned."""
        with self._inbox_lock:
            if self._inbox:
                return True
        return self.scheduler.has_work() or self._pending is not None or bool(self._carry)

    @torch.inference_mode()
    def warmup(self) -> None:
        """Capture the decode step's CUDA graphs now (they are otherwise captured at the first step): one per
        batch-size bucket, greedy and sampling. Call it before adding requests."""
        with self._lock:
            self.runner.capture()

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One iteration: admit and prefill the requests whose pages are free, launch one decode step of every
        running request, and return the outputs that changed: the first token of the requests prefilled now,
        and the tokens of the previous step's decode (the host reads a step's tokens while the device runs the
        next one, so a request's new token appears one step after the step that drew it). A request found
        finished on the host after its row was launched again discards that extra token."""
        with self._lock:
            outputs, self._carry = self._carry, []
            outputs += self._drain()
            self.runner.capture()
            sched = self.scheduler
            changed = sched.prune()
            error, new = None, []
            for group in sched.admit():
                try:
                    new.append((group, *self._prefill(group)))
                except BaseException as e:      # the group ends (its pages return); the others go on
                    for s in group.states:
                        sched.finish(s, "abort")
                        outputs.append(self._finished(s))
                    error = error or e
            tokens = live = firsts = None
            if new:
                tokens = torch.cat([t for _, t, _ in new])
                live = torch.cat([lv for _, _, lv in new])
                firsts = HostCopy(tokens)       # queued before the decode step: it waits for the prefill only
                for group, _, _ in new:
                    sched.start(group)
                changed = True
            if changed:
                self.runner.set_rows(sched.running, tokens, live)
            record = self._launch()
            if new:
                outputs += self._accept(firsts, [s for g, _, _ in new for s in g.states])
            if self._pending is not None:
                outputs += self._accept(*self._pending)
            self._pending = record
            if error is not None:
                self._carry = outputs
                raise error
            return outputs

    def _drain(self) -> list[RequestOutput]:
        """Take the inbox: new groups join the waiting queue, aborts end their requests now."""
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
        outputs = []
        for kind, item in inbox:
            if kind == "add":
                item.states = [s for s in item.states if not s.finished]   # aborted before it was drained
                if item.states:
                    self.scheduler.add(item)
            else:
                state = self._states.get(item)
                if state is not None and self.scheduler.abort(state):
                    outputs.append(self._finished(state))
        return outputs

    def _launch(self):
        """One decode step of the rows, unless every running request has all its tokens on the way already."""
        running = self.scheduler.running
        busy = [s for s in running if s.launched < s.params.max_tokens and not s.finished]
        if not busy:
            return None
        copy = self.runner.launch(greedy_only=all(s.params.greedy for s in running))
        for s in busy:
            s.launched += 1
        return copy, list(running)

    def _accept(self, copy, states) -> list[RequestOutput]:
        """Tokens of `states` (one per state, in order) from the device -> their outputs."""
        outputs = []
        for token, s in zip(copy.values(), states):
            if s.finished:
                continue
            if s.accept(int(token)):
                self.scheduler.finish(s, s.finish_reason)
                outputs.append(self._finished(s))
            else:
                outputs.append(s.output())
        return outputs

    def _finished(self, state: RequestState) -> RequestOutput:
        out = state.output()
        with self._inbox_lock:
            if state.group is None or not state.group.timed:   # a generate call reads its own states
                self._states.pop(state.request_id, None)
            self._finished_ids.append(state.request_id)
        return out

    def _prefill(self, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill one admitted group -> each request's first token and whether it goes on (device tensors)."""
        t0 = time.perf_counter()
        if group.timed and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        timer = Timer(self.device)
        timer.add("store", group.lease_s)
        if group.mode.reuses:   # the per-mode builder (runtime/plan.py, runtime/reuse_prefill.py)
            plan = reuse_plan(self.ctx, self.runner, group.mode, group.states, timer)
        else:   # supplied: bits given instead of the index's (mode "sift"; runtime/supplied_bits.py)
            plan = sift_plan(self.ctx, group.mode, group.states, timer, group.supplied)
        # each request's tile fraction, copied to the host without a wait (read once its first token is out)
        computed = plan.computed if group.mode.kind != "dense" else float(plan.dense)
        tiles = (HostCopy(torch.as_tensor(computed, dtype=torch.float32, device=self.device).reshape(1)), plan.dense)
        for s in group.states:
            s.tiles = tiles
        hidden = self.runner.forward(plan.ids, plan.positions, plan.meta, plan.cache, timer)
        logits = self.runner.logits(hidden[plan.logit_rows])
        t = time.perf_counter()
        for lease in plan.leases:
            lease.commit()
        timer.add("store", time.perf_counter() - t)
        width = self.runner.batch.max_gen_pages
        for s, (pages, offsets, parallel) in zip(group.states, plan.tables):
            gen = s.lease.scratch[s.need.own:s.need.own + s.need.gen]
            s.table = (torch.cat([pages, gen.to(torch.int32)]),
                       torch.cat([offsets, torch.full_like(gen, s.n_prompt, dtype=torch.int32)]),
                       None if parallel is None else torch.cat([parallel, torch.zeros_like(gen, dtype=torch.int32)]))
            s.gen_pages_row = torch.zeros(width, dtype=torch.int64, device=self.device)
            s.gen_pages_row[:gen.numel()] = gen
            s.launched = 1
        tokens, live = self.runner.first_tokens(logits, group.states)
        if group.timed:
            group.result = self._result(group, plan, logits, timer, t0)
        return tokens, live

    def _result(self, group: Group, plan, logits: torch.Tensor, timer: Timer, t0: float) -> PrefillResult:
        stages = timer.totals()  # synchronises on CUDA
        total = time.perf_counter() - t0
        stages["rest"] = max(0.0, total - sum(stages.values()))
        stages["total"] = total
        extra = {}
        if group.mode.reuses:
            extra = dict(store=plan.store,
                         recomputed_fraction=plan.recomputed_tokens / plan.doc_tokens if plan.doc_tokens else 0.0)
        frac = float(plan.computed) / plan.dense if group.mode.kind != "dense" else 1.0
        return PrefillResult(logits=logits, ttft_s=(total,) * len(group.states), stages=stages, tile_fraction=frac,
                             mode=group.mode.text, backend=self.backend, block=self.block,
                             n_tokens=tuple(s.n_prompt for s in group.states), **extra)

    # ------------------------------------------------------------------------------------- calls

    def stream(self, request: Request, params: SamplingParams | None = None,
               mode: str = "sift") -> Iterator[RequestOutput]:
        """One request's outputs as it generates, driving `step()` (closing the iterator early aborts it)."""
        request_id = self.add_request(request, params, mode)
        state = self._states[request_id]
        last = None
        try:
            while True:
                self.step()
                if state.latest is not last:
                    last = state.latest
                    yield last
                    if last.finished:
                        return
        finally:
            if not state.finished:
                self.abort(request_id)

    @torch.inference_mode()
    def prefill(self, requests: Sequence[Request], mode: str = "sift") -> PrefillResult:
        """Prefill a batch -> PrefillResult (logits at each request's last position); nothing is generated."""
        return self._prefill_only(self._group(requests, SamplingParams.greedy_params(1), mode, timed=True))

    def _prefill_only(self, group: Group) -> PrefillResult:
        with self._lock:
            self.scheduler.lease_now(group)
            try:
                self._prefill(group)
            finally:
                self.scheduler.release(group)
        return group.result

    def generate(self, requests: Sequence[Request], max_new_tokens: int = 32, mode: str = "sift", *,
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> GenerateResult:
        """Generate for a batch through the step API (its requests prefilled together, then decoded with every
        other running request): greedy, up to max_new_tokens tokens each, stopping at eos; or as `params` say
        (one SamplingParams, or one per request; their max_tokens replace max_new_tokens)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise SiftError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
        if params is None:
            params = SamplingParams.greedy_params(max_new_tokens)
        return self._generate(self._group(requests, params, mode, timed=True))

    def _generate(self, group: Group) -> GenerateResult:
        if len(group.states) > self.scheduler.max_running:
            raise SiftError(f"{len(group.states)} requests in one generate call, more than the "
                            f"{self.scheduler.max_running} the engine decodes at once: split the batch")
        states = list(group.states)
        self._submit(group)
        try:
            while not all(s.finished for s in states):
                self.step()
            if group.result is None or any(s.first_token_s is None for s in states):
                raise SiftError("a request of the batch was aborted before it was prefilled (abort() from another "
                                "thread)")
        finally:
            with self._lock:        # an interrupted call: its requests end now
                for s in states:
                    self.scheduler.abort(s)
            with self._inbox_lock:
                for s in states:
                    self._states.pop(s.request_id, None)
        end = max(s.finish_s for s in states)
        prefill_end = min(s.first_token_s for s in states)
        outs = [s.latest for s in states]
        return GenerateResult(texts=[o.text for o in outs], token_ids=[o.token_ids for o in outs],
                              prefill=group.result, decode_s=max(0.0, end - prefill_end))


class _LockedTokenizer:
    """The engine's tokenizer for the output texts, decoding under the engine's tokenizer lock (no reference to
    the engine itself: a dropped engine frees its KV pool at once)."""

    def __init__(self, tokenizer, lock: threading.Lock):
        self.tokenizer, self.lock = tokenizer, lock

    def decode(self, ids, **kwargs) -> str:
        with self.lock:
            return self.tokenizer.decode(ids, **kwargs)
