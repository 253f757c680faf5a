"""The decode step's fused element-wise kernels (runtime/llama_decode.py), on CPU in the Triton interpreter, and
their ref twins, against float64 computations written from the definitions:

    add_rms_norm (kernels/rmsnorm.py)   residual += x (rounded to the stream's dtype), then RMSNorm of it
    silu_mul (kernels/swiglu.py)        silu(gate) * up, gate and up the two halves of one row
    rotary_qk (kernels/rope.py)         x * cos + rotate_half(x) * sin on the q and k heads of a QKV row, in place;
                                        with append_to, also the rotated k and the v of row b into slot slots[b] of
                                        a layer's pool [slots, Hkv, D]

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


def rotary_definition(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int):
    """float64 q and k heads [B, Hq + Hkv, D] of x * cos + rotate_half(x) * sin, and the bound on a kernel's error:
    three roundings to qkv's dtype (both products and their sum), each of its rounded value's magnitude."""
    rows, d = qkv.shape[0], cos.shape[1]
    half = d // 2
    heads = qkv.double()[:, :(hq + hkv) * d].view(rows, hq + hkv, d)
    x1, x2 = heads[..., :half], heads[..., half:]
    c, s = cos.double()[:, None], sin.double()[:, None]
    t11, t12 = x1 * c[..., :half], x2 * s[..., :half]
    t21, t22 = x2 * c[..., half:], x1 * s[..., half:]
    want = torch.cat((t11 - t12, t21 + t22), dim=-1)
    bound = unit(qkv.dtype) * (torch.cat((t11.abs() + t12.abs(), t21.abs() + t22.abs()), -1) + want.abs()) * 1.01
    return want, bound + 1e-30


def rotary_inputs(rows: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
    """Random qkv [B, (Hq + 2 Hkv) * D] and a table as the model's rotary embedding makes it: cat(freqs, freqs) at
    each row's position, times a yarn-like attention scaling, cast to the activations' dtype."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(rows, (hq + 2 * hkv) * d, generator=gen) * 2).to(dtype)
    pos = torch.randint(0, 5000, (rows,), generator=gen).double()
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2).double() / d)
    angle = torch.cat([pos[:, None] * inv_freq] * 2, dim=-1)
    return qkv, (angle.cos() * 1.1).to(dtype), (angle.sin() * 1.1).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hq, hkv, d", [(1, 4, 2, 64), (3, 3, 1, 96), (2, 2, 2, 128)])
def test_rotary_qk_matches_definition(dtype, rows, hq, hkv, d):
    qkv, cos, sin = rotary_inputs(rows, hq, hkv, d, dtype, seed=rows * hq + d)
    want, bound = rotary_definition(qkv, cos, sin, hq, hkv)
    n_rot = (hq + hkv) * d
    for fn, where in ((rotary_qk, DEVICE), (rotary_qk_ref, "cpu")):
        buf = qkv.clone().to(where)
        q, k, v = fn(buf, cos.to(where), sin.to(where), hq, hkv)
        assert q.shape == (rows, hq, d) and k.shape == (rows, hkv, d) and v.shape == (rows, hkv, d)
        assert q.data_ptr() == buf.data_ptr(), "q must be a view of qkv, rotated in place"
        got = buf.cpu()
        assert torch.equal(got[:, n_rot:], qkv[:, n_rot:]), f"{fn.__name__}: v changed"
        assert torch.equal(torch.cat([q.reshape(rows, -1), k.reshape(rows, -1)], 1).cpu(), got[:, :n_rot])
        report_and_check(fn.__name__, got[:, :n_rot].view(rows, hq + hkv, d), want, bound)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hq, hkv, d", [(1, 4, 2, 64), (5, 6, 2, 128), (3, 2, 2, 96), (64, 2, 1, 64)])
def test_rotary_qk_appends_k_and_v_to_their_slots(dtype, rows, hq, hkv, d):
    """Scattered slots of layer 1 of a token-major pool [layers, slots, Hkv, D], the last two rows idle on one
    scratch slot as the runner sends them: each row's rotated k (the definition's) and its v (bit-exact) land
    in its slot; every other slot, and the other layers, keep their contents."""
    n_slots = 3 * rows + 40
    qkv, cos, sin = rotary_inputs(rows, hq, hkv, d, dtype, seed=7 * rows + hq + d)
    want, bound = rotary_definition(qkv, cos, sin, hq, hkv)
    gen = torch.Generator().manual_seed(rows)
    slots = torch.randperm(n_slots - 1, generator=gen)[:rows] + 1
    scratch = 0
    if rows > 2:
        slots[-2:] = scratch
    pool_k = torch.randn(3, n_slots, hkv, d, generator=gen).to(dtype)
    pool_v = torch.randn(3, n_slots, hkv, d, generator=gen).to(dtype)
    v_rows = qkv[:, (hq + hkv) * d:].view(rows, hkv, d)
    others = torch.ones(n_slots, dtype=torch.bool)
    others[slots] = False
    for fn, where in ((rotary_qk, DEVICE), (rotary_qk_ref, "cpu")):
        k_pool, v_pool = pool_k.clone().to(where), pool_v.clone().to(where)
        buf = qkv.clone().to(where)
        q, k, v = fn(buf, cos.to(where), sin.to(where), hq, hkv,
                     append_to=(k_pool[1], v_pool[1], slots.to(where)))
        k_pool, v_pool = k_pool.cpu(), v_pool.cpu()
        for layer in (0, 2):
            assert torch.equal(k_pool[layer], pool_k[layer]) and torch.equal(v_pool[layer], pool_v[layer])
        assert torch.equal(k_pool[1, others], pool_k[1, others]), f"{fn.__name__}: a k slot of no row changed"
        assert torch.equal(v_pool[1, others], pool_v[1, others]), f"{fn.__name__}: a v slot of no row changed"
        live = slice(0, rows - 2) if rows > 2 else slice(0, rows)
        live_slots = slots[live]
        assert torch.equal(v_pool[1, live_slots], v_rows[live]), f"{fn.__name__}: v rows not in their slots"
        assert torch.equal(k_pool[1, live_slots], k.cpu()[live]), f"{fn.__name__}: k slots are not the rotated k"
        report_and_check(f"{fn.__name__} k slots", k_pool[1, live_slots], want[live, hq:], bound[live, hq:])
        report_and_check(f"{fn.__name__} q", q.cpu(), want[:, :hq], bound[:, :hq])
        if rows > 2:
            # The idle rows share the scratch slot. Each element there is that element of one idle row; which
            # row wins may differ from element to element and between k and v, since on a GPU their programs
            # race (as index_copy_'s do) and a head's vector is written by several stores.
            idle = (rows - 2, rows - 1)
            for name, got, rows_of in (("k", k_pool[1, scratch], k.cpu()), ("v", v_pool[1, scratch], v_rows)):
                from_idle = (got == rows_of[idle[0]]) | (got == rows_of[idle[1]])
                assert from_idle.all(), f"{fn.__name__}: scratch {name} holds a value of no idle row"


def test_rotary_qk_refuses_a_mismatched_row():
    with pytest.raises(ValueError, match="q, k and v heads side by side"):
        rotary_qk(torch.zeros(2, 5 * 64, device=DEVICE), torch.ones(2, 64, device=DEVICE),
                  torch.zeros(2, 64, device=DEVICE), 2, 2)


def test_rotary_qk_refuses_a_pool_it_cannot_append_to():
    qkv, cos, sin = (torch.zeros(2, 8 * 64, device=DEVICE), torch.ones(2, 64, device=DEVICE),
                     torch.zeros(2, 64, device=DEVICE))
    pool = torch.zeros(10, 2, 64, device=DEVICE)
    slots = torch.tensor([3, 4], device=DEVICE)
    with pytest.raises(ValueError, match=r"\[slots, Hkv, D\] = \[slots, 2, 64\]"):
        rotary_qk(qkv, cos, sin, 4, 2, append_to=(pool.half(), pool.half(), slots))
    with pytest.raises(ValueError, match="int64"):
        rotary_qk(qkv, cos, sin, 4, 2, append_to=(pool, pool.clone(), slots.int()))
