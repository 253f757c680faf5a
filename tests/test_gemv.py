"""The few-row matrix product (kernels/gemv.py), on CPU in the Triton interpreter, and its ref twin, against
y = x @ W^T + b computed in float64 from the same inputs.

Tolerance, per element: the kernel sums K products in fp32 (each product of two fp16 values exact in fp32, each
of two fp32 values rounded once) plus the bias, in some order; the classic bound for such a sum is
(K + 1) * u32 * (sum_k |x_k w_k| + |b|), whatever the order (blocked and tensor-core orders are within it). The
result is then rounded once to the dtype: u(dtype) * |y|. Both terms scale with the inputs, not with one
machine's result; a dropped K chunk, a wrong mask or a wrong column errs by a sizeable fraction of |y|.
"""
from __future__ import annotations

import pytest
import torch

from sift.kernels.gemv import GemvConfig, gemv, gemv_ref

from .helpers import DEVICE

DTYPES = [torch.float32, torch.float16]
U32 = 2.0**-24
# Small blocks, so that N and K below span several blocks and end inside one; both ways to multiply a tile.
CONFIGS = [GemvConfig(block_n=32, block_k=64, num_warps=4, num_stages=2, dot=True),
           GemvConfig(block_n=16, block_k=32, num_warps=2, num_stages=1, dot=False)]


def inputs(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


def definition(x, w, b):
    """y = x @ W^T + b in float64, and the per-element scale of its terms sum_k |x_k w_k| + |b|."""
    y = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    if b is not None:
        y, mag = y + b.double(), mag + b.double().abs()
    return y, mag


def check(got: torch.Tensor, x, w, b) -> None:
    want, mag = definition(x, w, b)
    k = x.shape[1]
    bound = torch.finfo(x.dtype).eps / 2 * want.abs() + (k + 1) * U32 * mag + torch.finfo(x.dtype).tiny
    err = (got.double() - want).abs()
    print(f"max |diff| {err.max().item():.3e}, worst diff / bound {(err / bound).max().item():.3f}")
    assert got.dtype == x.dtype and got.shape == want.shape
    assert (err <= bound).all()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_matches_definition(dtype, m, bias, config):
    x, w, b = inputs(m, 100, 300, dtype, bias, seed=m + 10 * bias)      # N, K not multiples of the blocks
    xd, wd, bd = (None if t is None else t.to(DEVICE) for t in (x, w, b))
    check(gemv(xd, wd, bd, config).cpu(), x, w, b)
    check(gemv_ref(x, w, b), x, w, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_reads_strided_rows(dtype):
    """A weight whose rows are spaced wider than K (a column block of a larger matrix) and an x with a row
    stride: the kernel follows the strides."""
    x, w, b = inputs(3, 70, 200, dtype, True, seed=7)
    wide = torch.zeros(70, 260, dtype=dtype)
    wide[:, 30:230] = w
    xs = torch.zeros(3, 250, dtype=dtype)
    xs[:, 10:210] = x
    xd, wd, bd = xs.to(DEVICE)[:, 10:210], wide.to(DEVICE)[:, 30:230], b.to(DEVICE)
    check(gemv(xd, wd, bd, CONFIGS[0]).cpu(), x, w, b)


def test_gemv_refuses_what_it_cannot_compute():
    x, w = torch.zeros(2, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="x \\[M, K\\] and weight \\[N, K\\]"):
        gemv(x, torch.zeros(4, 9, device=DEVICE))
    with pytest.raises(ValueError, match="1 to 16 rows"):
        gemv(torch.zeros(17, 8, device=DEVICE), w)
    with pytest.raises(ValueError, match="one dtype"):
        gemv(x, w.half())
    with pytest.raises(ValueError, match="bias must be"):
        gemv(x, w, torch.zeros(5, device=DEVICE))
    with pytest.raises(ValueError, match="contiguously"):
        gemv(x, torch.zeros(8, 4, device=DEVICE).t())
