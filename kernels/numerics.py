"""Constants and argument checks shared by the attention kernels.

The kernels exponentiate with exp2 (one MUFU instruction) rather than exp: scores are scaled by
`scale * LOG2E` once, so exp(s * scale) == exp2(s * scale * LOG2E), and a log-sum-exp in base 2 converts back
to natural log by dividing by LOG2E.
"""
import math

from sift.format import TILES

LOG2E = math.log2(math.e)


def check_scale(scale) -> None:
    """The softmax scale every attention kernel takes: a positive finite number."""
    if not (isinstance(scale, (int, float)) and scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale={scale!r} must be a positive finite float (usually head_dim ** -0.5)")


def check_heads_and_blocks(hq: int, hkv: int, n: int, block: int) -> int:
    """GQA head counts and the block tiling of N key slots; -> the number of blocks NB."""
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if block not in TILES:
        raise ValueError(f"block={block} is unsupported; use one of {TILES}")
    if n % block:
        raise ValueError(f"N={n} key slots must be a whole number of blocks (block={block}); pad the layout")
    return n // block
