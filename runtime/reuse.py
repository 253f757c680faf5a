"""Modes "reuse" and "hybrid": which blocks a request recomputes when its documents' KV comes from the store.

    "reuse"            every document as the store holds it (computed on its own after the profiling prefix);
                       the request computes its prefix, its query and the last block of the prompt
    "hybrid:<policy>"  reuse, plus a share of each document's blocks recomputed in context (with SIFT's sparse
                       pattern: LA tiles of the document, CA pages of earlier documents, the prefix), chosen by
                       a policy at the same budget (`fraction` of the document's blocks, at least one):

        first       the document's first blocks (EPIC / LegoLink: the attention-sink tokens that lose the most
                    when a chunk is moved out of its context)
        deviation   the blocks whose layer-1 keys move the most between the cached entry and the request's own
                    context (CacheBlend's selection, by block: the kernels compute whole blocks)
        bits        the blocks whose CA pages the most (layer, head) pairs keep (the index's offline profile:
                    the pages later documents read most; ours, free at serving time)
        none        no recomputation (equals "reuse"; the baseline of the comparison)

"hybrid" alone is `DEFAULT_POLICY`, chosen by the answer-agreement measurement in the README's Quality section.
"hybrid:<policy>@<fraction>" sets the budget of one call (default: the engine's `hybrid_fraction`).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from sift.errors import SiftError
from sift.format import ca_nbytes, n_pages

from ..kernels.bits import unpack_msb

POLICIES = ("first", "deviation", "bits", "none")
# "first": on the answer-agreement measurement (README, "KV reuse and answers": HotpotQA, 2WikiMultihopQA and
# long documents, 40 questions each, SmolLM2) it is within one answer of "deviation" at every budget measured
# (36 of 120 whole answers equal dense at 15% for both), with the lower first-token KL on two sets of three, and
# needs no extra pass over the prompt; "bits" trails both.
DEFAULT_POLICY = "first"
DEFAULT_FRACTION = 0.15
DEFAULT_APE = (0.9, 0.9)
AUTO_FRACTION = 0.3
AUTO_THRESHOLD = 0.0
DEVIATION_LAYER = 1


def parse_ape(mode: str) -> tuple[float, float]:
    """"ape" -> DEFAULT_APE; "ape@<T>:<S>" -> (T, S), the temperature and scale of kernels/ape.py, each a
    positive number (T at most 1: a temperature above 1 flattens the documents' attention further). No comma in
    the grammar: mode lists are comma-separated."""
    base, at, rest = mode.partition("@")
    if base == "ape" and not at:
        return DEFAULT_APE
    parts = rest.split(":")
    try:
        t, s = (float(x) for x in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        t = s = None
    if base != "ape" or t is None or not (0.0 < t <= 1.0 and 0.0 < s <= 4.0):
        raise SiftError(f"mode={mode!r} is not an APE mode: use 'ape' or 'ape@<temperature>:<scale>' with a "
                        f"temperature in (0, 1] and a scale in (0, 4], e.g. 'ape@{DEFAULT_APE[0]:g}:{DEFAULT_APE[1]:g}'")
    return t, s


def parse_auto(mode: str) -> tuple[float, float]:
    """"auto" -> (AUTO_FRACTION, AUTO_THRESHOLD); "auto@<f>" / "auto@<f>:<t>" -> the request's budget f (a share
    of its documents' blocks, in [0, 1]) and the least context sensitivity t >= 0 a document needs to be
    recomputed."""
    base, at, rest = mode.partition("@")
    fraction, colon, threshold = rest.partition(":")
    share = _fraction(fraction) if at else AUTO_FRACTION
    least = AUTO_THRESHOLD
    if colon:
        try:
            least = float(threshold)
        except ValueError:
            least = -1.0
    if base != "auto" or share is None or not least >= 0.0 or least == float("inf"):
        raise SiftError(f"mode={mode!r} is not an auto mode: use 'auto', 'auto@<fraction>' or "
                        f"'auto@<fraction>:<threshold>' with a fraction in [0, 1] and a threshold >= 0, e.g. "
                        f"'auto@{AUTO_FRACTION:g}:{AUTO_THRESHOLD:g}'")
    return share, least


def auto_budget(n_blocks: list[int], scores: list[float | None], fraction: float, threshold: float) -> list[int]:
    """Mode "auto": blocks recomputed per document of one request (in prompt order; n_blocks and scores per
    document, a score None where the index has none, counted as 0). The request's budget, ceil(fraction * its
    document blocks), goes to its documents in descending score (ties: the earlier), each taking its first
    blocks up to its whole length, while budget remains; the first document (it follows only the prefix, as
    its stored entry does) and documents scoring below `threshold` get none."""
    left = math.ceil(fraction * sum(n_blocks))
    out = [0] * len(n_blocks)
    ranked = sorted(range(1, len(n_blocks)), key=lambda i: (-(scores[i] or 0.0), i))
    for i in ranked:
        if left <= 0 or (scores[i] or 0.0) < threshold:
            break
        out[i] = min(n_blocks[i], left)
        left -= out[i]
    return out


def parse_mode(mode: str) -> tuple[str, str | None, float | None]:
    """"reuse" -> ("reuse", None, None); "hybrid" / "hybrid:<policy>" -> ("hybrid", policy, None);
    "hybrid:<policy>@<fraction>" -> ("hybrid", policy, fraction): this call's budget instead of the engine's
    hybrid_fraction."""
    base, _, rest = mode.partition(":")
    policy, at, fraction = rest.partition("@")
    if base == "reuse" and not rest:
        return base, None, None
    if base == "hybrid":
        policy = policy or DEFAULT_POLICY
        share = _fraction(fraction) if at else None
        if policy in POLICIES and (not at or share is not None):
            return base, policy, share
    raise SiftError(f"mode={mode!r} is not a reuse mode: use 'reuse', 'hybrid', 'hybrid:<policy>' or "
                    f"'hybrid:<policy>@<fraction>' with a policy in {', '.join(POLICIES)} and a fraction in [0, 1]")


def _fraction(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0.0 <= value <= 1.0 else None


def budget(n_blocks: int, fraction: float, policy: str | None) -> int:
    """Blocks recomputed per document of n_blocks blocks."""
    if policy in (None, "none"):
        return 0
    return min(n_blocks, max(1, math.ceil(fraction * n_blocks)))


def top_blocks(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k highest scores (ties: the earlier block), ascending."""
    order = np.lexsort((np.arange(len(scores)), -scores))
    return np.sort(order[:k])


def ca_block_scores(ca: torch.Tensor, n_tokens: int, tile: int, block: int, vectors: int) -> np.ndarray:
    """A document's packed CA bits (every (layer, head) vector, byte-aligned) -> per kernel block, how many
    (layer, head) pairs keep each of its pages (summed over the tiles of the block)."""
    pages = n_pages(n_tokens, tile)
    kept = unpack_msb(ca.view(vectors, ca_nbytes(n_tokens, tile)), pages).sum(0).numpy().astype(np.float64)
    per_block = block // tile
    n_blocks = -(-n_tokens // block)
    padded = np.zeros(n_blocks * per_block)
    padded[:pages] = kept
    return padded.reshape(n_blocks, per_block).sum(1)
