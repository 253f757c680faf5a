"""The engine's modes, parsed once from the mode string a caller gives into a typed value (SPEC sections 4-6).

    "sift"                        sparse prefill from the index's bits
    "dense"                       every causal block (no bits read)
    "reuse"                       documents' KV from the KV store, the request's own blocks computed
    "hybrid[:<policy>][@<f>]"     reuse, plus a share f of each document's blocks recomputed in context, chosen
                                  by `policy` (runtime/reuse.py)
    "auto[@<f>[:<t>]]"            reuse, plus up to a share f of the request's document blocks recomputed in
                                  context, given whole to its most context-sensitive documents (the index's
                                  `context_sensitivity`, at least t), never to its first document
    "ape[@<T>:<S>]"               reuse, with every computed row's attention to the reused documents rescaled
                                  by a temperature T and a scale S (APE; kernels/ape.py)
"""
from __future__ import annotations

from dataclasses import dataclass

from sift.errors import SiftError

from . import reuse

KINDS = ("sift", "dense", "reuse", "hybrid", "auto", "ape")
REUSE_KINDS = ("reuse", "hybrid", "auto", "ape")


@dataclass(frozen=True)
class Mode:
    """kind: one of KINDS; policy / fraction: mode "hybrid"'s block choice and this call's budget (None: the
    engine's hybrid_fraction; mode "auto": the request's budget); threshold: mode "auto"'s least sensitivity
    recomputed; ape: mode "ape"'s (temperature, scale); text: the string it was parsed from (what results
    report)."""

    kind: str
    policy: str | None = None
    fraction: float | None = None
    text: str = ""
    ape: tuple[float, float] | None = None
    threshold: float | None = None

    @classmethod
    def parse(cls, mode) -> "Mode":
        if isinstance(mode, Mode):
            return mode
        if not isinstance(mode, str) or (mode.partition(":")[0] not in KINDS
                                         and mode.partition("@")[0] not in ("ape", "auto")):
            raise SiftError(f"mode={mode!r} must be one of {', '.join(KINDS)} (or 'hybrid:<policy>[@<fraction>]', "
                            f"'auto@<fraction>[:<threshold>]', 'ape@<temperature>:<scale>')")
        if mode in ("sift", "dense"):
            return cls(mode, text=mode)
        if mode.partition("@")[0] == "ape":
            return cls("ape", text=mode, ape=reuse.parse_ape(mode))
        if mode.partition("@")[0] == "auto":
            fraction, threshold = reuse.parse_auto(mode)
            return cls("auto", "auto", fraction, text=mode, threshold=threshold)
        kind, policy, fraction = reuse.parse_mode(mode)
        return cls(kind, policy, fraction, text=mode)

    @property
    def reuses(self) -> bool:
        """Documents' KV comes from the KV store (modes "reuse", "hybrid" and "ape")."""
        return self.kind in REUSE_KINDS

    def __str__(self) -> str:
        return self.text or self.kind
