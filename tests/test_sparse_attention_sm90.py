"""The Gluon Hopper kernel (kernels/sparse_attention_sm90.py) without a GPU.

Gluon does not run in the Triton interpreter, so CI checks what can be checked here: the kernel compiles for
sm_90 (Triton's bundled ptxas) within the SM's shared memory and with the Hopper machinery it is built on; the
TMA views of q / k / v; that `sparse_attention` hands every call it cannot take to the tl kernel (whose results CI
compares with the ref twin). Its numbers are checked on the H200 against `sparse_attention_ref` by
bench/check_sm90.py and bench/bench_attention.py (padded and token-order layouts, NaN in padding, offsets past
65,535, empty rows, GQA 4, every output row of 32 heads x 16K-64K tokens).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from sift.kernels import sparse_attention as sa
from sift.kernels import sparse_attention_sm90 as sm90

from .helpers import assert_within, kernel_tol

SMEM_LIMIT = 227 * 1024  # bytes of shared memory one CTA may use on sm_90


_COMPILE = """
import json, sys, torch
from sift.kernels import sparse_attention_sm90 as sm90
rope, q_tokens, q_rows, q_blocks, paged, dtype = json.loads(sys.argv[1])
kernel = sm90.compile_for_sm90(rope=rope, q_tokens=q_tokens, q_rows=q_rows, q_blocks=q_blocks,
                               k_rows=not paged, k_paged=paged and not rope, v_paged=paged,
                               dtype=getattr(torch, dtype))
ptx = kernel.asm["ptx"]
print(json.dumps(dict(shared=kernel.metadata.shared, cubin=len(kernel.asm["cubin"]),
                      has={s: s in ptx for s in ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg",
                                                 "atom.global")})))
"""


@pytest.mark.parametrize("rope, q_tokens, q_rows, q_blocks, paged, dtype", [
    (True, True, False, False, False, "bfloat16"),   # the engine's call: q / out in token order, heads along columns
    (False, False, True, False, False, "float16"),   # padded layout, pre-rotated keys
    (True, True, False, True, True, "bfloat16"),     # a reuse prefill: the listed query blocks (prefix, query)
                                                     # over V read in place from the store's token-major pages
])
def test_compiles_for_sm90(rope, q_tokens, q_rows, q_blocks, paged, dtype):
    # A fresh interpreter without TRITON_INTERPRET (set for the whole suite), which would wrap the Gluon functions.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = json.dumps([rope, q_tokens, q_rows, q_blocks, paged, dtype])
    r = subprocess.run([sys.executable, "-c", _COMPILE, args], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert 0 < info["shared"] <= SMEM_LIMIT
    assert info["cubin"] > 0
    # Tensor cores through warpgroup MMA, TMA loads, the warp-specialised register split, the dynamic tile counter.
    assert all(info["has"].values()), info["has"]


def test_head_view_layouts():
    h, n, d = 4, 256, 128
    rows = torch.randn(h, n, d)
    view, heads_along_rows, pitch = sm90._head_view(rows)
    assert heads_along_rows and pitch == n and view.shape == (h * n, d)
    assert torch.equal(view[2 * n + 5], rows[2, 5])
    cache = torch.randn(h, n + 64, d)                   # the first n slots of a cache with room for generation
    view, heads_along_rows, pitch = sm90._head_view(cache[:, :n])
    assert heads_along_rows and pitch == n + 64 and view.shape == (3 * (n + 64) + n, d)
    assert torch.equal(view[2 * pitch + 5], cache[2, 5]) and torch.equal(view[-1], cache[-1, n - 1])
    tok = torch.randn(n, h, d)                          # the model's projection, seen as [H, N, D]
    view, heads_along_rows, _ = sm90._head_view(tok.transpose(0, 1))
    assert not heads_along_rows and view.shape == (n, h * d)
    assert torch.equal(view[7, 3 * d:4 * d], tok[7, 3])
    assert sm90._head_view(torch.randn(h, n, 2 * d)[:, :, :d]) is None       # row stride != D
    assert sm90._head_view(torch.randn(h, d, n).transpose(1, 2)) is None      # last stride != 1


def test_rotated_keys_buffer_laid_out_as_v():
    """With kv_pages the key pass writes K's blocks in logical order into a buffer that shares V's TMA coordinate
    rule: token-major for the store's token-major pool, whatever the pool's size."""
    h, d, pool_slots, n = 2, 128, 1024, 384
    v_pool = torch.randn(pool_slots, h, d).transpose(0, 1)
    buf = sm90._like_v(v_pool, n)
    assert buf.shape == (h, n, d)
    assert sm90._head_view(buf)[1:] == sm90._head_view(v_pool)[1:] == (False, 0)
    contiguous = torch.randn(h, n, d)
    assert sm90._like_v(contiguous, n).stride() == contiguous.stride()


def test_supports_only_sm90_shapes():
    q = torch.randn(4, 256, 128, dtype=torch.bfloat16)
    k = torch.randn(1, 256, 128, dtype=torch.bfloat16)
    assert not sm90.supports(q, k, k, 128, None)        # CPU tensors


def test_block_128_falls_back_to_tl_off_hopper(monkeypatch):
    """On CPU (the interpreter) a block-128 call the Gluon kernel cannot take goes to the tl kernel: same result
    as the twin."""
    if not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("needs TRITON_INTERPRET=1 for the tl kernel on CPU")
    gen = torch.Generator().manual_seed(0)
    hq, hkv, block, nb, d = 2, 1, 128, 2, 128
    q = torch.randn(hq, nb * block, d, generator=gen).to(torch.float16)
    k = torch.randn(hkv, nb * block, d, generator=gen).to(torch.float16)
    v = torch.randn(hkv, nb * block, d, generator=gen).to(torch.float16)
    indptr = torch.tensor([0, 1, 3, 4, 6], dtype=torch.int32)
    indices = torch.tensor([0, 0, 1, 0, 0, 1], dtype=torch.int32)
    valid = torch.tensor([128, 100], dtype=torch.int32)
    offset = torch.tensor([0, 128], dtype=torch.int32)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    args = (q, k, v, indptr, indices, valid, offset, inv_freq)
    assert sa.attention_backend(q, k, v, block) == "tl"
    out = sa.sparse_attention(*args, scale=d ** -0.5, block=block)
    ref = sa.sparse_attention_ref(*args, scale=d ** -0.5, block=block)
    # Both round the output to fp16 (and the kernel its P): a few fp16 roundings of outputs of magnitude ~|v|.
    tol = kernel_tol(torch.float16, roundings=4, reduction=2 * block, scale=v.abs().max().item())
    assert_within(out, ref, tol, "tl kernel vs twin")
