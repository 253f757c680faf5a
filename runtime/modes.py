"""The engine's modes, parsed once from the mode string a caller gives into a typed value (SPEC sections 4-6).

    "sift"                        sparse prefill from the index's bits
    "dense"                       every causal block (no bits read)
    "reuse"                       documents' KV from the KV store, the request's own blocks computed
    "hybrid[:<policy>][@<f>]"     reuse, plus a share f of each document's blocks recomputed in context, chosen
                                  by `policy` (runtime/reuse.py)
"""
from __future__ import annotations

from dataclasses import dataclass

from sift.errors import SiftError

from . import reuse

KINDS = ("sift", "dense", "reuse", "hybrid")


@dataclass(frozen=True)
class Mode:
    """kind: one of KINDS; policy / fraction: mode "hybrid"'s block choice and this call's budget (None: the
    engine's hybrid_fraction); text: the string it was parsed from (what results report)."""

    kind: str
    policy: str | None = None
    fraction: float | None = None
    text: str = ""

    @classmethod
    def parse(cls, mode) -> "Mode":
        if isinstance(mode, Mode):
            return mode
        if not isinstance(mode, str) or mode.partition(":")[0] not in KINDS:
            raise SiftError(f"mode={mode!r} must be one of {', '.join(KINDS)} (or 'hybrid:<policy>[@<fraction>]')")
        if mode in ("sift", "dense"):
            return cls(mode, text=mode)
        kind, policy, fraction = reuse.parse_mode(mode)
        return cls(kind, policy, fraction, text=mode)

    @property
    def reuses(self) -> bool:
        """Documents' KV comes from the KV store (modes "reuse" and "hybrid")."""
        return self.kind in ("reuse", "hybrid")

    def __str__(self) -> str:
        return self.text or self.kind
