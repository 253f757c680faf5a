"""RoPE parameters from a transformers config, and the torch reference rotation (SPEC section 5).

The attention kernel applies a *relative* rotation by `delta = block_offset[kb] - block_offset[qb]` to each key
tile; that is exact only when the rotation angle is linear in position, `angle = position * inv_freq`. The RoPE
types with that property (default, linear, llama3, yarn) are accepted; anything else (dynamic NTK, longrope,
...) changes the frequencies with the sequence length and is refused.

Convention: "rotate_half" (Llama / Qwen / Mistral in transformers): the pair of dims (i, i + D/2) is rotated
by `angle_i`, i.e. `x1' = x1 cos - x2 sin`, `x2' = x2 cos + x1 sin`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeSpec:
    """inv_freq: fp32 [D/2] (CPU). attention_scaling: the factor the model multiplies cos and sin by (yarn's
    mscale, 1.0 otherwise); the kernel's relative rotation must not apply it again, since stored q and k were
    already rotated (and scaled) by the model."""

    inv_freq: torch.Tensor
    attention_scaling: float


def _rope_parameters(config) -> dict:
    if hasattr(config, "standardize_rope_params"):
        config.standardize_rope_params()
    params = getattr(config, "rope_parameters", None)
    if params is None:  # configs of older transformers versions
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    layer_types = getattr(config, "layer_types", None) or ()
    if layer_types and set(params) & set(layer_types):
        raise ValueError(
            f"per-layer RoPE parameters ({sorted(set(params) & set(layer_types))}) are unsupported: "
            "the position-free KV cache needs one RoPE for all layers"
        )
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(config) -> RopeSpec:
    """RoPE of a transformers config -> RopeSpec(inv_freq fp32 [D/2], attention_scaling).

    Uses transformers' own ROPE_INIT_FUNCTIONS for linear / llama3 / yarn, and the original formula for default.
    Raises ValueError for RoPE types whose angle is not linear in position, and for partial rotary embeddings.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = _rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type={rope_type!r} is unsupported: position-free KV needs a rotation angle linear in "
            f"position; supported rope types are {SUPPORTED_ROPE_TYPES}"
        )
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is unsupported: the kernel rotates the whole head_dim")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        attention_scaling = 1.0
    else:
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    inv_freq = inv_freq.to(device="cpu", dtype=torch.float32).contiguous()
    if inv_freq.shape != (head_dim // 2,):
        raise ValueError(f"inv_freq has shape {tuple(inv_freq.shape)}, expected [{head_dim // 2}] for head_dim={head_dim}")
    return RopeSpec(inv_freq=inv_freq, attention_scaling=float(attention_scaling))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: int [N]; inv_freq: [D/2] -> cos, sin float64 [N, D/2].

    Angles are formed in float64 from the fp32 inv_freq, so this stays exact at positions beyond 200K (an fp32
    angle of 1.5e5 rad is only good to ~0.01 rad)."""
    angle = positions.to(torch.float64)[:, None] * inv_freq.to(device=positions.device, dtype=torch.float64)[None, :]
    return angle.cos(), angle.sin()


def apply_rope_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *, attention_scaling: float = 1.0) -> torch.Tensor:
    """x: [H, N, D]; positions: int [N]; inv_freq: [D/2] -> x rotated at `positions`, [H, N, D] in x's dtype.

    rotate_half convention: out = x * cos + rotate_half(x) * sin, cos/sin scaled by attention_scaling."""
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"x must be [H, N, D] with even D; got {tuple(x.shape)}")
    if positions.shape != (x.shape[1],):
        raise ValueError(f"positions must be [N]={x.shape[1]}; got {tuple(positions.shape)}")
    if inv_freq.shape != (x.shape[-1] // 2,):
        raise ValueError(f"inv_freq must be [D/2]={x.shape[-1] // 2}; got {tuple(inv_freq.shape)}")
    cos, sin = rope_cos_sin(positions, inv_freq)
    cos, sin = cos * attention_scaling, sin * attention_scaling
    half = x.shape[-1] // 2
    x64 = x.to(torch.float64)
    x1, x2 = x64[..., :half], x64[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
