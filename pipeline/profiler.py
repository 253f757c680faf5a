"""Profile one document: run the model's own forward pass and turn each layer's rotated q/k into SIFT bits.

q/k are captured inside the model's attention call through transformers' `AttentionInterface`, so every
supported architecture works without re-implementing it: the model computes its projections, norms and RoPE
as usual, and our attention function receives exactly the q/k its attention would see.

Backends: "torch" (the reference of `sift.kernels.profile_ref`, which also produces the layer's output from
the same probabilities) and "triton" (the fused statistics kernel; the output comes from the model's SDPA).
The "mass" LA criterion (profile.la_criterion) exists in the torch backend only; "triton" refuses it.
`profile.ca_full_layers` / `ca_full_heads` are applied here, after either backend: those layers' (heads') CA
bits are set whole.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sift.errors import SiftError
from sift.format import n_pages

from ..kernels.attention_lse import LSE_CHOICES, AttentionWithLse
from ..kernels.bits import pack_msb
from ..kernels.profile_ref import LayerBits, profile_layer_ref

from .config import ProfileConfig

ATTN_NAME = "sift_profile"


def profiling_prefix_ids(tokenizer, profile: ProfileConfig) -> list[int]:
    """The tokens placed before every document (SPEC section 1)."""
    if profile.prefix_text is not None:
        return list(tokenizer(profile.prefix_text, add_special_tokens=False).input_ids)
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


@dataclass(frozen=True)
class ProfiledBits:
    """One document's packed bits as the index stores them (one row of DOCS_SCHEMA): la/ca are bytes in
    (layer, head) order, each head byte-aligned."""

    la: bytes
    ca: bytes
    la_density: list[float]  # per layer, fraction of lower-triangle tiles kept (mean over heads)
    ca_density: list[float]  # per layer, fraction of pages kept (mean over heads)


_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int32)


def _density(packed: torch.Tensor, n_bits: int) -> list[float]:
    """packed: [layers, Hq, bytes] uint8 (trailing bits 0) -> per layer, the fraction of bits set over heads."""
    ones = _POPCOUNT.to(packed.device)[packed.long()].sum(dim=(1, 2))
    return (ones.double() / (packed.shape[1] * n_bits)).tolist()


class _Capture:
    """Per-forward state handed to the attention function through the model's kwargs."""

    def __init__(self, n_prefix: int, profile: ProfileConfig, backend: str, dense: dict[int, tuple[int, ...]],
                 ca_full: dict[int, tuple[int, ...]], forward: AttentionWithLse):
        self.n_prefix = n_prefix
        self.forward = forward
        self.profile = profile
        self.backend = backend
        self.dense = dense
        self.ca_full = ca_full  # layer -> the heads whose CA bits are all set
        self.layers: dict[int, LayerBits] = {}


def backend_label(backend: str, plans) -> str:
    """"torch", or "triton" plus the lse sources of the `Plan`s used ("+cudnn-lse", "+flash-lse", and
    "+triton-lse" where the kernel's own first pass ran)."""
    if backend == "torch":
        return "torch"
    sources = sorted({plan.source or "triton" for plan in plans})
    return "+".join(["triton"] + [f"{source}-lse" for source in sources])


def _attention_with_lse(module, query, key, value, scaling, softcap, forward: AttentionWithLse):
    """The layer's output [1, Lp, Hq, D] and, where an SDPA backend exposes it, the row log-sum-exp [Hq, Lp]
    (natural log, fp32), so the profiling kernel can skip its own first pass.

    fp16/bf16 without soft-capping: cuDNN (else flash) SDPA returns both, checked once per shape class
    (`sift.kernels.attention_lse`). Otherwise the model's SDPA gives the output and the kernel computes the
    log-sum-exp itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if softcap is None:
        result = forward(query, key, value, scale=scaling)
        if result is not None:
            out, lse = result
            return out.transpose(1, 2), lse
    out, _ = sdpa_attention_forward(module, query, key, value, None, scaling=scaling, is_causal=True)
    return out, None


def _profile_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       sift_capture: _Capture | None = None, **kwargs):
    """AttentionInterface function: query [1, Hq, Lp, D], key/value [1, Hkv, Lp, D] -> ([1, Lp, Hq, D], None)."""
    if sift_capture is None:
        raise RuntimeError("the sift_profile attention runs only inside Profiler.profile")
    if query.shape[0] != 1:
        raise RuntimeError("profiling runs one document at a time (batch size 1)")
    c, p = sift_capture, sift_capture.profile
    softcap = getattr(module.config, "attn_logit_softcapping", None)
    args = dict(scale=scaling, n_prefix=c.n_prefix, tile=p.tile, alpha=p.alpha, beta=p.beta, gamma=p.gamma,
                softcap=softcap, ca_normalize=p.ca_normalize, force_sink_page=p.force_sink_page,
                dense_heads=c.dense.get(module.layer_idx, ()))
    if c.backend == "torch":
        bits, out = profile_layer_ref(query[0], key[0], v=value[0], criterion=p.la_criterion,
                                      coverage=p.la_coverage, **args)
        out = out.transpose(0, 1).unsqueeze(0)
    else:
        from ..kernels.profile import profile_layer

        out, lse = _attention_with_lse(module, query, key, value, scaling, softcap, c.forward)
        bits, _ = profile_layer(query[0], key[0], lse=lse, **args)
    heads = c.ca_full.get(module.layer_idx)
    if heads:
        pages = n_pages(query.shape[2] - c.n_prefix, p.tile)
        ca = bits.ca.clone()
        ca[list(heads)] = pack_msb(torch.ones(len(heads), pages, dtype=torch.bool, device=ca.device))
        bits = LayerBits(la=bits.la, ca=ca)
    c.layers[module.layer_idx] = bits
    return out, None


class Profiler:
    """Heavy setup once (model on its device, attention function registered); `profile(ids)` per document.

    lse_source ("triton" backend): which SDPA backend gives each layer's output and row log-sum-exp: "auto"
    (cuDNN, else flash), "cudnn" or "flash"; `lse_plans` shows what each shape class ran (a plan with
    source None: the kernel's own lse pass). The bits do not depend on it beyond float rounding.
    """

    def __init__(self, model, tokenizer, profile: ProfileConfig, backend: str, *, lse_source: str = "auto"):
        from transformers import AttentionInterface

        if backend not in ("torch", "triton"):
            raise SiftError(f"profiling backend {backend!r} must be 'torch' or 'triton'")
        if backend == "triton" and profile.la_criterion != "threshold":
            raise SiftError(f"profile.la_criterion = {profile.la_criterion!r} runs on the torch backend only: set "
                            f"build.backend = \"torch\" (or use la_criterion = \"threshold\")")
        if lse_source not in LSE_CHOICES:
            raise SiftError(f"lse_source {lse_source!r} must be one of {LSE_CHOICES}")
        cfg = model.config
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.dense: dict[int, tuple[int, ...]] = {}
        for layer, head in profile.dense_heads:
            if not (0 <= layer < self.n_layers and 0 <= head < self.n_heads):
                raise SiftError(f"profile.dense_heads entry [{layer}, {head}] is out of range for a model with "
                                f"{self.n_layers} layers and {self.n_heads} heads")
            self.dense[layer] = self.dense.get(layer, ()) + (head,)
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
        self.profile_cfg = profile
        self.backend = backend
        self.prefix_ids = profiling_prefix_ids(tokenizer, profile)
        self.window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None

    @property
    def lse_plans(self) -> dict:
        """Shape class -> `Plan` (which SDPA backend gave the lse), for benchmarks and debugging."""
        return dict(self.forward.plans)

    @property
    def backend_label(self) -> str:
        """What produced the bits so far, as recorded in the index: "torch", or "triton" plus where each layer's
        output and log-sum-exp came from ("+cudnn-lse", "+flash-lse", "+triton-lse" for the kernel's own pass),
        so a fallback is never silent."""
        return backend_label(self.backend, self.forward.plans.values())

    @torch.inference_mode()
    def profile(self, token_ids: list[int]) -> ProfiledBits:
        n = len(token_ids)
        if n == 0:
            raise SiftError("empty document: nothing to profile")
        total = len(self.prefix_ids) + n
        if self.window and total > self.window:
            raise SiftError(f"document of {n} tokens exceeds the model's sliding window ({self.window}); "
                            f"SIFT profiles full causal attention only: set corpus.max_tokens <= {self.window}")
        ids = torch.tensor([self.prefix_ids + list(token_ids)], device=self.model.device)
        capture = _Capture(len(self.prefix_ids), self.profile_cfg, self.backend, self.dense, self.ca_full,
                           self.forward)
        self.model.base_model(input_ids=ids, use_cache=False, sift_capture=capture)
        if len(capture.layers) != self.n_layers:
            raise RuntimeError(f"captured {len(capture.layers)} of {self.n_layers} layers: the model does not "
                               f"route attention through AttentionInterface")
        la = torch.stack([capture.layers[i].la for i in range(self.n_layers)])  # [layers, Hq, bytes]
        ca = torch.stack([capture.layers[i].ca for i in range(self.n_layers)])
        p = n_pages(n, self.profile_cfg.tile)
        return ProfiledBits(la=la.cpu().numpy().tobytes(), ca=ca.cpu().numpy().tobytes(),
                            la_density=_density(la, p * (p + 1) // 2), ca_density=_density(ca, p))
