"""Decode attention over the position-free cache against dense attention over keys explicitly rotated at their
logical positions (the unsegmented prompt's)."""
import math

import pytest
import torch

from sift.kernels.decode_attention import DecodeConfig, decode_attention, decode_attention_ref, layout_kv_table
from sift.kernels.layout import build_layout
from sift.kernels.rope import apply_rope_ref

from .helpers import DEVICE, kernel_tol

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

# Max abs error on outputs of O(1): fp32 is accumulation noise over at most 512 terms (keys, or head_dim); fp16
# is dominated by rounding q, k, v and the output to fp16 (4 roundings) against a reference fed the unrounded
# values.
TOL = {dtype: kernel_tol(dtype, roundings=4, reduction=512) for dtype in (torch.float32, torch.float16)}


def inv_freq_of(d: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def case(requests, block, hq, hkv, d, dtype, gen, pos_shift=None, n_generated=0):
    """A prefilled batch plus `n_generated` generated tokens per request (a further segment in an extra block),
    the last of them being the decoding token.

    Returns the kernel inputs (position-free cache, NaN in padding) and the dense reference output.
    pos_shift: per request, extra logical distance added before each segment (gaps that push offsets past 65,535
    without the tokens, so the query is far from the keys)."""
    layout = build_layout(requests, block)
    nb = layout.n_blocks
    n_tok = layout.n_tokens
    inv_freq = inv_freq_of(d)
    # Logical positions and segment offsets, optionally with gaps between segments.
    seg_offset = layout.seg_offset.long().clone()
    if pos_shift is not None:
        seg_offset += torch.tensor(pos_shift, dtype=torch.long)[layout.seg_request.long()] * (
            1 + torch.arange(layout.n_segments) - layout.seg_request.long().new_tensor(
                [sum(len(r) for r in requests[:i]) for i in range(len(requests))])[layout.seg_request.long()])
    tok_seg = layout.block_segment.long()[layout.token_phys // block]
    tok_logical = seg_offset[tok_seg] + layout.token_local_pos
    block_offset = seg_offset[layout.block_segment.long()].to(torch.int32)

    k_raw = torch.randn(hkv, n_tok, d, generator=gen)
    v_raw = torch.randn(hkv, n_tok, d, generator=gen)
    k_local = apply_rope_ref(k_raw, layout.token_local_pos, inv_freq)
    k_cache = layout.scatter(k_local, dim=1, fill=float("nan"))
    v_cache = layout.scatter(v_raw, dim=1, fill=float("nan"))
    block_valid = layout.block_valid.clone()
    kv_indptr, kv_indices = layout_kv_table(layout)
    per_req = [kv_indices[kv_indptr[b] : kv_indptr[b + 1]].tolist() for b in range(layout.n_requests)]

    bsz = layout.n_requests
    q_raw = torch.randn(bsz, hq, d, generator=gen)
    q_in, q_offset, dense_k, dense_v, q_pos = [], [], [], [], []
    tok0 = layout.req_first_token.tolist()
    n_req_tok = layout.req_n_tokens.tolist()
    for b in range(bsz):
        sl = slice(tok0[b], tok0[b] + n_req_tok[b])
        keys_log, vals = [apply_rope_ref(k_raw[:, sl], tok_logical[sl], inv_freq)], [v_raw[:, sl]]
        end = int(tok_logical[sl][-1]) + 1 + (pos_shift[b] if pos_shift else 0)
        if n_generated:
            # Generated tokens: a new segment starting at `end`, in a fresh block holding its local positions.
            gk = torch.randn(hkv, n_generated, d, generator=gen)
            gv = torch.randn(hkv, n_generated, d, generator=gen)
            pad = torch.full((hkv, block - n_generated, d), float("nan"))
            k_cache = torch.cat([k_cache, torch.cat([apply_rope_ref(gk, torch.arange(n_generated), inv_freq), pad], 1)], 1)
            v_cache = torch.cat([v_cache, torch.cat([gv, pad], 1)], 1)
            block_valid = torch.cat([block_valid, torch.tensor([n_generated], dtype=torch.int32)])
            block_offset = torch.cat([block_offset, torch.tensor([end], dtype=torch.int32)])
            per_req[b].append(nb + b)
            keys_log.append(apply_rope_ref(gk, end + torch.arange(n_generated), inv_freq))
            vals.append(gv)
            q_pos.append(end + n_generated - 1)
            q_offset.append(end)  # q is rotated at its local position inside the generated segment
            q_in.append(apply_rope_ref(q_raw[b][:, None], torch.tensor([n_generated - 1]), inv_freq)[:, 0])
        else:
            # The token right after the prompt, passed un-rotated: q_offset is then its logical position.
            q_pos.append(end)
            q_offset.append(end)
            q_in.append(q_raw[b])
        dense_k.append(torch.cat(keys_log, 1))
        dense_v.append(torch.cat(vals, 1))

    scale = 1.0 / math.sqrt(d)
    want = []
    for b in range(bsz):
        q_log = apply_rope_ref(q_raw[b][:, None].double(), torch.tensor([q_pos[b]]), inv_freq)[:, 0]  # [Hq, D]
        k = dense_k[b].double().repeat_interleave(hq // hkv, 0)
        v = dense_v[b].double().repeat_interleave(hq // hkv, 0)
        p = torch.softmax((k @ q_log[:, :, None])[..., 0] * scale, dim=-1)
        want.append((p[:, None, :] @ v)[:, 0])
    kv_indptr = torch.tensor([0] + [len(x) for x in per_req]).cumsum(0).to(torch.int32)
    kv_indices = torch.tensor(sum(per_req, []), dtype=torch.int32)
    inputs = dict(
        q=torch.stack(q_in).to(dtype),
        k_cache=k_cache.to(dtype),
        v_cache=v_cache.to(dtype),
        q_offset=torch.tensor(q_offset, dtype=torch.int32),
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        block_valid=block_valid.to(torch.int32),
        kv_offset=block_offset.to(torch.int32)[kv_indices.long()],
        inv_freq=inv_freq,
    )
    return inputs, torch.stack(want), scale


def check(inputs, want, scale, block, dtype, num_splits, config=None):
    tol = TOL[dtype]
    for name, fn, device in (("kernel", decode_attention, DEVICE), ("reference", decode_attention_ref, "cpu")):
        args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        got = fn(**args, scale=scale, block=block, num_splits=num_splits, config=config).cpu()
        assert got.dtype == dtype and got.shape == want.shape
        err = (got.double() - want).abs().max().item()
        print(f"{name}: max abs error {err:.3e} (tol {tol:.1e})")
        assert torch.isfinite(got).all()
        assert err <= tol, f"{name}: max abs error {err} > {tol}"


REQUESTS = [
    [("prefix", 5), ("doc", 37), ("doc", 1), ("doc", 50), ("query", 9)],
    [("doc", 20), ("query", 3)],
    [("prefix", 17), ("doc", 64), ("query", 0)],
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq, hkv, d, block, num_splits", [
    (4, 4, 64, 16, 1),
    (8, 2, 64, 32, 3),
    (6, 2, 128, 16, 4),   # GQA ratio 3: padded head group
    (4, 1, 32, 64, None),
])
def test_decode_after_prefill(dtype, hq, hkv, d, block, num_splits):
    gen = torch.Generator().manual_seed(hq * 100 + d)
    inputs, want, scale = case(REQUESTS, block, hq, hkv, d, dtype, gen)
    check(inputs, want, scale, block, dtype, num_splits)


@pytest.mark.parametrize("num_splits", [1, 5, 37])   # 37: more splits than blocks, some left empty
def test_decode_generated_tokens(num_splits):
    """Second and third decode steps: the generated tokens form a new segment in an extra block per request."""
    gen = torch.Generator().manual_seed(7)
    inputs, want, scale = case(REQUESTS, 16, 8, 2, 64, torch.float32, gen, n_generated=3)
    check(inputs, want, scale, 16, torch.float32, num_splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", [DecodeConfig(block_n=16, num_stages=2), DecodeConfig(block_n=32, num_warps=2)])
def test_every_config_computes_the_same_attention(dtype, config):
    """The split kernel's schedules (32-slot blocks in two 16-slot steps or one whole step) against the float64
    definition, with generated tokens in a segment of their own (a change of rotation inside a split) and splits
    that start mid-request."""
    gen = torch.Generator().manual_seed(3)
    inputs, want, scale = case(REQUESTS, 32, 8, 2, 64, dtype, gen, n_generated=3)
    check(inputs, want, scale, 32, dtype, 3, config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_offsets_beyond_65535(dtype):
    """Gaps of 70,001 positions before every segment: the query is >200K positions after the first keys."""
    gen = torch.Generator().manual_seed(11)
    inputs, want, scale = case(REQUESTS, 16, 4, 2, 64, dtype, gen, pos_shift=[70_001, 65_536, 131_071],
                               n_generated=2)
    assert int(inputs["q_offset"].max()) > 200_000
    check(inputs, want, scale, 16, dtype, 3)


def test_many_splits_merged_in_chunks():
    """40 splits of about one block each: the merge combines the partials 16 at a time, rescaling what it holds
    whenever a later chunk has a larger log-sum-exp."""
    gen = torch.Generator().manual_seed(5)
    requests = [[("prefix", 9), ("doc", 300), ("doc", 250), ("query", 40)], [("doc", 700), ("query", 5)]]
    inputs, want, scale = case(requests, 16, 8, 2, 64, torch.float32, gen)
    check(inputs, want, scale, 16, torch.float32, 40)


def test_strided_cache_and_no_rope():
    """k / v given as a [N, Hkv, D] buffer viewed as [Hkv, N, D]; inv_freq=None takes keys as rotated."""
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, block = 4, 2, 32, 16
    layout = build_layout([[("doc", 40)], [("prefix", 3), ("doc", 9)]], block)
    k = torch.randn(layout.n_slots, hkv, d, generator=gen).transpose(0, 1)
    v = torch.randn(layout.n_slots, hkv, d, generator=gen).transpose(0, 1)
    q = torch.randn(2, hq, d, generator=gen)
    kv_indptr, kv_indices = layout_kv_table(layout)
    args = (q, k, v, layout.seg_offset[:2].clone(), kv_indptr, kv_indices, layout.block_valid,
            layout.block_offset[kv_indices.long()], None)
    want = []
    for b in range(2):
        phys = layout.token_phys[layout.req_first_token[b] : layout.req_first_token[b] + layout.req_n_tokens[b]]
        kk, vv = k[:, phys].repeat_interleave(2, 0), v[:, phys].repeat_interleave(2, 0)
        p = torch.softmax((kk @ q[b][:, :, None])[..., 0] / math.sqrt(d), -1)
        want.append((p[:, None, :] @ vv)[:, 0])
    want = torch.stack(want).double()
    for fn, where in ((decode_attention, DEVICE), (decode_attention_ref, "cpu")):
        moved = [None if a is None else a.to(where) for a in args]
        got = fn(*moved, scale=1 / math.sqrt(d), block=block, num_splits=2).cpu()
        err = (got.double() - want).abs().max().item()
        print(f"{fn.__name__}: max abs error {err:.3e}")
        assert err <= TOL[torch.float32]


def test_rejects_bad_inputs():
    q = torch.zeros(1, 4, 64)
    k = torch.zeros(2, 32, 64)
    ok = dict(q_offset=torch.zeros(1, dtype=torch.int32), kv_indptr=torch.tensor([0, 2], dtype=torch.int32),
              kv_indices=torch.arange(2, dtype=torch.int32), block_valid=torch.full((2,), 16, dtype=torch.int32),
              kv_offset=torch.zeros(2, dtype=torch.int32), inv_freq=inv_freq_of(64))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        decode_attention(q, torch.zeros(3, 32, 64), torch.zeros(3, 32, 64), **ok, scale=0.1, block=16)
    with pytest.raises(ValueError, match="head_dim=48"):
        decode_attention(torch.zeros(1, 4, 48), k[..., :48], k[..., :48], **{**ok, "inv_freq": inv_freq_of(48)},
                         scale=0.1, block=16)
    with pytest.raises(ValueError, match="q_offset must be int32"):
        decode_attention(q, k, k, **{**ok, "q_offset": torch.zeros(1, dtype=torch.int64)}, scale=0.1, block=16)
    with pytest.raises(ValueError, match="whole number of blocks"):
        decode_attention(q, k, k, **ok, scale=0.1, block=64)
    with pytest.raises(ValueError, match="kv_offset must be int32"):   # one offset per block, not per entry
        decode_attention(q, k, k, **{**ok, "kv_offset": torch.zeros(3, dtype=torch.int32)}, scale=0.1, block=16)
    with pytest.raises(ValueError, match="config.block_n=8 must be a power of two >= 16"):
        decode_attention(q, k, k, **ok, scale=0.1, block=16, config=DecodeConfig(block_n=8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_shared_blocks_at_different_offsets(dtype, num_splits):
    """A pool of physical blocks: two documents' keys stored once at their local positions, and each request's
    own prefix and query blocks. Request 0 lists A then B, request 1 B then A after a longer prefix, request 2 A
    twice (the document repeated) with a gap past 65,535: every shared block appears at several offsets, which
    only kv_offset (per entry) can express. Reference: per request, the raw keys rotated at their logical
    positions, one after another, and plain softmax attention in float64."""
    gen = torch.Generator().manual_seed(23)
    block, hq, hkv, d = 16, 4, 2, 64
    inv_freq = inv_freq_of(d)
    lengths = {"A": 37, "B": 16, "p0": 5, "p1": 21, "p2": 3, "q0": 4, "q1": 9, "q2": 16}
    k_raw = {name: torch.randn(hkv, n, d, generator=gen, dtype=torch.float64) for name, n in lengths.items()}
    v_raw = {name: torch.randn(hkv, n, d, generator=gen, dtype=torch.float64) for name, n in lengths.items()}
    # The pool: each segment's blocks, keys rotated at segment-local positions, NaN in padding.
    first_block, k_pool, v_pool, valid = {}, [], [], []
    for name, n in lengths.items():
        first_block[name] = len(valid)
        n_blocks = -(-n // block)
        pad = torch.full((hkv, n_blocks * block - n, d), float("nan"), dtype=torch.float64)
        k_pool.append(torch.cat([apply_rope_ref(k_raw[name], torch.arange(n), inv_freq), pad], 1))
        v_pool.append(torch.cat([v_raw[name], pad], 1))
        valid += [min(block, n - i * block) for i in range(n_blocks)]
    requests = [[("p0", 0), ("A", 0), ("B", 0), ("q0", 0)],
                [("p1", 0), ("B", 0), ("A", 0), ("q1", 0)],
                [("p2", 0), ("A", 0), ("A", 70_000), ("q2", 0)]]   # (segment, gap before it)
    q_raw = torch.randn(len(requests), hq, d, generator=gen, dtype=torch.float64)
    indices, offsets, indptr, q_pos, want = [], [], [0], [], []
    for b, segments in enumerate(requests):
        pos, keys, vals = 0, [], []
        for name, gap in segments:
            pos += gap
            n = lengths[name]
            indices += [first_block[name] + i for i in range(-(-n // block))]
            offsets += [pos] * -(-n // block)
            keys.append(apply_rope_ref(k_raw[name], pos + torch.arange(n), inv_freq))
            vals.append(v_raw[name])
            pos += n
        indptr.append(len(indices))
        q_pos.append(pos)   # the token right after the prompt, passed un-rotated
        q_log = apply_rope_ref(q_raw[b][:, None], torch.tensor([pos]), inv_freq)[:, 0]        # [Hq, D]
        k = torch.cat(keys, 1).repeat_interleave(hq // hkv, 0)                                # [Hq, n, D]
        v = torch.cat(vals, 1).repeat_interleave(hq // hkv, 0)
        p = torch.softmax((k @ q_log[:, :, None])[..., 0] / math.sqrt(d), dim=-1)
        want.append((p[:, None, :] @ v)[:, 0])
    assert len(set(indices)) < len(indices)   # shared blocks really are listed more than once
    i32 = dict(dtype=torch.int32)
    inputs = dict(q=q_raw.to(dtype), k_cache=torch.cat(k_pool, 1).to(dtype), v_cache=torch.cat(v_pool, 1).to(dtype),
                  q_offset=torch.tensor(q_pos, **i32), kv_indptr=torch.tensor(indptr, **i32),
                  kv_indices=torch.tensor(indices, **i32), block_valid=torch.tensor(valid, **i32),
                  kv_offset=torch.tensor(offsets, **i32), inv_freq=inv_freq)
    check(inputs, torch.stack(want), 1.0 / math.sqrt(d), block, dtype, num_splits)
