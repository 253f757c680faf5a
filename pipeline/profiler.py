"""Profile documents: pack them back to back, run the model's own forward once per pack and turn each layer's
rotated q/k into SIFT bits.

q/k are captured inside the model's attention call through transformers' `AttentionInterface`, so every
supported architecture works without re-implementing it: the model computes its projections, norms and RoPE
as usual (positions restart at 0 in every sequence of a pack), and our attention function receives exactly
the q/k its attention would see. The attention function makes each sequence attend to itself only, so a
document's bits and its hidden states are those of profiling it alone.

A pack (`sift.kernels.packing.PackedDocs`) holds documents up to `batch_tokens` tokens, each after the
profiling prefix; a document longer than that is a pack of its own. Per pack: one forward, per layer one
launch of each profiling pass for the whole pack, and one asynchronous copy of the pack's bits to pinned host
memory, waited for only after the next pack's forward is launched, so the GPU runs pack after pack.

Backends: "torch" (the reference of `sift.kernels.profile_ref`, which also produces the layer's output from
the same probabilities, document by document) and "triton" (the packed kernels; the layer's output and
log-sum-exp come from an SDPA backend where one returns it, `sift.kernels.attention_lse`: flash's varlen
forward for a pack, cuDNN else flash for a single sequence; else from the kernels' own attention forward).
The "mass" LA criterion (profile.la_criterion) exists in the torch backend only; "triton" refuses it. The reader
criterion (profile.criterion = "reader") runs on both: every sequence of a pack is then [prefix, document,
reader], so each document costs its reader's tokens too, in the forward and in the pack's token budget.
`profile.ca_full_layers` / `ca_full_heads` are applied here, after either backend: those layers' (heads') CA
bits are set whole.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Sequence

import numpy as np
import torch

from sift.errors import SiftError
from sift.reader import reader_ids

from ..kernels.attention_lse import LSE_CHOICES, AttentionWithLse, Sequences
from ..kernels.packing import PackedDocs
from ..kernels.profile_ref import profile_packed_ref

from .config import DEFAULT_BATCH_TOKENS, ProfileConfig

ATTN_NAME = "sift_profile"


def profiling_prefix_ids(tokenizer, profile: ProfileConfig) -> list[int]:
    """The tokens placed before every document (SPEC section 1)."""
    if profile.prefix_text is not None:
        return list(tokenizer(profile.prefix_text, add_special_tokens=False).input_ids)
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def profiling_reader_ids(tokenizer, profile: ProfileConfig) -> list[int]:
    """The tokens placed after every document (the reader criterion's reader, `sift.reader`); none for the
    threshold criterion."""
    if profile.criterion != "reader":
        return []
    return reader_ids(tokenizer, profile.reader)


def pack_documents(lengths: Sequence[int], n_prefix: int, batch_tokens: int) -> list[list[int]]:
    """Indices of documents, in order, grouped into packs of at most `batch_tokens` rows (each document's
    n_prefix more rows counted: its prefix and reader); a document that does not fit the budget on its own is a
    pack of its own."""
    packs, current, rows = [], [], 0
    for i, n in enumerate(lengths):
        need = n_prefix + n
        if current and rows + need > batch_tokens:
            packs.append(current)
            current, rows = [], 0
        current.append(i)
        rows += need
    if current:
        packs.append(current)
    return packs


@dataclass(frozen=True)
class ProfiledBits:
    """One document's packed bits as the index stores them (one row of DOCS_SCHEMA): la/ca are bytes in
    (layer, head) order, each head byte-aligned."""

    la: bytes
    ca: bytes
    la_density: list[float]  # per layer, fraction of lower-triangle tiles kept (mean over heads)
    ca_density: list[float]  # per layer, fraction of pages kept (mean over heads)


_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)


def _density(bits: np.ndarray, n_bits: int) -> list[float]:
    """bits: [layers, Hq, bytes] uint8 (trailing bits 0) -> per layer, the fraction of bits set over heads."""
    return (_POPCOUNT[bits].sum(axis=(1, 2)) / (bits.shape[1] * n_bits)).tolist()


def _full_pages(pages: int) -> np.ndarray:
    """The CA vector with every one of `pages` pages kept (MSB first, trailing bits 0)."""
    return np.packbits(np.arange(-(-pages // 8) * 8) < pages)


class _Capture:
    """Per-pack state handed to the attention function through the model's kwargs: what the pack is (built
    before the forward) and the buffers each layer writes its bits into; the attention function decides
    nothing."""

    def __init__(self, profiler: "Profiler", docs: PackedDocs, plan, seqs: Sequences | None, la, ca):
        self.profiler = profiler
        self.docs = docs
        self.plan = plan    # `profile.PackPlan` (triton backend), None (torch)
        self.seqs = seqs    # the pack's sequences for a varlen SDPA forward; None for a single sequence
        self.la = la        # [layers, Hq, la_total] uint8
        self.ca = ca
        self.layers: set[int] = set()


def backend_label(backend: str, plans) -> str:
    """"torch", or "triton" plus the lse sources of the `Plan`s used ("+cudnn-lse", "+flash-lse", and
    "+triton-lse" where the kernels' own forward ran)."""
    if backend == "torch":
        return "torch"
    sources = sorted({plan.source or "triton" for plan in plans})
    return "+".join(["triton"] + [f"{source}-lse" for source in sources])


def _attention_with_lse(query, key, value, scaling, softcap, c: _Capture):
    """The layer's output [1, T, Hq, D] and the row log-sum-exp of the pack, (lse natural-log [Hq, T], None)
    from an SDPA backend that returns it (fp16 / bf16 without soft-capping; checked once per shape class), else
    (None, lse2 log2 [Hq, T]) from the kernels' own attention forward."""
    from ..kernels.profile import attention_packed

    if softcap is None:
        result = c.profiler.forward(query, key, value, scale=scaling, seqs=c.seqs)
        if result is not None:
            out, lse = result
            return out.transpose(1, 2), lse, None
    out, lse2 = attention_packed(query[0], key[0], value[0], c.plan, scale=scaling, softcap=softcap)
    return out.unsqueeze(0), None, lse2


def _profile_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       sift_capture: _Capture | None = None, **kwargs):
    """AttentionInterface function: query [1, Hq, T, D], key/value [1, Hkv, T, D] of a pack -> ([1, T, Hq, D],
    None), every sequence attending causally to itself only; the layer's bits go to the capture's buffers."""
    if sift_capture is None:
        raise RuntimeError("the sift_profile attention runs only inside Profiler.profile_batch")
    if query.shape[0] != 1:
        raise RuntimeError("profiling runs packs: documents back to back in one sequence (batch size 1)")
    c = sift_capture
    p, profiler, layer = c.profiler.profile_cfg, c.profiler, module.layer_idx
    softcap = getattr(module.config, "attn_logit_softcapping", None)
    args = dict(scale=scaling, alpha=p.alpha, beta=p.beta, gamma=p.gamma, softcap=softcap,
                ca_normalize=p.ca_normalize, force_sink_page=p.force_sink_page)
    if profiler.backend == "torch":
        criterion, coverage = ((p.criterion, p.coverage) if p.criterion == "reader"
                               else (p.la_criterion, p.la_coverage))
        out = profile_packed_ref(query[0], key[0], c.docs, la_out=c.la[layer], ca_out=c.ca[layer], v=value[0],
                                 dense_heads=profiler.dense.get(layer, ()), criterion=criterion,
                                 coverage=coverage, **args)
        out = out.transpose(0, 1).unsqueeze(0)
    else:
        from ..kernels.profile import profile_packed

        out, lse, lse2 = _attention_with_lse(query, key, value, scaling, softcap, c)
        profile_packed(query[0], key[0], c.plan, la_out=c.la[layer], ca_out=c.ca[layer],
                       dense=profiler.dense_flags.get(layer), lse=lse, lse2=lse2, criterion=p.criterion,
                       coverage=p.coverage, **args)
    c.layers.add(layer)
    return out, None


def _dense_heads(profile: ProfileConfig, n_layers: int, n_heads: int) -> dict[int, tuple[int, ...]]:
    """profile.dense_heads as layer -> heads, checked against the model's geometry."""
    dense: dict[int, tuple[int, ...]] = {}
    for layer, head in profile.dense_heads:
        if not (0 <= layer < n_layers and 0 <= head < n_heads):
            raise SiftError(f"profile.dense_heads entry [{layer}, {head}] is out of range for a model with "
                            f"{n_layers} layers and {n_heads} heads")
        dense[layer] = dense.get(layer, ()) + (head,)
    return dense


@dataclass
class _WarmUp:
    """What `_profile_attention` reads of a `Profiler`, for a warm-up without the model's weights."""

    profile_cfg: ProfileConfig
    backend: str
    forward: AttentionWithLse
    dense: dict
    dense_flags: dict


def _warm_lengths(n_fixed: int, tile: int) -> tuple[int, ...]:
    """Document lengths of a small warm-up pack of two documents whose integer kernel arguments that vary with
    the pack (its rows, its tiles per head, its LA / CA bytes per head) are not multiples of 16, as in most real
    packs: Triton compiles one variant of a kernel per divisibility by 16 of each integer argument."""
    from sift.format import ca_nbytes, la_nbytes, n_pages

    for extra in range(64):
        lengths = (2 * tile + 3 + extra, 5)
        pages = [n_pages(n, tile) for n in lengths]
        varying = (sum(lengths) + 2 * n_fixed, sum(p * p for p in pages), sum(la_nbytes(n, tile) for n in lengths),
                   sum(ca_nbytes(n, tile) for n in lengths))
        if all(v % 16 and v != 1 for v in varying):
            return lengths
    return (2 * tile + 3, 5)


@torch.inference_mode()
def warm_up(config, tokenizer, profile: ProfileConfig, backend: str, *, device, dtype: torch.dtype) -> None:
    """Run the profiling path of one layer on random q / k / v of the model's geometry (`config`: heads, KV
    heads, head dim, soft-capping, hidden and MLP sizes), before the model's weights exist: the Triton kernels
    compile (or load from Triton's cache) the variants a real pack launches, the SDPA backends that give the lse
    (flash's varlen forward, cuDNN) and cuBLAS (a GEMM of each linear layer's shape, in `dtype`) initialise, and
    the pinned copy of a pack's bits allocates its first host memory. Touches no state a `Profiler` reads: the
    bits a build writes do not depend on whether it ran. The "torch" backend has nothing to warm up."""
    if backend != "triton":
        return
    from ..kernels.profile import dense_flags, plan_pack

    device = torch.device(device)
    n_layers, n_heads = config.num_hidden_layers, config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    prefix, reader = profiling_prefix_ids(tokenizer, profile), profiling_reader_ids(tokenizer, profile)
    dense = _dense_heads(profile, n_layers, n_heads)
    flags = {layer: dense_flags(heads, n_heads, device) for layer, heads in dense.items()}
    warm = _WarmUp(profile, backend, AttentionWithLse(), dense, flags)
    # One layer without dense heads and one with, where some are (a kernel variant each).
    layers = sorted({next((i for i in range(n_layers) if i not in dense), 0), *list(dense)[:1]})
    module = SimpleNamespace(config=config, layer_idx=0)
    scaling = head_dim ** -0.5  # a float argument: no kernel variant depends on it
    n_fixed = len(prefix) + len(reader)
    for lengths in (_warm_lengths(n_fixed, profile.tile), (profile.tile + 3,)):  # a pack; a pack of one
        docs = PackedDocs(len(prefix), lengths, profile.tile, len(reader))
        plan = plan_pack(docs, head_dim=head_dim, dtype=dtype, device=device)
        seqs = Sequences.of(docs, plan.cu_seqlens) if len(docs) > 1 else None
        shape = (n_layers, n_heads)
        la = torch.empty(*shape, docs.la_total, dtype=torch.uint8, device=device)
        ca = torch.empty(*shape, docs.ca_total, dtype=torch.uint8, device=device)
        capture = _Capture(warm, docs, plan, seqs, la, ca)
        gen = torch.Generator(device=device).manual_seed(0)

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, generator=gen, device=device, dtype=dtype) * cols ** -0.5

        # q / k / v as a transformers attention layer hands them over: projections [1, T, H * D] viewed as
        # [1, H, T, D]; q / k through the elementwise ops of a rotary embedding (whose result keeps that layout).
        x = torch.randn(docs.total, config.hidden_size, generator=gen, device=device, dtype=dtype)
        q, k, v = (torch.nn.functional.linear(x, weight(heads * head_dim, config.hidden_size))
                   .view(1, docs.total, heads, head_dim).transpose(1, 2) for heads in (n_heads, n_kv, n_kv))
        cos = torch.ones(1, 1, docs.total, head_dim, device=device, dtype=dtype)
        q, k = (t * cos + t.flip(-1) * cos for t in (q, k))
        for layer in layers:
            module.layer_idx = layer
            out, _ = _profile_attention(module, q, k, v, None, scaling=scaling, sift_capture=capture)
        # The linear layers' GEMMs at their weights' shapes (o_proj; the MLP's up and down projections).
        h = torch.nn.functional.linear(out.flatten(2)[0], weight(config.hidden_size, n_heads * head_dim))
        mlp = getattr(config, "intermediate_size", None)
        if mlp:
            up = torch.nn.functional.linear(h, weight(mlp, config.hidden_size))
            torch.nn.functional.linear(up, weight(config.hidden_size, mlp))
        if device.type == "cuda":  # the first pinned host memory, as a pack's bits copy takes it
            torch.empty(la.shape, dtype=torch.uint8, pin_memory=True).copy_(la, non_blocking=True)
            torch.cuda.current_stream(device).synchronize()


@dataclass
class _Launched:
    """A pack whose forward is queued on the device: its bits arrive in `la` / `ca` (host, pinned on a GPU)
    once `event` has completed (None on the CPU, where the forward has finished)."""

    docs: PackedDocs
    la: torch.Tensor
    ca: torch.Tensor
    event: "torch.cuda.Event | None"


class Profiler:
    """Heavy setup once (model on its device, attention function registered); `profile_batch(docs)` per batch
    of documents, `profile(ids)` for one.

    batch_tokens: the token budget of one forward (a pack: documents and their prefixes back to back).
    lse_source ("triton" backend): which SDPA backend gives each layer's output and row log-sum-exp: "auto"
    (cuDNN, else flash; flash's varlen forward for packs), "cudnn" or "flash"; `lse_plans` shows what each
    shape class ran (a plan with source None: the kernels' own forward). The bits do not depend on it beyond
    float rounding.
    """

    def __init__(self, model, tokenizer, profile: ProfileConfig, backend: str, *, lse_source: str = "auto",
                 batch_tokens: int = DEFAULT_BATCH_TOKENS):
        from transformers import AttentionInterface

        if backend not in ("torch", "triton"):
            raise SiftError(f"profiling backend {backend!r} must be 'torch' or 'triton'")
        if backend == "triton" and profile.la_criterion != "threshold":
            raise SiftError(f"profile.la_criterion = {profile.la_criterion!r} runs on the torch backend only: set "
                            f"build.backend = \"torch\" (or use la_criterion = \"threshold\")")
        if lse_source not in LSE_CHOICES:
            raise SiftError(f"lse_source {lse_source!r} must be one of {LSE_CHOICES}")
        if batch_tokens < 1:
            raise SiftError(f"batch_tokens = {batch_tokens} must be >= 1")
        cfg = model.config
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.dense = _dense_heads(profile, self.n_layers, self.n_heads)
        outside = [layer for layer in profile.ca_full_layers if layer >= self.n_layers]
        if outside:
            raise SiftError(f"profile.ca_full_layers {outside} out of range for a model with {self.n_layers} layers "
                            f"(0..{self.n_layers - 1})")
        outside = [[l, h] for l, h in profile.ca_full_heads if l >= self.n_layers or h >= self.n_heads]
        if outside:
            raise SiftError(f"profile.ca_full_heads {outside} out of range for a model with {self.n_layers} layers "
                            f"and {self.n_heads} heads")
        self.ca_full: dict[int, tuple[int, ...]] = {layer: tuple(range(self.n_heads))
                                                    for layer in profile.ca_full_layers}
        for layer, head in profile.ca_full_heads:
            self.ca_full[layer] = tuple(sorted(set(self.ca_full.get(layer, ())) | {head}))
        # Only a valid configuration touches the model.
        self.forward = AttentionWithLse(lse_source)
        AttentionInterface.register(ATTN_NAME, _profile_attention)
        model.set_attn_implementation(ATTN_NAME)
        self.model = model
        self.device = model.device
        self.profile_cfg = profile
        self.backend = backend
        self.batch_tokens = batch_tokens
        self.prefix_ids = profiling_prefix_ids(tokenizer, profile)
        self.reader_ids = profiling_reader_ids(tokenizer, profile)
        self.window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.dense_flags = {}
        if backend == "triton":
            from ..kernels.profile import dense_flags

            # On the device once: a per-layer host-to-device copy would wait for the queued work.
            self.dense_flags = {layer: dense_flags(heads, self.n_heads, self.device)
                                for layer, heads in self.dense.items()}

    @property
    def lse_plans(self) -> dict:
        """Shape class -> `Plan` (which SDPA backend gave the lse), for benchmarks and debugging."""
        return dict(self.forward.plans)

    @property
    def backend_label(self) -> str:
        """What produced the bits so far, as recorded in the index: "torch", or "triton" plus where each layer's
        output and log-sum-exp came from ("+cudnn-lse", "+flash-lse", "+triton-lse" for the kernels' own
        forward), so a fallback is never silent."""
        return backend_label(self.backend, self.forward.plans.values())

    def refusal(self, n_tokens: int) -> str | None:
        """Why a document of n_tokens cannot be profiled, or None."""
        if n_tokens == 0:
            return "empty document: nothing to profile"
        fixed = len(self.prefix_ids) + len(self.reader_ids)
        if self.window and fixed + n_tokens > self.window:
            return (f"document of {n_tokens} tokens exceeds the model's sliding window ({self.window}) with the "
                    f"profiling prefix and reader; SIFT profiles full causal attention only: set "
                    f"corpus.max_tokens <= {self.window - fixed}")
        return None

    def profile(self, token_ids: Sequence[int]) -> ProfiledBits:
        """One document alone (a pack of one)."""
        [result] = self.profile_batch([token_ids])
        if isinstance(result, Exception):
            raise result
        return result

    @torch.inference_mode()
    def profile_batch(self, docs: Sequence[Sequence[int]]) -> list[ProfiledBits | Exception]:
        """Every document's bits, in order; a document that cannot be profiled gets its exception instead (a
        pack that fails is profiled again document by document, so one bad document fails alone)."""
        results: list[ProfiledBits | Exception | None] = [None] * len(docs)
        valid = []
        for i, ids in enumerate(docs):
            reason = self.refusal(len(ids))
            if reason:
                results[i] = SiftError(reason)
            else:
                valid.append(i)
        pending = None
        fixed = len(self.prefix_ids) + len(self.reader_ids)
        for pack in pack_documents([len(docs[i]) for i in valid], fixed, self.batch_tokens):
            members = [valid[j] for j in pack]
            launched = self._try(self._launch, [docs[i] for i in members])
            if pending is not None:  # the device runs this pack while the previous one's bits are read
                self._finish(*pending, docs, results)
            pending = (members, launched)
        if pending is not None:
            self._finish(*pending, docs, results)
        return results

    @staticmethod
    def _try(fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - reported per document by _finish
            return e

    def _finish(self, members: list[int], launched, docs, results) -> None:
        if not isinstance(launched, Exception):
            launched = self._try(self._read, launched)
        if not isinstance(launched, Exception):
            for i, bits in zip(members, launched):
                results[i] = bits
        elif len(members) == 1:
            results[members[0]] = launched
        else:
            for i in members:  # find the document that fails: each one alone
                results[i] = self._alone(docs[i])

    def _alone(self, ids: Sequence[int]) -> ProfiledBits | Exception:
        launched = self._try(self._launch, [ids])
        if isinstance(launched, Exception):
            return launched
        bits = self._try(self._read, launched)
        return bits if isinstance(bits, Exception) else bits[0]

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(array)
        if self.device.type == "cuda":  # pinned: an asynchronous copy that waits for nothing queued
            return host.pin_memory().to(self.device, non_blocking=True)
        return host.to(self.device)

    def _launch(self, docs: list[Sequence[int]]) -> _Launched:
        """Queue one pack's forward and the copy of its bits to the host."""
        n_prefix, n_reader = len(self.prefix_ids), len(self.reader_ids)
        packed = PackedDocs(n_prefix, tuple(len(d) for d in docs), self.profile_cfg.tile, n_reader)
        ids = np.empty(packed.total, dtype=np.int64)
        for s, d in enumerate(docs):
            rows, doc = packed.seq_rows(s), packed.doc_rows(s)
            ids[rows.start:doc.start] = self.prefix_ids
            ids[doc] = d
            ids[doc.stop:rows.stop] = self.reader_ids
        lens = np.asarray(packed.lengths) + n_prefix + n_reader
        positions = np.arange(packed.total) - np.repeat(np.asarray(packed.starts), lens)
        plan = seqs = None
        if self.backend == "triton":
            from ..kernels.profile import plan_pack

            plan = plan_pack(packed, head_dim=self.head_dim, dtype=self.model.dtype, device=self.device)
            seqs = Sequences.of(packed, plan.cu_seqlens) if len(packed) > 1 else None
        shape = (self.n_layers, self.n_heads)
        la = torch.empty(*shape, packed.la_total, dtype=torch.uint8, device=self.device)
        ca = torch.empty(*shape, packed.ca_total, dtype=torch.uint8, device=self.device)
        capture = _Capture(self, packed, plan, seqs, la, ca)
        self.model.base_model(input_ids=self._upload(ids)[None], position_ids=self._upload(positions)[None],
                              use_cache=False, sift_capture=capture)
        if len(capture.layers) != self.n_layers:
            raise RuntimeError(f"captured {len(capture.layers)} of {self.n_layers} layers: the model does not "
                               f"route attention through AttentionInterface")
        if self.device.type != "cuda":
            return _Launched(packed, la, ca, None)
        la_host = torch.empty(la.shape, dtype=torch.uint8, pin_memory=True)
        ca_host = torch.empty(ca.shape, dtype=torch.uint8, pin_memory=True)
        la_host.copy_(la, non_blocking=True)
        ca_host.copy_(ca, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return _Launched(packed, la_host, ca_host, event)

    def _read(self, launched: _Launched) -> list[ProfiledBits]:
        """Wait for a pack's bits and cut them into its documents' rows."""
        if launched.event is not None:
            launched.event.synchronize()
        docs, la, ca = launched.docs, launched.la.numpy(), launched.ca.numpy()
        out = []
        for s, pages in enumerate(docs.pages):
            la_doc = np.ascontiguousarray(la[:, :, docs.la_bytes(s)])  # [layers, Hq, bytes]: the row's layout
            ca_doc = np.ascontiguousarray(ca[:, :, docs.ca_bytes(s)])
            if self.ca_full:
                full = _full_pages(pages)
                for layer, heads in self.ca_full.items():
                    ca_doc[layer, list(heads)] = full
            out.append(ProfiledBits(la=la_doc.tobytes(), ca=ca_doc.tobytes(),
                                    la_density=_density(la_doc, pages * (pages + 1) // 2),
                                    ca_density=_density(ca_doc, pages)))
        return out
