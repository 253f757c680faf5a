"""The model runner: executes what the scheduler decided (STYLE 14) and decides nothing itself.

    forward / forward_until    one prefill forward of a `PrefillPlan`'s tokens (runtime/plan.py), the model's
                               attention routed to the engine's (runtime/forward.py)
    first_tokens               the first token of each prefilled request, drawn on the device
    DecodeBatch                the decode batch's static buffers: one row per running request, every value a
                               step reads (input token, counters, block tables, sampling parameters, stop ids)
                               at a fixed address, rewritten in place when requests join or leave
    set_rows / launch          (re)fill the rows, then run one decode step of every row: eagerly, or on CUDA by
                               replaying the CUDA graph captured for the smallest batch-size bucket that holds
                               the rows (`capture`, once per engine)

A decode step is the model's forward of one token per row with the engine's attention over the position-free
paged cache (for a Llama-structured model runtime/llama_decode.py's forward, with fused projections and fused
element-wise kernels, checked once against the model's own; else the unchanged transformers forward), the
lm_head, the sampler and the stop rules (eos / stop ids / max_tokens -> the row stops), all on the device: it
reads nothing back to the host, so it is the same code eager on CPU (what the tests run) and captured on CUDA.
Rows past the live ones (padding up to the bucket, and rows whose request stopped) run too, harmlessly: their
token goes to the engine's one reserved page, and nothing reads it.

The transformers forward needs nothing changed to be captured: with the engine's attention implementation (which
registers no mask function) it builds no attention mask, with `use_cache=False` no cache object, and with
`position_ids` given its rotary embedding is a few tensor ops on them; nothing in it reads the device.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import numpy as np
import torch

from sift.errors import SiftError

from ..kernels.decode_attention import default_num_splits
from ..kernels.device import triton_runs_on
from ..kernels.rmsnorm import rms_norm
from .forward import ATTN_NAME, DecodeAttention, PrefillAttention, StopAfter, Stopped, Timer
from .kv_cache import PoolKV
from .llama_decode import LlamaDecode, llama_decode
from .metadata import DecodeMetadata
from .plan import n_blocks
from .sampling import MAX_STOP_TOKEN_IDS, sample, vocab_hash

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Block table entries a row may hold beyond its tokens' blocks (each segment of a prompt pads to whole blocks).
SEGMENT_SLACK = 256


class HostCopy:
    """A device tensor on its way to the host without a wait: pinned memory and an event on CUDA (a plain
    copy on CPU); `values()` waits for it."""

    def __init__(self, t: torch.Tensor):
        self.event = None
        if t.is_cuda:
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = t.clone()

    def values(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


def upload(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values -> a device tensor, through pinned memory on CUDA (an asynchronous copy: a copy from
    pageable memory would wait for the stream)."""
    t = torch.as_tensor(np.asarray(values), dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class DecodeBatch:
    """Static buffers of the decode batch, `rows` rows (the largest bucket). Per row: tokens (the input of the
    next step: the last token drawn), n_out (tokens drawn so far: the input's position in the generated segment
    is n_out - 1, and the sampler's counter), live (the row's request still generates), its block table
    (q_offset, kv_indptr, kv_indices / kv_offset over `entries` entries in all, gen_pages), its sampling
    parameters and stop ids; slots: where this step's tokens go."""

    def __init__(self, rows: int, entries: int, gen_pages: int, device: torch.device):
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.rows, self.entries, self.max_gen_pages = rows, entries, gen_pages
        self.tokens = torch.zeros(rows, **i64)
        self.n_out = torch.ones(rows, **i64)
        self.live = torch.zeros(rows, dtype=torch.bool, device=device)
        self.slots = torch.zeros(rows, **i64)
        self.trash_slot = torch.zeros((), **i64)
        self.gen_pages = torch.zeros(rows, gen_pages, **i64)
        self.q_offset = torch.zeros(rows, **i32)
        self.kv_indptr = torch.zeros(rows + 1, **i32)
        self.kv_indices = torch.zeros(entries, **i32)
        self.kv_offset = torch.zeros(entries, **i32)
        # Mode "ape" rows: which entries are reused documents' pages, each row's (temperature, scale); `rescaled`
        # (host): whether a running row has them, so that steps without one run the plain decode.
        self.kv_parallel = torch.zeros(entries, **i32)
        self.ape = torch.ones(rows, 2, dtype=torch.float32, device=device)
        self.rescaled = False
        self.temperature = torch.zeros(rows, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(rows, **i64)
        self.top_p = torch.ones(rows, dtype=torch.float32, device=device)
        self.key = torch.zeros(rows, **i64)
        self.max_tokens = torch.ones(rows, **i64)
        self.stop_ids = torch.full((rows, MAX_STOP_TOKEN_IDS), -1, **i64)


def params_rows(states, rows: int) -> dict[str, np.ndarray]:
    """Host arrays of the sampling parameters and stop ids of `states`, padded to `rows` rows."""
    out = dict(temperature=np.zeros(rows, np.float32), top_k=np.zeros(rows, np.int64),
               top_p=np.ones(rows, np.float32), key=np.zeros(rows, np.int64), max_tokens=np.ones(rows, np.int64),
               stop_ids=np.full((rows, MAX_STOP_TOKEN_IDS), -1, np.int64))
    for r, s in enumerate(states):
        p = s.params
        out["temperature"][r], out["top_k"][r], out["top_p"][r] = p.temperature, p.top_k or 0, p.top_p
        out["key"][r], out["max_tokens"][r] = s.key, p.max_tokens
        out["stop_ids"][r, :len(s.stop_ids)] = s.stop_ids
    return out


def fusable_norms(model, device: torch.device) -> list:
    """The model's RMSNorm modules that `rms_norm` computes exactly as their own forward does: transformers'
    `*RMSNorm` modules with a 1-D `weight` and a `variance_epsilon`, each class checked once, on its first module,
    against that module's forward (a variant such as Gemma's `(1 + weight)` fails the check and keeps its own
    forward). Empty where the Triton kernels do not run."""
    if not triton_runs_on(device):
        return []
    found, verdict = [], {}
    for m in model.modules():
        w = getattr(m, "weight", None)
        if not (type(m).__name__.endswith("RMSNorm") and isinstance(getattr(m, "variance_epsilon", None), float)
                and isinstance(w, torch.Tensor) and w.dim() == 1):
            continue
        cls = type(m)
        if cls not in verdict:
            gen = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(3, w.numel(), generator=gen).to(device=w.device, dtype=w.dtype)
            with torch.no_grad():
                own, fused = m(x), rms_norm(x, w, m.variance_epsilon)
            # the same roundings in the same order; only the fp32 sum of squares is added up in another order,
            # which moves a normalised value across a rounding boundary of x's dtype now and then: one unit
            eps = torch.finfo(own.dtype).eps
            verdict[cls] = own.dtype == fused.dtype and bool(
                ((own.float() - fused.float()).abs() <= 2 * eps * own.float().abs().clamp(min=1.0)).all())
        if verdict[cls]:
            found.append(m)
    return found


class ModelRunner:
    """Runs the model for the engine: prefill forwards and decode steps (module docstring).

    cuda_graphs: capture one decode step per bucket and greedy / sampling variant (CUDA only); max_positions:
    the model's context, which sizes the rows' block tables; fused_norms: decode steps run the model's RMSNorms
    as one Triton kernel each (`fusable_norms`; where the kernels run); fast_decode: decode steps run
    runtime/llama_decode.py's forward where it accepts the model (`fast`; else `fast_refusal` says why not), which
    makes the model's q / k / v and gate / up weights views of stacked matrices (same values, same memory)."""

    def __init__(self, model, backend, inv_freq: torch.Tensor, store, *, block: int, max_positions: int,
                 cuda_graphs: bool, fused_norms: bool = True, fast_decode: bool = True):
        self.model, self.backend, self.inv_freq, self.store, self.block = model, backend, inv_freq, store, block
        self.device = inv_freq.device
        self.lm_head = model.get_output_embeddings()
        self.n_layers = model.config.num_hidden_layers
        self.vocab = self.lm_head.weight.shape[0]
        self.token_hash = vocab_hash(self.vocab, self.device)
        self.pool = PoolKV(store)
        self.max_row_entries = n_blocks(max_positions, block) + SEGMENT_SLACK
        rows = BUCKETS[-1]
        self.batch = DecodeBatch(rows, rows * self.max_row_entries, n_blocks(max_positions, block), self.device)
        # The one page the rows that generate nothing write to: held for the engine's lifetime.
        self._reserved = store.lease({}, 1)
        self.batch.trash_slot.fill_(int(self._reserved.scratch[0]) * block)
        hkv = store.geometry.n_kv_heads
        self._steps, self._ape_steps = {}, {}
        for b in BUCKETS:
            buf = self.batch
            meta = DecodeMetadata(block=block, q_offset=buf.q_offset[:b], kv_indptr=buf.kv_indptr[:b + 1],
                                  kv_indices=buf.kv_indices, kv_offset=buf.kv_offset, slots=buf.slots[:b],
                                  num_splits=default_num_splits(b, hkv, b * self.max_row_entries, self.device))
            self._steps[b] = DecodeAttention(backend, meta, self.pool, inv_freq)
            ape = dataclasses.replace(meta, kv_parallel=buf.kv_parallel, ape=buf.ape[:b])
            self._ape_steps[b] = DecodeAttention(backend, ape, self.pool, inv_freq)
        if cuda_graphs and (self.device.type != "cuda" or not backend.capturable):
            raise SiftError(f"cuda_graphs=True needs the model on a CUDA device and backend 'triton' (here "
                            f"{self.device.type}, {backend.name!r}); leave cuda_graphs unset")
        self.cuda_graphs = cuda_graphs
        # The decode step runs the model's RMSNorms as one kernel each (kernels/rmsnorm.py): at batch 1 the eight
        # element-wise kernels of each norm cost more than the bytes they move.
        self.norms = fusable_norms(model, self.device) if fused_norms else []
        # A Llama-structured model decodes in about a third of the module forward's kernels, with its q / k / v and
        # gate / up projections one GEMM each (runtime/llama_decode.py); decided once, here.
        self.fast: LlamaDecode | None = None
        self.fast_refusal = "fast_decode=False"
        if fast_decode:
            norms = self.norms if fused_norms else fusable_norms(model, self.device)
            self.fast, self.fast_refusal = llama_decode(model, self.device, norms, self.routed_attention)
        self.graphs: dict[tuple[int, bool], tuple] = {}
        self.n_rows = 0
        self.launches = 0
        self.last_logits: torch.Tensor | None = None   # the last step's fp32 logits [bucket, V]

    # ------------------------------------------------------------------------------------------- prefill

    @contextlib.contextmanager
    def routed_attention(self):
        """Route the model's attention to the engine for the duration of a forward, then restore it. The config
        attribute is swapped directly (microseconds; `set_attn_implementation` walks every module), after the
        engine validated the switch once through `set_attn_implementation`."""
        config = self.model.config
        previous = config._attn_implementation
        config._attn_implementation = ATTN_NAME
        try:
            yield
        finally:
            config._attn_implementation = previous

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta, cache, timer: Timer) -> torch.Tensor:
        """One prefill forward over `ids` [n] at segment-local `positions` [n] -> last hidden states [n, hidden];
        each layer's K / V go into `cache` and attention follows `meta`."""
        attention = PrefillAttention(self.backend, meta, cache, self.inv_freq, timer)
        with self.routed_attention():
            hidden = self.model.base_model(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                                           sift_state=attention).last_hidden_state
        if cache.layers_written != self.n_layers:  # never serve a silently dense (or unrotated) forward
            raise SiftError(f"only {cache.layers_written} of {self.n_layers} layers ran the engine's attention: the "
                            f"model does not dispatch attention through transformers' AttentionInterface")
        return hidden[0]

    def forward_until(self, ids: torch.Tensor, positions: torch.Tensor, meta, cache, layer: int,
                      timer: Timer) -> None:
        """A forward of the first layers only: `cache` holds layers 0..layer's K / V afterwards."""
        attention = StopAfter(self.backend, meta, cache, self.inv_freq, timer, layer)
        with self.routed_attention(), contextlib.suppress(Stopped):
            self.model.base_model(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                                  sift_state=attention)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden] -> fp32 logits [B, vocab]."""
        return self.lm_head(hidden).float()

    def first_tokens(self, logits: torch.Tensor, states) -> tuple[torch.Tensor, torch.Tensor]:
        """Each prefilled request's first token, drawn from its prompt's logits [B, V] on the device, and
        whether it goes on generating (not a stop id, max_tokens above 1). -> (int64 [B], bool [B])."""
        p = params_rows(states, len(states))
        up = {k: upload(v, torch.float32 if v.dtype == np.float32 else torch.int64, self.device)
              for k, v in p.items()}
        counter = torch.zeros(len(states), dtype=torch.int64, device=self.device)
        token = sample(logits, up["temperature"], up["top_k"], up["top_p"], up["key"], counter, self.token_hash,
                       greedy_only=all(s.params.greedy for s in states))
        stop = (token[:, None] == up["stop_ids"]).any(1) | (up["max_tokens"] <= 1)
        return token, ~stop

    # -------------------------------------------------------------------------------------------- decode

    def set_rows(self, running, new_tokens: torch.Tensor | None, new_live: torch.Tensor | None) -> None:
        """Fill the rows with `running` (RequestStates, in row order): those with a row keep their device state
        (gathered into their new rows), the others (the last ones) start from `new_tokens` / `new_live`, drawn
        by their prefill. Every host-known value (tables, parameters, stop ids) is uploaded anew."""
        buf, dev = self.batch, self.device
        old = [s.row for s in running if s.row is not None]
        n_old, n = len(old), len(running)
        if n > buf.rows:
            raise SiftError(f"{n} running requests exceed the decode batch's {buf.rows} rows")
        if old != list(range(n_old)):
            idx = upload(old, torch.int64, dev)
            kept = (buf.tokens[idx], buf.n_out[idx], buf.live[idx])
            for dst, src in zip((buf.tokens, buf.n_out, buf.live), kept):
                dst[:n_old] = src
        if n > n_old:
            buf.tokens[n_old:n] = new_tokens
            buf.n_out[n_old:n] = 1
            buf.live[n_old:n] = new_live
        buf.live[n:] = False
        for r, s in enumerate(running):
            s.row = r
        if n:
            buf.gen_pages[:n] = torch.stack([s.gen_pages_row for s in running])
            entries = torch.cat([s.table[0] for s in running])
            buf.kv_indices[:entries.numel()] = entries
            buf.kv_offset[:entries.numel()] = torch.cat([s.table[1] for s in running])
        buf.rescaled = any(s.mode.ape is not None for s in running)
        if buf.rescaled:
            buf.kv_parallel[:entries.numel()] = torch.cat(
                [s.table[2] if s.table[2] is not None else torch.zeros_like(s.table[0]) for s in running])
            ape = np.ones((buf.rows, 2), np.float32)
            ape[:n] = [s.mode.ape or (1.0, 1.0) for s in running]
            buf.ape.copy_(upload(ape, torch.float32, dev), non_blocking=True)
        counts = [int(s.table[0].numel()) for s in running]
        indptr = np.zeros(buf.rows + 1, np.int64)
        indptr[1:n + 1] = np.cumsum(counts)
        indptr[n + 1:] = indptr[n]
        offsets = np.zeros(buf.rows, np.int64)
        offsets[:n] = [s.n_prompt for s in running]
        host = dict(params_rows(running, buf.rows), kv_indptr=indptr, q_offset=offsets)
        for name, values in host.items():
            dst = getattr(buf, name)
            dst.copy_(upload(values, dst.dtype, dev), non_blocking=True)
        self.n_rows = n

    def bucket(self) -> int:
        return next(b for b in BUCKETS if b >= self.n_rows)

    def launch(self, greedy_only: bool) -> HostCopy:
        """One decode step of every row (module docstring) -> the rows' tokens on their way to the host."""
        b = self.bucket()
        self.launches += 1
        if self.cuda_graphs and not self.batch.rescaled:    # APE rows decode without the captured graphs
            self.capture()
            graph, self.last_logits = self.graphs[b, greedy_only]
            graph.replay()
        else:
            self.last_logits = self._step(b, greedy_only)
        return HostCopy(self.batch.tokens[:b])

    @contextlib.contextmanager
    def fused(self):
        """The model's fusable RMSNorms run `rms_norm` for the duration (an instance attribute over the class's
        forward, removed afterwards)."""
        for m in self.norms:
            m.forward = functools.partial(rms_norm, weight=m.weight, eps=m.variance_epsilon)
        try:
            yield
        finally:
            for m in self.norms:
                del m.forward

    def _step(self, b: int, greedy_only: bool) -> torch.Tensor:
        """The decode step of rows [0, b): reads and writes the static buffers only (capture-safe). -> its
        fp32 logits [b, V]."""
        with self.fused() if self.fast is None else contextlib.nullcontext():
            return self._decode(b, greedy_only)

    def _decode(self, b: int, greedy_only: bool) -> torch.Tensor:
        buf, blk = self.batch, self.block
        live = buf.live[:b]
        n_out = buf.n_out[:b]
        pos = (n_out - 1).clamp(min=0)           # the input token's position in the generated segment
        page = buf.gen_pages[:b].gather(1, (pos // blk).clamp(max=buf.max_gen_pages - 1)[:, None])[:, 0]
        buf.slots[:b] = torch.where(live, page * blk + pos % blk, buf.trash_slot)
        self.pool.advance(buf.slots[:b])
        attention = (self._ape_steps if buf.rescaled else self._steps)[b]
        if self.fast is not None:
            hidden = self.fast.forward(buf.tokens[:b], pos, attention)
        else:
            with self.routed_attention():
                hidden = self.model.base_model(input_ids=buf.tokens[:b][None], position_ids=pos[None],
                                               use_cache=False, sift_state=attention).last_hidden_state[0]
        logits = self.lm_head(hidden).float()
        token = sample(logits, buf.temperature[:b], buf.top_k[:b], buf.top_p[:b], buf.key[:b], n_out,
                       self.token_hash, greedy_only=greedy_only)
        drawn = n_out + live.long()
        stop = (token[:, None] == buf.stop_ids[:b]).any(1) | (drawn >= buf.max_tokens[:b])
        buf.tokens[:b] = torch.where(live, token, buf.tokens[:b])
        buf.n_out[:b] = drawn
        buf.live[:b] = live & ~stop
        return logits

    def capture(self) -> None:
        """Capture the decode step of every bucket, greedy and sampling, in CUDA graphs sharing one memory pool,
        largest first (once; every row must be idle: the warm-up runs change nothing but the reserved page)."""
        if not self.cuda_graphs or self.graphs:
            return
        if self.n_rows:
            raise SiftError("CUDA graphs are captured before the first request runs: call engine.warmup() first")
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for b in reversed(BUCKETS):
            for greedy_only in (True, False):
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    self._step(b, greedy_only)           # compiles the kernels, sizes cuBLAS' workspace
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._step(b, greedy_only)
                self.graphs[b, greedy_only] = (graph, logits)
        torch.cuda.current_stream(self.device).synchronize()
