"""APE's attention rescaling of parallel-encoded context (kernels/ape.py) in the prefill kernels and the decode
kernel, against an independent float64 reference written from the definition:

    out = (exp(S T lse_P) o_P + exp(lse_O) o_O) / (exp(S T lse_P) + exp(lse_O))

with o_P / lse_P the softmax over the row's parallel keys at temperature T and o_O / lse_O the softmax over its
other keys, each computed here as its own masked softmax (the code under test folds them into one pass).
"""
from __future__ import annotations

import math

import pytest
import torch

from sift.errors import SiftError
from sift.kernels.decode_attention import DecodeConfig, decode_attention, decode_attention_ref
from sift.kernels.layout import build_layout
from sift.kernels.sparse_attention import sparse_attention, sparse_attention_ref, sparse_attention_sdpa
from sift.kernels import sparse_attention_tl
from sift.kernels.sparse_attention_tl import AttentionConfig
from sift.runtime.modes import Mode

from .helpers import DEVICE, kernel_tol
from .test_sparse_attention import (Layout, allowed_slots, default_inv_freq, layout_of, make_csr, make_layout,
                                    make_qkv)

# Outputs of magnitude ~1 (V ~ N(0, 1)); a 16-bit kernel rounds q, the K tile, P and the output (4 roundings),
# every dtype accumulates in fp32 over at most 512 terms; the fold adds one division and one scaled log2 of fp32
# partial sums (2 more fp32 roundings, inside the reduction term's margin).
ATOL = {dtype: kernel_tol(dtype, roundings=4, reduction=512) for dtype in (torch.float32, torch.float16)}


def ape_reference(q_log, k_log, v, layout: Layout, block_mask, parallel_blocks, scale, t, s):
    """float64 [Hq, N, D]: each row's APE attention from the definition (rows that see no key are 0)."""
    hq, n, _ = q_log.shape
    group = hq // k_log.shape[0]
    b = layout.block
    real = layout.pos >= 0
    allowed = allowed_slots(layout, block_mask)                                                    # [Hq, N, N]
    par = parallel_blocks.bool().repeat_interleave(b)[None, None, :]                               # key slots
    k_rep = k_log.repeat_interleave(group, 0)
    v_rep = torch.where(real[None, :, None], v.double(), 0.0).repeat_interleave(group, 0)
    scores = q_log @ k_rep.transpose(1, 2) * scale
    out = torch.zeros(hq, n, v.shape[2], dtype=torch.float64)
    for h in range(hq):
        for r in range(n):
            o_mask, p_mask = allowed[h, r] & ~par[0, 0], allowed[h, r] & par[0, 0]
            parts = []
            if o_mask.any():
                x = scores[h, r][o_mask]
                parts.append((torch.logsumexp(x, 0), torch.softmax(x, 0) @ v_rep[h][o_mask]))
            if p_mask.any():
                x = scores[h, r][p_mask] / t
                parts.append((s * t * torch.logsumexp(x, 0), torch.softmax(x, 0) @ v_rep[h][p_mask]))
            if parts:
                w = torch.softmax(torch.stack([m for m, _ in parts]), 0)
                out[h, r] = sum(wi * o for wi, (_, o) in zip(w, parts))
    return out


def case(seed, block, segments, dtype, hq=4, hkv=2, d=64):
    """A batch whose requests have a prefix, documents and a query; the documents' blocks are the parallel ones."""
    gen = torch.Generator().manual_seed(seed)
    layout = make_layout(segments, block)
    inv = default_inv_freq(d)
    q, k, v, q_log, k_log = make_qkv(layout, hq, hkv, d, dtype, inv, gen)
    indptr, indices, mask = make_csr(layout, hq, "random", gen)
    seg_of_block = [s for lengths in segments for s, n in enumerate(lengths) for _ in range(math.ceil(n / block))]
    n_seg = [len(lengths) for lengths in segments for n in lengths for _ in range(math.ceil(n / block))]
    parallel = torch.tensor([0 < s < m - 1 for s, m in zip(seg_of_block, n_seg)], dtype=torch.int32)
    return layout, inv, q, k, v, q_log, k_log, indptr, indices, mask, parallel


def check(out, ref, dtype, what):
    err = (out.double() - ref).abs().nan_to_num(float("inf")).max().item()
    print(f"{what}: max abs err {err:.3e} (atol {ATOL[dtype]:.1e})")
    assert err <= ATOL[dtype], f"{what}: max abs err {err:.3e} > {ATOL[dtype]:.1e}"


SEGMENTS = [[7, 40, 23, 18], [5, 33, 9]]      # prefix, documents, query; lengths off the block


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rope_on", ["k", "pre"])
@pytest.mark.parametrize("t,s", [(0.5, 0.8), (1.0, 1.0), (0.9, 1.3)])
def test_prefill_kernel_and_ref_match_definition(t, s, rope_on, dtype):
    layout, inv, q, k, v, q_log, k_log, indptr, indices, mask, parallel = case(1, 16, SEGMENTS, dtype)
    scale = 64 ** -0.5
    want = ape_reference(q_log, k_log, v, layout, mask, parallel, scale, t, s)
    # The computed query blocks: every block but the parallel ones (their KV comes from the store).
    q_blocks = (parallel == 0).nonzero()[:, 0].to(torch.int32)
    nb = parallel.numel()
    rows = torch.cat([h * nb + q_blocks.long() for h in range(4)])
    row_start, row_end = indptr[:-1][rows], indptr[1:][rows]
    kw = dict(q_blocks=q_blocks, row_end=row_end, scale=scale, block=16)
    args = (q, k, v, torch.cat([row_start, row_end[-1:]]), indices, layout.block_valid, layout.block_offset, inv)
    computed = (parallel == 0).repeat_interleave(16)
    ref = sparse_attention_ref(*args, **kw, parallel=parallel, ape=(t, s))
    check(ref[:, computed], want[:, computed], dtype, "ref twin")
    dev = [x.to(DEVICE) for x in args]
    out = torch.zeros_like(dev[0])
    sparse_attention_tl.launch(*dev, out=out, config=AttentionConfig(4, 2, rope_on), **{
        key: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for key, x in kw.items()},
        parallel=parallel.to(DEVICE), ape=(t, s))
    check(out.cpu()[:, computed], want[:, computed], dtype, f"tl kernel ({rope_on})")


def test_without_parallel_blocks_is_plain_attention():
    """No parallel block: any (T, S) gives plain softmax attention; the public entry without the option is the
    unchanged kernel."""
    layout, inv, q, k, v, *_, indptr, indices, mask, parallel = case(2, 16, SEGMENTS, torch.float32)
    args = [x.to(DEVICE) for x in (q, k, v, indptr, indices, layout.block_valid, layout.block_offset)]
    plain = sparse_attention(*args, inv.to(DEVICE), scale=0.125, block=16)
    none = torch.zeros_like(parallel).to(DEVICE)
    rescaled = sparse_attention(*args, inv.to(DEVICE), scale=0.125, block=16, parallel=none, ape=(0.5, 2.0))
    check(rescaled.cpu(), plain.cpu().double(), torch.float32, "no parallel block")


def test_sdpa_path_matches_ref():
    """The CPU engine's attention (`sparse_attention_sdpa`) with APE, over a runtime layout with computed query
    blocks only (as mode "ape" runs it), against the ref twin."""
    lay = build_layout([[("prefix", 9), ("doc", 37), ("doc", 21), ("query", 14)]], 16, torch.device("cpu"))
    view = layout_of(lay)
    gen = torch.Generator().manual_seed(3)
    inv = default_inv_freq(64)
    q, k, v, _, _ = make_qkv(view, 4, 2, 64, torch.float32, inv, gen)
    indptr, indices, _ = make_csr(view, 4, "all", gen)
    parallel = torch.tensor([0, 1, 1, 1, 1, 1, 0], dtype=torch.int32)
    q_blocks = torch.tensor([0, 6], dtype=torch.int32)                 # prefix and query computed
    rows = torch.cat([torch.arange(h * lay.n_blocks, (h + 1) * lay.n_blocks)[q_blocks.long()] for h in range(4)])
    starts, ends = indptr[:-1][rows], indptr[1:][rows]
    cut = torch.cat([starts, ends[-1:]]).to(torch.int32)
    kw = dict(scale=0.125, row_end=ends.to(torch.int32), q_blocks=q_blocks, parallel=parallel, ape=(0.7, 0.9))
    want = sparse_attention_ref(q, k, v, cut, indices, lay.block_valid, lay.block_offset, inv, block=16, **kw)
    got = sparse_attention_sdpa(q, k, v, cut, indices, lay, inv, **kw)
    computed = torch.zeros(lay.n_slots, dtype=torch.bool)
    computed[lay.token_phys[lay.token_phys // 16 == 0]] = True
    computed[lay.token_phys[lay.token_phys // 16 == 6]] = True
    check(got[:, computed], want[:, computed].double(), torch.float32, "sdpa vs ref")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_kernel_and_ref_match_definition(dtype):
    """One new token per row over its block table, rows with their own (T, S) (one plain: (1, 1))."""
    gen = torch.Generator().manual_seed(4)
    block, hq, hkv, d, nb = 16, 4, 2, 64, 10
    k = torch.randn(hkv, nb * block, d, generator=gen).to(dtype)
    v = torch.randn(hkv, nb * block, d, generator=gen).to(dtype)
    q = torch.randn(3, hq, d, generator=gen).to(dtype)
    valid = torch.tensor([16, 16, 9, 16, 16, 16, 3, 16, 16, 5], dtype=torch.int32)
    indptr = torch.tensor([0, 4, 7, 10], dtype=torch.int32)
    indices = torch.tensor([0, 1, 2, 9, 3, 4, 6, 5, 7, 8], dtype=torch.int32)
    flags = torch.tensor([0, 1, 1, 0, 1, 1, 0, 0, 1, 0], dtype=torch.int32)
    ape = torch.tensor([[0.6, 0.8], [1.0, 1.0], [0.9, 1.2]], dtype=torch.float32)
    scale = d ** -0.5
    want = torch.zeros(3, hq, d, dtype=torch.float64)
    for b in range(3):
        ents = range(int(indptr[b]), int(indptr[b + 1]))
        slots = [int(indices[j]) * block + x for j in ents for x in range(int(valid[indices[j]]))]
        par = torch.tensor([bool(flags[j]) for j in ents for _ in range(int(valid[indices[j]]))])
        kk = k[:, slots].double().repeat_interleave(hq // hkv, 0)
        vv = v[:, slots].double().repeat_interleave(hq // hkv, 0)
        x = (q[b].double()[:, None, :] @ kk.transpose(1, 2))[:, 0] * scale              # [Hq, n]
        t, s = ape[b].tolist()
        lse_o, lse_p = torch.logsumexp(x[:, ~par], 1), s * t * torch.logsumexp(x[:, par] / t, 1)
        o_o = (torch.softmax(x[:, ~par], 1)[:, None, :] @ vv[:, ~par])[:, 0]
        o_p = (torch.softmax(x[:, par] / t, 1)[:, None, :] @ vv[:, par])[:, 0]
        w = torch.softmax(torch.stack([lse_o, lse_p]), 0)
        want[b] = w[0][:, None] * o_o + w[1][:, None] * o_p
    offs = torch.zeros(10, dtype=torch.int32)
    args = (q, k, v, torch.zeros(3, dtype=torch.int32), indptr, indices, valid, offs, None)
    ref = decode_attention_ref(*args, scale=scale, block=block, parallel=flags, ape=ape)
    check(ref, want, dtype, "decode ref twin")
    if DEVICE == "cuda" or __import__("os").environ.get("TRITON_INTERPRET") == "1":
        dev = [x.to(DEVICE) if x is not None else None for x in args]
        for splits, config in ((1, None), (2, None), (2, DecodeConfig(block_n=16, num_warps=2))):
            got = decode_attention(*dev, scale=scale, block=block, num_splits=splits, parallel=flags.to(DEVICE),
                                   ape=ape.to(DEVICE), config=config)
            check(got.cpu(), want, dtype, f"decode kernel, {splits} splits, {config}")


def test_option_validation():
    layout, inv, q, k, v, *_, indptr, indices, mask, parallel = case(5, 16, SEGMENTS, torch.float32)
    args = (q, k, v, indptr, indices, layout.block_valid, layout.block_offset, inv)
    with pytest.raises(ValueError, match="together"):
        sparse_attention_ref(*args, scale=0.1, block=16, parallel=parallel)
    with pytest.raises(ValueError, match="temperature, scale"):
        sparse_attention_ref(*args, scale=0.1, block=16, parallel=parallel, ape=(0.0, 1.0))
    with pytest.raises(ValueError, match="one flag per key block"):
        sparse_attention_ref(*args, scale=0.1, block=16, parallel=parallel[:-1], ape=(0.5, 1.0))


def test_mode_parsing():
    assert Mode.parse("ape").ape == (0.9, 0.9) and Mode.parse("ape").reuses
    m = Mode.parse("ape@0.5:1.25")
    assert (m.kind, m.ape, m.text) == ("ape", (0.5, 1.25), "ape@0.5:1.25")
    for bad in ("ape@", "ape@0:1", "ape@1.5:1", "ape@0.5", "ape@a:b", "ape@0.5:nan", "ape@0.5,1"):
        with pytest.raises(SiftError) as e:
            Mode.parse(bad)
        assert "\n" not in str(e.value) and "ape@<temperature>:<scale>" in str(e.value)
