"""Sampling: the parameters of one request (`SamplingParams`) and the sampler that draws every request's next
token of a step on the device (SPEC section 7).

Semantics are transformers': temperature scales the logits (0: greedy, the first maximum), then top-k keeps the
tokens whose scaled logit is at least the k-th largest (ties kept; 0 or None: off), then top-p keeps the smallest
set of most probable tokens whose probability (after top-k, renormalised) reaches top_p (1: off); the token is
drawn from the renormalised probabilities of what is kept.

The sampler runs over the batch with per-request parameter tensors, with no host synchronisation and no
data-dependent Python branch, so a CUDA graph can capture it. Its randomness is counter-based: every (request
seed, token index of the request's output, vocabulary id) gets a uniform u from an integer hash, and the token
is the winner of an exponential race, argmax over kept tokens of p_i / E_i with E_i = -log(u_i) (the Gumbel-max
trick: an exact sample from the kept distribution). A seeded request is therefore reproducible whatever else is
in its batch and wherever it sits in it, and no global generator is touched.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from numbers import Integral, Real

import torch

from sift.errors import SiftError

# stop_token_ids per request, the model's eos ids included (the width of the device's stop table).
MAX_STOP_TOKEN_IDS = 32
_MASK32 = 0xFFFFFFFF
# An odd multiplier below 2**27: a product of it and a 32-bit value never overflows int64.
_MIX = 0x45D9F3B


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates (defaults as OpenAI's and vLLM's APIs: temperature 1, no top-k / top-p).

    max_tokens: tokens to generate at most (>= 1); temperature >= 0 (0: greedy); top_p in (0, 1] (1: off);
    top_k: None or 0 (off) or the number of most likely tokens kept; seed: None (a fresh random seed) or an
    integer that makes the request's samples reproducible; stop: strings that end the request, the text ending
    before the first one found (never returned); stop_token_ids: ids that end the request, as the model's eos
    does (the token is the last of `token_ids`, not part of the text)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        def bad(name: str, must: str) -> SiftError:
            return SiftError(f"SamplingParams {name}={getattr(self, name)!r} {must}")

        m = self.max_tokens
        if isinstance(m, bool) or not isinstance(m, Integral) or m < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, Real) or not math.isfinite(t) or t < 0:
            raise bad("temperature", "must be a finite number >= 0 (0: greedy)")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, Real) or not 0.0 < p <= 1.0:
            raise bad("top_p", "must lie in (0, 1] (1: off)")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, Integral) or k < 0):
            raise bad("top_k", "must be None or an integer >= 0 (0 or None: off)")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, Integral)):
            raise bad("seed", "must be None or an integer")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = ()
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
            raise bad("stop", "must be a string or a list of non-empty strings")
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if (not isinstance(ids, (list, tuple)) or
                not all(isinstance(i, Integral) and not isinstance(i, bool) and i >= 0 for i in ids)):
            raise bad("stop_token_ids", "must be a list of token ids >= 0")
        if len(ids) > MAX_STOP_TOKEN_IDS // 2:
            raise bad("stop_token_ids", f"holds more than {MAX_STOP_TOKEN_IDS // 2} ids: give at most that many")
        object.__setattr__(self, "max_tokens", int(m))
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "top_k", int(k) if k else None)
        object.__setattr__(self, "seed", int(s) if s is not None else None)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def greedy_params(cls, max_tokens: int) -> "SamplingParams":
        return cls(max_tokens=max_tokens, temperature=0.0)


def seed_key(seed: int | None) -> int:
    """A request's 32-bit hash key: from its seed (any integer), or fresh random bits when it has none."""
    if seed is None:
        return int.from_bytes(os.urandom(4), "little")
    x = seed & 0xFFFFFFFFFFFFFFFF   # splitmix64's finaliser: nearby seeds give unrelated keys
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & _MASK32


# ------------------------------------------------------------------------------------------- the sampler


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two xorshift-multiply rounds) of int64 values in [0, 2**32)."""
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    return (x >> 16) ^ x


def vocab_hash(vocab: int, device) -> torch.Tensor:
    """int64 [vocab]: the first hash round of every token id, shared by all steps (computed once)."""
    return _mix(torch.arange(vocab, dtype=torch.int64, device=device))


def uniforms(key: torch.Tensor, counter: torch.Tensor, token_hash: torch.Tensor) -> torch.Tensor:
    """fp32 [B, V] in (0, 1): the uniform of (request key [B], output token index [B], token id), from
    `token_hash` [V] (or [B, V]: the hashes of the ids in some order) = vocab_hash's values."""
    h = _mix(token_hash ^ (counter[:, None] & _MASK32))
    h = _mix(h ^ key[:, None])
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def kept_sorted(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """The filtered support in descending order of probability: -> (scaled logits sorted descending [B, V],
    their token ids [B, V], bool keep [B, V]). temperature 0 rows are scaled by 1 (their sample is unused).
    top_k: int64 [B], 0 = off; top_p: fp32 [B], 1 = off."""
    vocab = logits.shape[-1]
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits / t[:, None]
    values, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = values.gather(1, (k - 1)[:, None])
    keep = values >= kth                                                   # ties with the k-th are kept
    probs = torch.softmax(values.masked_fill(~keep, float("-inf")), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs                           # mass of the more probable tokens
    keep &= (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    return values, order, keep


def kept_mask(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
              top_p: torch.Tensor) -> torch.Tensor:
    """bool [B, V] in vocabulary order: the tokens a sampled request may draw."""
    _, order, keep = kept_sorted(logits, temperature, top_k, top_p)
    return torch.zeros_like(keep).scatter_(1, order, keep)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           key: torch.Tensor, counter: torch.Tensor, token_hash: torch.Tensor, *, greedy_only: bool = False):
    """logits: fp32 [B, V]; per request: temperature fp32 [B], top_k int64 [B], top_p fp32 [B], key int64 [B]
    (`seed_key`), counter int64 [B] (index of the token drawn in the request's output); token_hash: int64 [V]
    (`vocab_hash`). -> int64 [B]. greedy_only: every request is greedy (a static choice of the caller: the
    argmax alone, no sort)."""
    best = logits.argmax(dim=-1)
    if greedy_only:
        return best
    values, order, keep = kept_sorted(logits, temperature, top_k, top_p)
    u = uniforms(key, counter, token_hash[order])
    # argmax of p_i / E_i over the kept tokens, E_i = -log(u_i) ~ Exp(1): in logs, scaled logit - log E_i
    race = torch.where(keep, values - torch.log(-torch.log(u)), torch.full_like(values, float("-inf")))
    drawn = order.gather(1, race.argmax(dim=-1, keepdim=True))[:, 0]
    return torch.where(temperature > 0, drawn, best)
