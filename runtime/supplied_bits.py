"""Mode "sift" on bits the caller gives instead of the index's: the in-context oracle's way into the engine (the
eval's reference, quality/oracle.py). Internal: not exported by `sift.runtime`, not part of SPEC's API.

The bits go to the same plan builder as the index's (runtime/plan.py `sift_plan`), through the same scheduler
and runner, so the oracle's figures are the engine's own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from sift.errors import SiftError
from sift.format import TILES

from ..kernels.block_indices import DocBits
from .modes import Mode
from .sampling import SamplingParams


@dataclass(frozen=True, eq=False)
class SuppliedBits:
    """bits: every document of the batch, requests in order, each request's documents in prompt order; tile:
    their tile (one of TILES, at most the engine's block)."""

    bits: DocBits
    tile: int


def _group(engine, requests: Sequence, bits: SuppliedBits | None, max_tokens: int):
    if bits is not None and (bits.tile not in TILES or bits.tile > engine.block):
        raise SiftError(f"supplied bits of tile {bits.tile}: the tile must be one of {TILES} and at most the "
                        f"engine's block {engine.block}")
    group = engine._group(requests, SamplingParams.greedy_params(max_tokens), Mode("sift", text="sift"),
                          timed=True, supplied=(None, None) if bits is None else (bits.bits, bits.tile))
    n_docs = sum(len(s.request.docs) for s in group.states)
    given = 0 if bits is None else bits.bits.la_base.numel()
    if given != n_docs and not (bits is None and n_docs == 0):
        raise SiftError(f"supplied bits hold {given} documents, the batch has {n_docs}: give one entry per "
                        f"document of every request, in order")
    return group


def prefill_with_bits(engine, requests: Sequence, bits: SuppliedBits | None):
    """`engine.prefill(requests, mode="sift")` on `bits` (None: a batch without documents) -> PrefillResult."""
    return engine._prefill_only(_group(engine, requests, bits, 1))


def generate_with_bits(engine, requests: Sequence, max_new_tokens: int, bits: SuppliedBits | None):
    """`engine.generate(requests, max_new_tokens, mode="sift")` on `bits` -> GenerateResult."""
    return engine._generate(_group(engine, requests, bits, max_new_tokens))
