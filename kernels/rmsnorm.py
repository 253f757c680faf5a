"""RMSNorm in one kernel, for the decode step (runtime/runner.py), and its ref twin; and the residual add
before it in the same kernel (`add_rms_norm`, runtime/llama_decode.py).

transformers' RMSNorm (Llama, Mistral, Qwen2, ...) is eight separate element-wise kernels in an eager forward:
up-cast, square, mean, add eps, rsqrt, multiply, down-cast, multiply by the weight. A decode step at batch 1 runs
two norms per layer on one 4096-wide row each, so each of those kernels moves a few kilobytes and costs its launch:
about 0.6 ms of an 8B-shaped step of ~7-8 ms. One kernel per norm computes the same thing:

    y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)          (the product in the promoted dtype)

in fp32 like transformers' forward, rounding at the same two places (the normalised row to x's dtype, the product
to the output's dtype); only the order of the fp32 sum of squares differs.

Between two norms a decoder layer adds its branch to the residual stream (`residual + hidden_states`, rounded to
the stream's dtype): `add_rms_norm` does that add and the next norm in one pass over the row, writing the new
residual in place, so the sum never makes a round trip through memory between two kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import triton_runs_on


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, x_stride, out_stride, eps,
                     X_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / n_cols
    normed = (x * tl.math.rsqrt(variance + eps)).to(X_DTYPE).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = w * normed
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, x_stride, res_stride, out_stride, eps,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
    h = (x + r).to(res_ptr.dtype.element_ty)              # the residual stream, rounded as torch's add rounds it
    tl.store(res_ptr + row * res_stride + cols, h, mask=mask)
    hf = h.to(tl.float32)
    variance = tl.sum(hf * hf, axis=0) / n_cols
    normed = (hf * tl.math.rsqrt(variance + eps)).to(res_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _check(name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight {tuple(weight.shape)} must be ({n},): one scale per column of x")
    if x.dtype not in _TL or weight.dtype not in _TL:
        raise ValueError(f"{name} takes float32 / float16 / bfloat16 (got x {x.dtype}, weight {weight.dtype})")
    if not triton_runs_on(x.device):
        raise ValueError(f"{name} runs on CUDA tensors (got {x.device}); use {name}_ref on CPU")


def _warps(block: int) -> int:
    return min(16, max(1, block // 512))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> [..., N] in promote_types(weight, x): transformers' RMSNorm in one kernel."""
    _check("rms_norm", x, weight)
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, n, rows.stride(0), out.stride(0), float(eps),
                                       X_DTYPE=_TL[x.dtype], BLOCK=block, num_warps=_warps(block))
    return out.reshape(x.shape)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The twin of `rms_norm`, in torch: the same roundings (fp32 statistics, x's dtype, the promoted dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [B, N] (one dtype; residual with unit column stride), weight [N] -> (rms_norm(residual + x),
    residual): the sum, rounded to residual's dtype, is written into `residual` in place (a decoder layer's
    `residual + branch` followed by the next RMSNorm); the normed rows are new, in promote_types(weight, x)."""
    _check("add_rms_norm", x, weight)
    if x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must be x's [B, N] shape and dtype "
                         f"({tuple(x.shape)}, {x.dtype}) with unit column stride: it is updated in place")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    n, block = x.shape[1], triton.next_power_of_2(x.shape[1])
    _add_rms_norm_kernel[(x.shape[0],)](x, residual, weight, out, n, x.stride(0), residual.stride(0), out.stride(0),
                                        float(eps), BLOCK=block, num_warps=_warps(block))
    return out, residual


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of `add_rms_norm`, in torch: residual += x in place (in residual's dtype), then `rms_norm_ref`."""
    residual.add_(x)
    return rms_norm_ref(residual, weight, eps), residual
