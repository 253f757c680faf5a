"""RoPE for every kernel (SPEC section 5): the parameters from a transformers config, the angle arithmetic the
Triton kernels share, the key pass and the cos / sin table, the decode step's q / k rotation with the model's own
table (`rotary_qk`), and their ref twins.

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
import triton
import triton.language as tl
from triton.language.extra import libdevice

from sift.format import ModelGeometry

from .device import triton_runs_on
from .layout import gather_blocks

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
    head_dim = ModelGeometry.from_config(config).head_dim
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


# ---- angles in the kernels --------------------------------------------------------------------------------
# Every kernel forms an angle the same way: turns = inv_freq / 2 pi in fp64, position * turns in fp64, reduced to
# one period [-1/2, 1/2) before the cast to fp32. That keeps angles exact at offsets of 200K and beyond (an fp32
# angle of 1.5e5 rad is good to ~0.01 rad), with a single fp32 sin / cos per element.


@triton.jit
def _cos_sin_of_turns(t, FAST_TRIG: tl.constexpr):
    """cos, sin fp32 of the angles t (fp64, in turns), reduced to [-1/2, 1/2) before fp32."""
    t = t - tl.floor(t + 0.5)
    angle = t.to(tl.float32) * 6.283185307179586
    # |angle| <= pi here, where the MUFU approximations are good to ~5e-7; accurate libdevice sin / cos cost
    # thousands of cycles per tile.
    if FAST_TRIG:
        cos = libdevice.fast_cosf(angle)
        sin = libdevice.fast_sinf(angle)
    else:  # the interpreter has no MUFU functions
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    return cos, sin


@triton.jit
def _cos_sin(position, InvFreq, offs, FAST_TRIG: tl.constexpr):
    """cos, sin fp32 of position * inv_freq[offs] (offs: any shape of indices into [D/2]). The fp64 turns are made
    here from inv_freq, so a launch needs no host-side cast or division."""
    turns = tl.load(InvFreq + offs).to(tl.float64) / 6.283185307179586
    return _cos_sin_of_turns(position.to(tl.float64) * turns, FAST_TRIG)


@triton.jit
def _rotate(x1, x2, cos, sin):
    """rotate_half RoPE of the halves x1, x2 [rows, D/2] by the angles (cos, sin) [D/2], in fp32."""
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    y1 = (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype)
    y2 = (x2f * cos[None, :] + x1f * sin[None, :]).to(x1.dtype)
    return y1, y2


@triton.jit
def _store_cos_sin(CosSin, b, offs_h, cos, sin, HALF: tl.constexpr):
    """Row b of the table CosSin [NB, 2 * HALF] fp32: cos | sin."""
    tl.store(CosSin + b * 2 * HALF + offs_h, cos)
    tl.store(CosSin + b * 2 * HALF + HALF + offs_h, sin)


@triton.jit
def _rotate_blocks_kernel(K, Out, BlockOffset, InvFreq, CosSin, Pages, stride_kh, stride_kn, stride_kd, stride_oh,
                          stride_on, stride_od, BLOCK: tl.constexpr, HALF: tl.constexpr, FAST_TRIG: tl.constexpr,
                          WRITE_CS: tl.constexpr, PAGED: tl.constexpr):
    """Rows of block b of head h rotated by block_offset[b] (local -> logical positions). PAGED: block b is read
    from page Pages[b] of K (a pool of pages) and written to block b of Out. WRITE_CS: the head-0 programs also
    store the angles they used, row b of the table CosSin [NB, 2 * HALF] fp32 (cos | sin)."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    rows = (b * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    if PAGED:
        src_rows = (tl.load(Pages + b).to(tl.int64) * BLOCK + tl.arange(0, BLOCK))
    else:
        src_rows = rows
    offs_h = tl.arange(0, HALF)
    src = K + h.to(tl.int64) * stride_kh + src_rows[:, None] * stride_kn
    dst = Out + h.to(tl.int64) * stride_oh + rows[:, None] * stride_on
    x1 = tl.load(src + offs_h[None, :] * stride_kd)
    x2 = tl.load(src + (offs_h + HALF)[None, :] * stride_kd)
    cos, sin = _cos_sin(tl.load(BlockOffset + b), InvFreq, offs_h, FAST_TRIG)
    y1, y2 = _rotate(x1, x2, cos, sin)
    tl.store(dst + offs_h[None, :] * stride_od, y1)
    tl.store(dst + (offs_h + HALF)[None, :] * stride_od, y2)
    if WRITE_CS:
        if h == 0:
            _store_cos_sin(CosSin, b, offs_h, cos, sin, HALF)


@triton.jit
def _cos_sin_kernel(BlockOffset, InvFreq, CosSin, HALF: tl.constexpr, FAST_TRIG: tl.constexpr):
    """Row b of the table CosSin [NB, 2 * HALF] fp32: cos | sin of block_offset[b] * inv_freq (as the pass)."""
    b = tl.program_id(0)
    offs_h = tl.arange(0, HALF)
    cos, sin = _cos_sin(tl.load(BlockOffset + b), InvFreq, offs_h, FAST_TRIG)
    _store_cos_sin(CosSin, b, offs_h, cos, sin, HALF)


def rotate_key_blocks(k: torch.Tensor, block_offset: torch.Tensor, inv_freq: torch.Tensor, *, block: int,
                      out: torch.Tensor | None = None, cos_sin: torch.Tensor | None = None,
                      pages: torch.Tensor | None = None) -> torch.Tensor:
    """The key pass: k [Hkv, NB * block, D] at segment-local positions -> the same keys at logical positions
    (every row of block b rotated by block_offset[b], int32 [NB]), in `out` (any strides) or a new contiguous
    tensor. inv_freq: [D/2] float. cos_sin: optional fp32 [NB, D] that receives each block's angles (cos | sin,
    the `cos_sin_table`), written by the same launch. pages: optional int32 [NB]: k is a pool of pages
    [Hkv, P * block, D] and block b is its page pages[b] (the KV store's pool, gathered into logical order by
    the same pass that rotates it). Runs on CUDA or in the Triton interpreter.

    The attention kernels take keys from this pass rather than rotating them per (query tile, key block): that
    rotation costs a share of what the tensor cores need for the block's two products, once per (tile, block),
    where the pass rotates each key block once per layer and costs about one copy of K."""
    hkv, n, d = k.shape
    nb = n // block if pages is None else pages.numel()
    if n % block or block_offset.shape != (nb,) or inv_freq.shape != (d // 2,) or (
            pages is not None and pages.dtype != torch.int32):
        raise ValueError(f"k {tuple(k.shape)}, block_offset {tuple(block_offset.shape)}, inv_freq "
                         f"{tuple(inv_freq.shape)}, pages {None if pages is None else tuple(pages.shape)} do not "
                         f"fit block={block}")
    if out is None:
        out = torch.empty((hkv, nb * block, d), dtype=k.dtype, device=k.device)
    _rotate_blocks_kernel[(hkv, nb)](
        k, out, block_offset, inv_freq.to(k.device), out if cos_sin is None else cos_sin,
        block_offset if pages is None else pages, *k.stride(), *out.stride(), BLOCK=block, HALF=d // 2,
        FAST_TRIG=k.device.type == "cuda", WRITE_CS=cos_sin is not None, PAGED=pages is not None, num_warps=4)
    return out


def rotate_key_blocks_ref(k: torch.Tensor, block_offset: torch.Tensor, inv_freq: torch.Tensor, *, block: int,
                          out: torch.Tensor | None = None, cos_sin: torch.Tensor | None = None,
                          pages: torch.Tensor | None = None) -> torch.Tensor:
    """The ref twin of `rotate_key_blocks` (same signature and result up to rounding; fp64 angles)."""
    if pages is not None:
        k = gather_blocks(k, pages, block)
    positions = block_offset.long().repeat_interleave(block)
    result = apply_rope_ref(k, positions, inv_freq)
    if cos_sin is not None:
        cos_sin.copy_(cos_sin_table_ref(block_offset, inv_freq))
    if out is None:
        return result
    out.copy_(result)
    return out


def cos_sin_table(block_offset: torch.Tensor, inv_freq: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [NB, D]: row b = cos | sin of block_offset[b] * inv_freq ([D/2] float on block_offset's device),
    angles as the kernels form them, in `out` if given. What the Gluon kernel rotates each query tile with."""
    half = inv_freq.numel()
    if out is None:
        out = torch.empty((block_offset.numel(), 2 * half), dtype=torch.float32, device=block_offset.device)
    _cos_sin_kernel[(block_offset.numel(),)](block_offset, inv_freq, out, HALF=half,
                                             FAST_TRIG=block_offset.device.type == "cuda", num_warps=1)
    return out


def cos_sin_table_ref(block_offset: torch.Tensor, inv_freq: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The ref twin of `cos_sin_table` (fp64 angles, rounded to fp32)."""
    cos, sin = rope_cos_sin(block_offset.long(), inv_freq)
    table = torch.cat([cos, sin], dim=1).float()
    if out is None:
        return table
    out.copy_(table)
    return out


# ---- the model's rotation of a decode step's q and k ------------------------------------------------------
# The decode step (runtime/llama_decode.py) rotates q and k with the model's own cos / sin table (its rotary
# embedding at each row's segment-local position: any scaling the model applies is already in it), in place in
# the fused QKV projection's output, in one kernel for every head of both. transformers' apply_rotary_pos_emb
# rounds three times in the activations' dtype (x * cos, rotate_half(x) * sin, their sum); so does the kernel.
# The same launch can append the step's KV to the cache: the rotated k and the v of each row written to the row's
# slot of a layer's token-major pool [slots, Hkv, D] (runtime/kv_cache.py PoolKV), which spares the step two
# copy kernels per layer.


@triton.jit
def _rotary_qk_kernel(QKV, Cos, Sin, Slots, KCache, VCache, stride_qkv, stride_cs, stride_cn, stride_ch,
                      N_Q: tl.constexpr, N_KV: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
                      APPEND: tl.constexpr):
    """Program (row, head): heads [0, N_Q) are q, [N_Q, N_Q + N_KV) k, both rotated in place; APPEND: the k heads
    also store their rotated values, and heads [N_Q + N_KV, N_Q + 2 N_KV) (v) their values, at the row's slot
    Slots[row] of KCache / VCache."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    x_ptr = QKV + row * stride_qkv + head * 2 * HALF
    if APPEND:
        slot = tl.load(Slots + row)   # int64: slot * stride_cn may pass 2^31
    if head < N_Q + N_KV:
        x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        c1 = tl.load(Cos + row * stride_cs + offs, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(Cos + row * stride_cs + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(Sin + row * stride_cs + offs, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(Sin + row * stride_cs + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        dt = QKV.dtype.element_ty
        o1 = ((x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
        tl.store(x_ptr + offs, o1, mask=mask)
        tl.store(x_ptr + HALF + offs, o2, mask=mask)
        if APPEND:
            if head >= N_Q:
                k_ptr = KCache + slot * stride_cn + (head - N_Q) * stride_ch
                tl.store(k_ptr + offs, o1, mask=mask)
                tl.store(k_ptr + HALF + offs, o2, mask=mask)
    else:
        if APPEND:   # a v head, launched only to append
            v_ptr = VCache + slot * stride_cn + (head - N_Q - N_KV) * stride_ch
            tl.store(v_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
            tl.store(v_ptr + HALF + offs, tl.load(x_ptr + HALF + offs, mask=mask), mask=mask)


def _qkv_views(qkv: torch.Tensor, n_q_heads: int, n_kv_heads: int, head_dim: int):
    b = qkv.shape[0]
    q_end, k_end = n_q_heads * head_dim, (n_q_heads + n_kv_heads) * head_dim
    return (qkv[:, :q_end].view(b, n_q_heads, head_dim), qkv[:, q_end:k_end].view(b, n_kv_heads, head_dim),
            qkv[:, k_end:].view(b, n_kv_heads, head_dim))


def _check_qkv(qkv, cos, sin, n_q_heads: int, n_kv_heads: int, append_to) -> int:
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != qkv.shape[0] or cos.shape[1] % 2:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be [B, D] with even D, "
                         f"B = qkv's rows ({qkv.shape[0]})")
    head_dim = cos.shape[1]
    if qkv.dim() != 2 or qkv.shape[1] != (n_q_heads + 2 * n_kv_heads) * head_dim or qkv.stride(-1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} must be [B, (Hq + 2 Hkv) * D] = [B, {(n_q_heads + 2 * n_kv_heads)}"
                         f" * {head_dim}] with unit column stride: q, k and v heads side by side, rotated in place")
    if append_to is not None:
        k_cache, v_cache, slots = append_to
        if (k_cache.dim() != 3 or k_cache.shape[1:] != (n_kv_heads, head_dim) or k_cache.shape != v_cache.shape
                or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1
                or {k_cache.dtype, v_cache.dtype} != {qkv.dtype}):
            raise ValueError(f"append_to's k {tuple(k_cache.shape)} {k_cache.dtype} and v {tuple(v_cache.shape)} "
                             f"{v_cache.dtype} must both be [slots, Hkv, D] = [slots, {n_kv_heads}, {head_dim}] of "
                             f"qkv's dtype {qkv.dtype}, with the same strides and unit last stride (a layer's pool)")
        if {k_cache.device, v_cache.device, slots.device} != {qkv.device}:
            raise ValueError(f"append_to's k, v and slots ({k_cache.device}, {v_cache.device}, {slots.device}) "
                             f"must be on qkv's device {qkv.device}")
        if slots.shape != (qkv.shape[0],) or slots.dtype != torch.int64:
            raise ValueError(f"append_to's slots ({tuple(slots.shape)} {slots.dtype}) must be int64 [B], "
                             f"B = qkv's rows ({qkv.shape[0]}): one pool slot per row")
    return head_dim


def rotary_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q_heads: int, n_kv_heads: int, *,
              append_to: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """qkv [B, (Hq + 2 Hkv) * D]: a row's q heads, k heads and v heads side by side; cos, sin [B, D]: the model's
    rotary table at each row's position -> (q [B, Hq, D], k [B, Hkv, D], v [B, Hkv, D]), views of qkv whose q and
    k heads are rotated in place: x * cos + rotate_half(x) * sin.

    append_to: optional (k_cache, v_cache [slots, Hkv, D] of qkv's dtype, slots int64 [B]): the same launch
    writes row b's rotated k and its v to slot slots[b] of the caches (`k_cache[slots] = k`, what
    `rotary_qk_ref` does with index_copy_). Rows that share a slot (the runner sends every idle row to one
    scratch slot) leave one of them there. Reads no data on the host: a CUDA graph captures it."""
    head_dim = _check_qkv(qkv, cos, sin, n_q_heads, n_kv_heads, append_to)
    if not triton_runs_on(qkv.device):
        raise ValueError(f"rotary_qk runs on CUDA tensors (got {qkv.device}); use rotary_qk_ref on CPU")
    cos, sin = cos.contiguous(), sin.contiguous()
    half = head_dim // 2
    append = append_to is not None
    k_cache, v_cache, slots = append_to if append else (qkv, qkv, qkv)   # without append_to: never read
    heads = n_q_heads + n_kv_heads * (2 if append else 1)
    _rotary_qk_kernel[(qkv.shape[0], heads)](qkv, cos, sin, slots, k_cache, v_cache, qkv.stride(0), cos.stride(0),
                                             k_cache.stride(0), k_cache.stride(1), N_Q=n_q_heads, N_KV=n_kv_heads,
                                             HALF=half, BLOCK=triton.next_power_of_2(half), APPEND=append,
                                             num_warps=1)
    return _qkv_views(qkv, n_q_heads, n_kv_heads, head_dim)


def rotary_qk_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q_heads: int, n_kv_heads: int, *,
                  append_to: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """The twin of `rotary_qk`, in torch: transformers' `x * cos + rotate_half(x) * sin` on the q and k heads,
    then (append_to) index_copy_ of k and v into the caches' slots, as PoolKV.append does."""
    head_dim = _check_qkv(qkv, cos, sin, n_q_heads, n_kv_heads, append_to)
    q, k, v = _qkv_views(qkv, n_q_heads, n_kv_heads, head_dim)
    half = head_dim // 2
    for x in (q, k):
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * cos[:, None] + rotated * sin[:, None])
    if append_to is not None:
        k_cache, v_cache, slots = append_to
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)
    return q, k, v
