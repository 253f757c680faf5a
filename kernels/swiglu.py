"""SiLU(gate) * up in one kernel, for the decode step (runtime/llama_decode.py), and its ref twin.

A Llama-style MLP computes `down(act_fn(gate(x)) * up(x))`. With the gate and up projections fused into one
matrix product (their weights stacked, gate first), the product's row is [gate | up], and what lies between it
and the down projection is two element-wise kernels in an eager forward (the SiLU, the multiply) that write and
read the intermediate activation once more each. One kernel computes

    y = silu(gate).to(dtype) * up        silu(g) = g / (1 + exp(-g)), in fp32

rounding where transformers' forward rounds: the SiLU's output to the activations' dtype, then the product.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import triton_runs_on

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, gu_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * gu_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [B, 2I] (gate in the first I columns, up in the last I) -> silu(gate) * up [B, I], same dtype."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} must be [B, 2I]: the gate's I columns, then the up's")
    if gate_up.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"silu_mul takes float32 / float16 / bfloat16 (got {gate_up.dtype})")
    if not triton_runs_on(gate_up.device):
        raise ValueError(f"silu_mul runs on CUDA tensors (got {gate_up.device}); use silu_mul_ref on CPU")
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(BLOCK, triton.next_power_of_2(inter))
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                        BLOCK=block, num_warps=4)
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """The twin of `silu_mul`, in torch: the MLP's own `act_fn(gate) * up` on the two halves."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
