"""The decode step's fused element-wise kernels (runtime/llama_decode.py), on CPU in the Triton interpreter, and
their ref twins, against float64 computations written from the definitions:

    add_rms_norm (kernels/rmsnorm.py)   residual += x (rounded to the stream's dtype), then RMSNorm of it
    silu_mul (kernels/swiglu.py)        silu(gate) * up, gate and up the two halves of one row
    rotary_qk (kernels/rope.py)         x * cos + rotate_half(x) * sin on the q and k heads of a QKV row, in place

Tolerances count the roundings to the tested dtype that the kernel makes and the float64 definition does not
(each at most half a unit of that dtype, of the rounded value's magnitude), plus the fp32 arithmetic inside.
"""
from __future__ import annotations

import pytest
import torch

from sift.kernels.rmsnorm import add_rms_norm, add_rms_norm_ref
from sift.kernels.rope import rotary_qk, rotary_qk_ref
from sift.kernels.swiglu import silu_mul, silu_mul_ref

from .helpers import DEVICE
from .test_rmsnorm import definition as rms_definition

DTYPES = [torch.float32, torch.float16]
EPS32 = torch.finfo(torch.float32).eps


def unit(dtype: torch.dtype) -> float:
    """Half a unit in the last place, relative: the largest relative error of one rounding to `dtype`."""
    return torch.finfo(dtype).eps / 2


def report_and_check(name: str, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    err = (got.double() - want).abs()
    print(f"{name}: max |diff| {err.max().item():.3e}, worst diff / bound {(err / bound).max().item():.3f}")
    assert (err <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n", [(1, 576), (3, 100), (2, 1024)])
def test_add_rms_norm_matches_definition(dtype, rows, n):
    gen = torch.Generator().manual_seed(n + rows)
    x = (torch.randn(rows, n, generator=gen) * 2).to(dtype)
    residual = (torch.randn(rows, n, generator=gen) * 3).to(dtype)
    w = (1 + torch.randn(n, generator=gen) / 4).to(dtype)
    # The new residual is the sum rounded once to the stream's dtype: what torch's `residual + x` stores.
    new_residual = (x.double() + residual.double()).to(dtype)
    want = rms_definition(new_residual, w, 1e-5)
    # the normalised row rounded to dtype, the product rounded to dtype, and the fp32 sum of squares over n
    bound = (2 * unit(dtype) + n * 2.0**-24) * want.abs() * 1.01 + 1e-30
    for fn, where in ((add_rms_norm, DEVICE), (add_rms_norm_ref, "cpu")):
        res = residual.clone().to(where)
        normed, returned = fn(x.to(where), res, w.to(where), 1e-5)
        assert returned is res and normed.dtype == dtype and normed.shape == (rows, n)
        assert torch.equal(res.cpu(), new_residual), f"{fn.__name__}: the residual is not x + residual"
        report_and_check(fn.__name__, normed.cpu(), want, bound)


def test_add_rms_norm_refuses_a_residual_it_cannot_update():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="updated in place"):
        add_rms_norm(x, torch.zeros(2, 8, device=DEVICE, dtype=torch.float16), torch.ones(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="updated in place"):
        add_rms_norm(x, torch.zeros(8, 2, device=DEVICE).t(), torch.ones(8, device=DEVICE), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(1, 100), (3, 1500), (2, 64)])
def test_silu_mul_matches_definition(dtype, rows, inter):
    gen = torch.Generator().manual_seed(inter + rows)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 3).to(dtype)
    g, u = gate_up.double().chunk(2, dim=-1)
    want = g / (1 + torch.exp(-g)) * u
    # silu(g) rounded to dtype, the product rounded to dtype, fp32 exp and division (a few fp32 units); the
    # absolute term covers results below dtype's normal range, where a rounding is a fixed step, not relative.
    bound = (2 * unit(dtype) + 8 * EPS32) * want.abs() * 1.01 + torch.finfo(dtype).tiny
    for fn, where in ((silu_mul, DEVICE), (silu_mul_ref, "cpu")):
        got = fn(gate_up.to(where)).cpu()
        assert got.dtype == dtype and got.shape == (rows, inter)
        report_and_check(fn.__name__, got, want, bound)


def test_silu_mul_refuses_an_odd_width():
    with pytest.raises(ValueError, match=r"\[B, 2I\]"):
        silu_mul(torch.zeros(2, 7, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hq, hkv, d", [(1, 4, 2, 64), (3, 3, 1, 96), (2, 2, 2, 128)])
def test_rotary_qk_matches_definition(dtype, rows, hq, hkv, d):
    gen = torch.Generator().manual_seed(rows * hq + d)
    qkv = (torch.randn(rows, (hq + 2 * hkv) * d, generator=gen) * 2).to(dtype)
    # A table as the model's rotary embedding makes it: cat(freqs, freqs) at each row's position, times a yarn-like
    # attention scaling, cast to the activations' dtype.
    pos = torch.randint(0, 5000, (rows,), generator=gen).double()
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2).double() / d)
    angle = torch.cat([pos[:, None] * inv_freq] * 2, dim=-1)
    cos, sin = (angle.cos() * 1.1).to(dtype), (angle.sin() * 1.1).to(dtype)
    half = d // 2
    x = qkv.double()
    n_rot = (hq + hkv) * d
    heads = x[:, :n_rot].view(rows, hq + hkv, d)
    x1, x2 = heads[..., :half], heads[..., half:]
    c, s = cos.double()[:, None], sin.double()[:, None]
    t11, t12 = x1 * c[..., :half], x2 * s[..., :half]
    t21, t22 = x2 * c[..., half:], x1 * s[..., half:]
    want = torch.cat((t11 - t12, t21 + t22), dim=-1)
    # three roundings to dtype: both products and their sum
    bound = unit(dtype) * (torch.cat((t11.abs() + t12.abs(), t21.abs() + t22.abs()), -1) + want.abs()) * 1.01 + 1e-30
    for fn, where in ((rotary_qk, DEVICE), (rotary_qk_ref, "cpu")):
        buf = qkv.clone().to(where)
        q, k, v = fn(buf, cos.to(where), sin.to(where), hq, hkv)
        assert q.shape == (rows, hq, d) and k.shape == (rows, hkv, d) and v.shape == (rows, hkv, d)
        assert q.data_ptr() == buf.data_ptr(), "q must be a view of qkv, rotated in place"
        got = buf.cpu()
        assert torch.equal(got[:, n_rot:], qkv[:, n_rot:]), f"{fn.__name__}: v changed"
        assert torch.equal(torch.cat([q.reshape(rows, -1), k.reshape(rows, -1)], 1).cpu(), got[:, :n_rot])
        report_and_check(fn.__name__, got[:, :n_rot].view(rows, hq + hkv, d), want, bound)


def test_rotary_qk_refuses_a_mismatched_row():
    with pytest.raises(ValueError, match="q, k and v heads side by side"):
        rotary_qk(torch.zeros(2, 5 * 64, device=DEVICE), torch.ones(2, 64, device=DEVICE),
                  torch.zeros(2, 64, device=DEVICE), 2, 2)
