"""Sparse prefill attention with in-kernel RoPE vs an independent dense float64 reference.

The reference never looks at the kernel's tiling: it expands the CSR into a dense [N, N] boolean mask, rotates
the raw (un-rotated) q and k at their *logical* positions, and runs masked softmax attention in float64. The
kernel gets the same q and k rotated at *segment-local* positions plus block offsets, as the KV cache holds them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from sift.kernels import sparse_attention_tl
from sift.kernels.layout import DOC, build_layout
from sift.kernels.rope import RopeSpec, apply_rope_ref, rope_inv_freq, rotate_key_blocks, rotate_key_blocks_ref
from sift.kernels.sparse_attention import sparse_attention, sparse_attention_ref, sparse_attention_sdpa
from sift.kernels.sparse_attention_tl import ROPE_MODES, AttentionConfig

from .helpers import DEVICE, kernel_tol, on_device

# Max abs error allowed on outputs of magnitude ~1 (V ~ N(0, 1)): a 16-bit kernel rounds the rotated q, the
# rotated K tile, P and the output (4 roundings); every dtype accumulates in fp32 over at most 512 terms (the
# longest row of keys here, or head_dim 128).
ATOL = {dtype: kernel_tol(dtype, roundings=4, reduction=512)
        for dtype in (torch.float32, torch.float16, torch.bfloat16)}


@dataclass
class Layout:
    """A packed batch. Per slot: logical / local position (-1 on padding), request and block of the slot."""

    block: int
    block_valid: torch.Tensor   # int32 [NB]
    block_offset: torch.Tensor  # int32 [NB]
    block_request: list[int]    # [NB]
    pos: torch.Tensor           # int64 [N] logical position, -1 on padding
    local: torch.Tensor         # int64 [N] segment-local position, -1 on padding

    @property
    def n(self) -> int:
        return self.pos.numel()


def make_layout(requests: list[list[int]], block: int, starts: list[list[int]] | None = None) -> Layout:
    """requests: segment lengths per request. starts: optional logical start of each segment (default: right
    after the previous segment's real tokens, from 0 in every request)."""
    valid, offset, req_of_block, pos, local = [], [], [], [], []
    for r, lengths in enumerate(requests):
        next_pos = 0
        for s, length in enumerate(lengths):
            first = starts[r][s] if starts else next_pos
            next_pos = first + length
            for b in range(math.ceil(length / block)):
                real = min(block, length - b * block)
                valid.append(real)
                offset.append(first)
                req_of_block.append(r)
                loc = list(range(b * block, b * block + real)) + [-1] * (block - real)
                local += loc
                pos += [first + x if x >= 0 else -1 for x in loc]
    return Layout(block, torch.tensor(valid, dtype=torch.int32), torch.tensor(offset, dtype=torch.int32),
                  req_of_block, torch.tensor(pos), torch.tensor(local))


def layout_of(lay) -> Layout:
    """The test's per-slot view of a `BatchLayout` (the runtime's layout, which `sparse_attention_sdpa` takes)."""
    pos = torch.full((lay.n_slots,), -1, dtype=torch.long)
    local = pos.clone()
    pos[lay.token_phys] = lay.token_logical_pos
    local[lay.token_phys] = lay.token_local_pos
    return Layout(lay.block, lay.block_valid.clone(), lay.block_offset.clone(), lay.block_request.tolist(), pos,
                  local)


def make_csr(layout: Layout, hq: int, pattern: str, gen: torch.Generator):
    """Block lists per (head, query block) over causal blocks of the same request -> indptr, indices, bool [Hq, NB, NB]."""
    nb = len(layout.block_request)
    req = torch.tensor(layout.block_request)
    causal = (req[:, None] == req[None, :]) & torch.ones(nb, nb, dtype=torch.bool).tril()
    first = torch.zeros(nb, nb, dtype=torch.bool)
    for qb in range(nb):
        first[qb, int((req == req[qb]).nonzero()[0])] = True
    eye = torch.eye(nb, dtype=torch.bool)
    if pattern == "all":
        mask = causal.expand(hq, nb, nb).clone()
    elif pattern == "diag_first":
        mask = (eye | first).expand(hq, nb, nb).clone()
    elif pattern == "random":
        # Diagonal usually kept, sometimes not; some rows end up empty on purpose.
        mask = (torch.rand(hq, nb, nb, generator=gen) < 0.5) & causal
        mask |= eye & (torch.rand(hq, nb, 1, generator=gen) < 0.8)
        mask[:, 0] = False
    else:
        raise AssertionError(pattern)
    counts = mask.flatten(0, 1).sum(1)
    indptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)
    indices = mask.flatten(0, 1).nonzero()[:, 1].to(torch.int32)  # row-major: ascending within each row
    return indptr, indices, mask


def spare_capacity(indptr, indices, gen):
    """The CSR with 0-2 spare entries after each row (out-of-range garbage there), as the one-pass decode writes
    it -> (row starts int32 [R + 1], indices, row_end int32 [R])."""
    counts = (indptr[1:] - indptr[:-1]).long()
    cap = counts + torch.randint(0, 3, counts.shape, generator=gen)
    starts = torch.zeros(counts.numel() + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(cap, 0)
    padded = torch.full((int(starts[-1]),), 10_000, dtype=torch.int32)
    for r in range(counts.numel()):
        padded[starts[r]:starts[r] + counts[r]] = indices[indptr[r]:indptr[r + 1]]
    return starts, padded, (starts[:-1] + counts).to(torch.int32)


def allowed_slots(layout: Layout, block_mask) -> torch.Tensor:
    """bool [Hq, N, N]: query slot r may see key slot c (block kept, both real, causal inside a block)."""
    n, b = layout.n, layout.block
    real = layout.pos >= 0
    slot = torch.arange(n) % b
    same_block = (torch.arange(n)[:, None] // b) == (torch.arange(n)[None, :] // b)
    cell = real[None, :] & ~(same_block & (slot[None, :] > slot[:, None]))                       # [N, N]
    return block_mask.repeat_interleave(b, 1).repeat_interleave(b, 2) & cell & real[:, None]


def dense_reference(q_log, k_log, v, layout: Layout, block_mask, scale):
    """q_log: [Hq, N, D], k_log, v: [Hkv, N, D] float64 at logical positions; block_mask: bool [Hq, NB, NB]."""
    hq = q_log.shape[0]
    group = hq // k_log.shape[0]
    real = layout.pos >= 0
    allowed = allowed_slots(layout, block_mask)                                                    # [Hq, N, N]
    k_rep = k_log.repeat_interleave(group, 0)
    v_rep = torch.where(real[None, :, None], v, 0.0).repeat_interleave(group, 0)
    s = (q_log @ k_rep.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v_rep


def make_qkv(layout: Layout, hq, hkv, d, dtype, inv_freq, gen, nan_padding=False):
    """Raw q, k -> (stored q, k at local positions in dtype, q_log, k_log float64, v in dtype)."""
    n = layout.n
    q_raw = torch.randn(hq, n, d, generator=gen, dtype=torch.float64)
    k_raw = torch.randn(hkv, n, d, generator=gen, dtype=torch.float64)
    v = torch.randn(hkv, n, d, generator=gen, dtype=torch.float64).to(dtype)
    pos, loc = layout.pos.clamp(min=0), layout.local.clamp(min=0)
    q, k = apply_rope_ref(q_raw, loc, inv_freq).to(dtype), apply_rope_ref(k_raw, loc, inv_freq).to(dtype)
    # The reference sees the same rounded values, only rotated further (float64) to logical positions.
    q_log = apply_rope_ref(apply_rope_ref(q.double(), -loc, inv_freq), pos, inv_freq)
    k_log = apply_rope_ref(apply_rope_ref(k.double(), -loc, inv_freq), pos, inv_freq)
    if nan_padding:
        pad = layout.pos < 0
        for x in (q, k, v):
            x[:, pad] = float("nan")
    return q, k, v, q_log, k_log


def random_case(seed: int, block: int, segments, starts):
    """4 query / 2 kv heads, head_dim 64, fp32, NaN in padding, a random block mask: the case the token-order,
    pre-rotation and row_end tests share. -> (layout, inv_freq, q, k, v, q_log, k_log, indptr, indices, mask, gen)."""
    gen = torch.Generator().manual_seed(seed)
    layout = make_layout(segments, block, starts=starts)
    inv_freq = default_inv_freq(64)
    q, k, v, q_log, k_log = make_qkv(layout, 4, 2, 64, torch.float32, inv_freq, gen, nan_padding=True)
    indptr, indices, mask = make_csr(layout, 4, "random", gen)
    return layout, inv_freq, q, k, v, q_log, k_log, indptr, indices, mask, gen


def default_inv_freq(d, theta=10000.0):
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def run_tl(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, *, scale, block, config, out=None,
           q_block_start=None):
    """The tl kernel with an explicit RoPE mode (`sparse_attention` picks the mode by block size)."""
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return sparse_attention_tl.launch(q, k, v, indptr, indices, block_valid, block_offset, inv_freq, scale=scale,
                                      block=block, out=out, q_block_start=q_block_start, config=config)


def run_kernel(q, k, v, indptr, indices, layout, inv_freq, scale, config=None):
    args = [x.to(DEVICE) for x in (q, k, v, indptr, indices, layout.block_valid, layout.block_offset)]
    inv = None if inv_freq is None else inv_freq.to(DEVICE)
    if config is None:
        out = sparse_attention(*args, inv, scale=scale, block=layout.block)
    else:
        out = run_tl(*args, inv, scale=scale, block=layout.block, config=config)
    return out.cpu()


def check_close(out, ref, dtype, what):
    err = (out.double() - ref).abs().nan_to_num(float("inf")).max().item()
    print(f"{what}: max abs err {err:.3e} (atol {ATOL[dtype]:.1e})")
    assert err <= ATOL[dtype], f"{what}: max abs err {err:.3e} > {ATOL[dtype]:.1e}"


def rand_lengths(gen, count, lo, hi):
    return torch.randint(lo, hi + 1, (count,), generator=gen).tolist()


# (n segments, group, head_dim, block): segments of random length, rarely a multiple of the block.
CASES = [(1, 1, 64, 16), (3, 3, 128, 16), (5, 4, 64, 32), (20, 1, 64, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("nseg,group,d,block", CASES)
def test_random_block_masks(nseg, group, d, block, dtype):
    gen = torch.Generator().manual_seed(nseg * 1000 + group * 10 + d + block)
    hkv = 2 if group == 1 else 1
    layout = make_layout([rand_lengths(gen, nseg, 1, 3 * block if nseg < 10 else block)], block)
    inv_freq = default_inv_freq(d)
    q, k, v, q_log, k_log = make_qkv(layout, hkv * group, hkv, d, dtype, inv_freq, gen, nan_padding=True)
    indptr, indices, mask = make_csr(layout, hkv * group, "random", gen)
    out = run_kernel(q, k, v, indptr, indices, layout, inv_freq, d ** -0.5)
    ref = dense_reference(q_log, k_log, v.double(), layout, mask, d ** -0.5)
    check_close(out, ref, dtype, f"random nseg={nseg} group={group} d={d} block={block}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_all_blocks_equal_dense_causal_sdpa(dtype):
    """Every causal block listed, two requests of unequal length in one batch: the result must be dense causal
    attention over each unsegmented prompt (SDPA on the real tokens at logical positions)."""
    gen = torch.Generator().manual_seed(7)
    block, d, hq, hkv = 16, 128, 4, 1
    layout = make_layout([[5, 23, 40, 9], [17, 3, 30]], block)
    inv_freq = default_inv_freq(d, theta=500000.0)
    q, k, v, q_log, k_log = make_qkv(layout, hq, hkv, d, dtype, inv_freq, gen)
    indptr, indices, _ = make_csr(layout, hq, "all", gen)
    out = run_kernel(q, k, v, indptr, indices, layout, inv_freq, d ** -0.5)
    req_of_slot = torch.tensor(layout.block_request).repeat_interleave(block)
    for r in range(2):
        slots = ((req_of_slot == r) & (layout.pos >= 0)).nonzero()[:, 0]
        slots = slots[layout.pos[slots].argsort()]  # logical order = the unsegmented prompt
        assert torch.equal(layout.pos[slots], torch.arange(slots.numel()))
        ref = torch.nn.functional.scaled_dot_product_attention(
            q_log[:, slots], k_log[:, slots], v.double()[:, slots], is_causal=True, scale=d ** -0.5,
            enable_gqa=True)
        check_close(out[:, slots], ref, dtype, f"dense causal request {r}")
    assert torch.equal(out[:, layout.pos < 0], torch.zeros_like(out[:, layout.pos < 0]))


def test_diagonal_and_first_block_only():
    gen = torch.Generator().manual_seed(3)
    block, d, hq, hkv, dtype = 16, 64, 3, 1, torch.float16
    layout = make_layout([[7, 50, 33, 20]], block)
    inv_freq = default_inv_freq(d)
    q, k, v, q_log, k_log = make_qkv(layout, hq, hkv, d, dtype, inv_freq, gen)
    indptr, indices, mask = make_csr(layout, hq, "diag_first", gen)
    out = run_kernel(q, k, v, indptr, indices, layout, inv_freq, d ** -0.5)
    check_close(out, dense_reference(q_log, k_log, v.double(), layout, mask, d ** -0.5), dtype, "diag+first")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_offsets_beyond_65535(dtype):
    """Segments placed at 70,000, 150,000 and 210,000: the fp32 angle there would be off by ~0.01 rad."""
    gen = torch.Generator().manual_seed(11)
    block, d, hq, hkv = 16, 64, 2, 1
    layout = make_layout([[12, 40, 29, 21]], block, starts=[[0, 70_000, 150_000, 210_000]])
    inv_freq = default_inv_freq(d)
    q, k, v, q_log, k_log = make_qkv(layout, hq, hkv, d, dtype, inv_freq, gen)
    indptr, indices, mask = make_csr(layout, hq, "all", gen)
    out = run_kernel(q, k, v, indptr, indices, layout, inv_freq, d ** -0.5)
    check_close(out, dense_reference(q_log, k_log, v.double(), layout, mask, d ** -0.5), dtype, "large offsets")


@pytest.mark.parametrize("rope_on", ["k", "pre"])
def test_rope_modes(rope_on):
    """block 32 in either RoPE mode of the tl kernel: each key tile rotated by delta ("k", the default below
    block 128) or the keys rotated by the pass and each Q tile once ("pre", the default at block 128)."""
    gen = torch.Generator().manual_seed(5)
    block, d, hq, hkv, dtype = 32, 64, 4, 2, torch.float32
    layout = make_layout([[20, 45, 70]], block, starts=[[0, 20, 100_000]])
    inv_freq = default_inv_freq(d)
    q, k, v, q_log, k_log = make_qkv(layout, hq, hkv, d, dtype, inv_freq, gen, nan_padding=True)
    indptr, indices, mask = make_csr(layout, hq, "random", gen)
    cfg = AttentionConfig(num_warps=4, num_stages=2, rope_on=rope_on)
    out = run_kernel(q, k, v, indptr, indices, layout, inv_freq, d ** -0.5, config=cfg)
    check_close(out, dense_reference(q_log, k_log, v.double(), layout, mask, d ** -0.5), dtype, f"rope on {rope_on}")


def _delta_runs(layout: Layout, indptr, indices):
    """Per CSR row: the list of deltas (block_offset[kb] - block_offset[qb]) in kernel order."""
    off = layout.block_offset.tolist()
    nb = len(off)
    ptr, idx = indptr.tolist(), indices.tolist()
    return [[off[kb] - off[r % nb] for kb in idx[ptr[r]:ptr[r + 1]]] for r in range(len(ptr) - 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rope_on", ["k", "pre"])
@pytest.mark.parametrize("block", [16, 32])
def test_mixed_zero_and_nonzero_deltas(block, rope_on, dtype):
    """Rows whose key blocks mix delta == 0 (own segment, and another segment starting at the same logical
    position) with runs of equal nonzero deltas (several consecutive blocks of one earlier segment), and a delta
    that comes back after a different one: exercises the cos/sin cache of rope_on="k" (hit, miss, refill, a zero
    delta in the middle of a row), the unmasked main loop next to the diagonal block, and padded last blocks."""
    if dtype == torch.float16 and block != 32:
        pytest.skip("fp16 only at block 32 (interpreter time)")
    gen = torch.Generator().manual_seed(19)
    d, hq, hkv = 64, 2, 1
    # Segments 0/2 and 1/3 start at the same logical positions, segment 4 later (offsets past 65,535 in the
    # second request).
    layout = make_layout([[40, 50, 35, 45, 60], [33, 70, 20]], block,
                         starts=[[0, 700, 0, 700, 1000], [0, 90_000, 90_000 + 70]])
    inv_freq = default_inv_freq(d)
    q, k, v, q_log, k_log = make_qkv(layout, hq, hkv, d, dtype, inv_freq, gen, nan_padding=True)
    indptr, indices, mask = make_csr(layout, hq, "all", gen)
    rows = _delta_runs(layout, indptr, indices)
    # The data really covers the cases.
    assert any(r and r[-1] == 0 and any(x != 0 for x in r) for r in rows)             # nonzero prefix, 0 suffix
    assert any(any(x == 0 and any(y != 0 for y in r[i:]) for i, x in enumerate(r)) for r in rows)  # 0 mid-row
    assert any(any(a == b != 0 for a, b in zip(r, r[1:])) for r in rows)               # cache hits
    assert any(any(x != 0 and x in r[:i] and r[i - 1] != x for i, x in enumerate(r)) for r in rows)  # refill
    cfg = AttentionConfig(num_warps=4, num_stages=2, rope_on=rope_on)
    out = run_kernel(q, k, v, indptr, indices, layout, inv_freq, d ** -0.5, config=cfg)
    ref = dense_reference(q_log, k_log, v.double(), layout, mask, d ** -0.5)
    check_close(out, ref, dtype, f"mixed deltas block={block} rope_on={rope_on}")
    # Same mask with a random subset of blocks (gaps inside runs, rows that end on an earlier segment).
    indptr, indices, mask = make_csr(layout, hq, "random", gen)
    out = run_kernel(q, k, v, indptr, indices, layout, inv_freq, d ** -0.5, config=cfg)
    ref = dense_reference(q_log, k_log, v.double(), layout, mask, d ** -0.5)
    check_close(out, ref, dtype, f"mixed deltas (random) block={block} rope_on={rope_on}")


@pytest.mark.parametrize("rope_on", ["k", "pre"])
def test_queries_and_output_in_token_order(rope_on):
    """q_block_start: q and out hold only the real tokens (strided views, as the engine passes the model's
    projections and o_proj's buffer); equal to the dense reference at the real slots, nothing else written."""
    block, d, hq, dtype = 32, 64, 4, torch.float32
    layout, inv_freq, q, k, v, q_log, k_log, indptr, indices, mask, _ = random_case(
        29, block, [[20, 45, 70], [33, 17]], [[0, 20, 100_000], [0, 70_000]])
    real = (layout.pos >= 0).nonzero()[:, 0]                      # physical slots of real tokens, in order
    q_tok = q[:, real].transpose(0, 1).contiguous().transpose(0, 1)  # [Hq, n, D] view of an [n, Hq, D] buffer
    nb = layout.n // block
    starts = torch.searchsorted(real, torch.arange(nb) * block).to(torch.int32)
    buf = torch.full((real.numel(), hq, d), 7.0, device=DEVICE)
    cfg = AttentionConfig(num_warps=4, num_stages=2, rope_on=rope_on)
    # .to keeps a dense view's strides: the kernel gets the same [n, Hq, D] layout on either device.
    run_tl(*on_device(q_tok, k, v, indptr, indices, layout.block_valid, layout.block_offset, inv_freq),
           scale=d ** -0.5, block=block, out=buf.transpose(0, 1), config=cfg, q_block_start=starts.to(DEVICE))
    ref = dense_reference(q_log, k_log, v.double(), layout, mask, d ** -0.5)[:, real]
    check_close(buf.transpose(0, 1).cpu(), ref, dtype, f"token-order q/out rope_on={rope_on}")
    twin = sparse_attention_ref(q_tok, k, v, indptr, indices, layout.block_valid, layout.block_offset, inv_freq,
                                scale=d ** -0.5, block=block, q_block_start=starts)
    check_close(twin, ref, dtype, "token-order twin")


def test_rotate_key_blocks_matches_reference():
    """The pass of rope_on="pre": each block's rows rotated by its segment offset (here up to 300,000)."""
    from sift.kernels.rope import rotate_key_blocks

    gen = torch.Generator().manual_seed(31)
    block, d = 16, 64
    k = torch.randn(3, 5 * block, d, generator=gen)
    offsets = torch.tensor([0, 7, 7, 65_536, 300_000], dtype=torch.int32)
    inv_freq = default_inv_freq(d)
    got = rotate_key_blocks(k.to(DEVICE), offsets.to(DEVICE), inv_freq.to(DEVICE), block=block).cpu()
    ref = apply_rope_ref(k.double(), offsets.repeat_interleave(block).long(), inv_freq)
    check_close(got, ref, torch.float32, "rotate_key_blocks")


def test_cos_sin_table_matches_reference():
    """Row b of the table the Gluon kernel rotates query tiles with: cos | sin of block_offset[b] * inv_freq, the
    same from `cos_sin_table` and from the key pass (which writes it for free), offsets up to 300,000."""
    from sift.kernels.rope import cos_sin_table, rotate_key_blocks

    block, d = 16, 64
    offsets = torch.tensor([0, 7, 7, 65_536, 300_000, 1], dtype=torch.int32)
    inv_freq = default_inv_freq(d)
    angle = offsets.double()[:, None] * inv_freq.double()[None, :]
    ref = torch.cat([torch.cos(angle), torch.sin(angle)], dim=1)
    table = cos_sin_table(offsets.to(DEVICE), inv_freq.to(DEVICE)).cpu()
    assert table.dtype == torch.float32 and table.shape == (6, d)
    assert (table.double() - ref).abs().max() < 1e-5
    k = torch.randn(2, 6 * block, d, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    from_pass = torch.full((6, d), float("nan"), device=DEVICE)
    rotate_key_blocks(k, offsets.to(DEVICE), inv_freq.to(DEVICE), block=block, out=torch.empty_like(k),
                      cos_sin=from_pass)
    assert torch.equal(from_pass.cpu(), table)


def test_rope_twins_match_kernels():
    """The ref twins of the key pass and of the cos / sin table agree with the kernels (offsets to 300,000)."""
    from sift.kernels.rope import cos_sin_table, cos_sin_table_ref, rotate_key_blocks, rotate_key_blocks_ref

    block, d = 16, 64
    offsets = torch.tensor([0, 7, 65_536, 300_000], dtype=torch.int32)
    inv_freq = default_inv_freq(d)
    k = torch.randn(2, 4 * block, d, generator=torch.Generator().manual_seed(5))
    table, table_ref = torch.empty(4, d, device=DEVICE), torch.empty(4, d)
    got = rotate_key_blocks(k.to(DEVICE), offsets.to(DEVICE), inv_freq.to(DEVICE), block=block, cos_sin=table)
    want = rotate_key_blocks_ref(k, offsets, inv_freq, block=block, cos_sin=table_ref)
    check_close(got.cpu(), want.double(), torch.float32, "rotate_key_blocks vs twin")
    check_close(table.cpu(), table_ref.double(), torch.float32, "key pass table vs twin")
    check_close(cos_sin_table(offsets.to(DEVICE), inv_freq.to(DEVICE)).cpu(), cos_sin_table_ref(offsets, inv_freq)
                .double(), torch.float32, "cos_sin_table vs twin")


def test_ref_twin_without_triton(monkeypatch):
    """CPU tensors without the Triton interpreter: `sparse_attention` runs the ref twin."""
    from sift.kernels.sparse_attention import attention_backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    block, d = 16, 64
    layout, inv_freq, q, k, v, q_log, k_log, indptr, indices, mask, _ = random_case(
        43, block, [[20, 45]], [[0, 70_000]])
    assert attention_backend(q, k, v, block) == "ref"
    out = sparse_attention(q, k, v, indptr, indices, layout.block_valid, layout.block_offset, inv_freq,
                           scale=d ** -0.5, block=block)
    check_close(out, dense_reference(q_log, k_log, v.double(), layout, mask, d ** -0.5), torch.float32, "ref")


@pytest.mark.parametrize("token_order", [False, True])
def test_pre_rotation_through_output_rows(token_order):
    """rope_on="pre": the once-rotated Q tile passes through the program's own output rows (NaN there
    beforehand, NaN in padding) and the result still equals the dense reference."""
    block, d, hq, dtype = 32, 64, 4, torch.float32
    layout, inv_freq, q, k, v, q_log, k_log, indptr, indices, mask, _ = random_case(
        37, block, [[20, 45, 70], [33, 17]], [[0, 20, 100_000], [0, 70_000]])
    cfg = AttentionConfig(num_warps=4, num_stages=2, rope_on="pre")
    ref = dense_reference(q_log, k_log, v.double(), layout, mask, d ** -0.5)
    if token_order:
        real = (layout.pos >= 0).nonzero()[:, 0]
        starts = torch.searchsorted(real, torch.arange(layout.n // block) * block).to(torch.int32)
        out = torch.full((hq, real.numel(), d), float("nan"), device=DEVICE)
        run_tl(*on_device(q[:, real], k, v, indptr, indices, layout.block_valid, layout.block_offset, inv_freq),
               scale=d ** -0.5, block=block, out=out, config=cfg, q_block_start=starts.to(DEVICE))
        ref = ref[:, real]
    else:
        out = torch.full_like(q, float("nan"), device=DEVICE)
        run_tl(*on_device(q, k, v, indptr, indices, layout.block_valid, layout.block_offset, inv_freq),
               scale=d ** -0.5, block=block, out=out, config=cfg)
    check_close(out.cpu(), ref, dtype, f"pre via out (token order {token_order})")


def test_rows_with_spare_capacity_row_end():
    """row_end: rows start with gaps after them (as the one-pass decode writes them, garbage in the gaps); the
    kernel and the twin read indices[indptr[r]:row_end[r]] and equal the dense reference."""
    block, d, dtype = 16, 64, torch.float32
    layout, inv_freq, q, k, v, q_log, k_log, indptr, indices, mask, gen = random_case(
        41, block, [[20, 45, 70]], [[0, 20, 100_000]])
    starts, padded, row_end = spare_capacity(indptr, indices, gen)
    ref = dense_reference(q_log, k_log, v.double(), layout, mask, d ** -0.5)
    out = sparse_attention(*on_device(q, k, v, starts, padded, layout.block_valid, layout.block_offset, inv_freq),
                           scale=d ** -0.5, block=block, row_end=row_end.to(DEVICE))
    check_close(out.cpu(), ref, dtype, "row_end kernel")
    twin = sparse_attention_ref(q, k, v, starts, padded, layout.block_valid, layout.block_offset, inv_freq,
                                scale=d ** -0.5, block=block, row_end=row_end)
    check_close(twin, ref, dtype, "row_end twin")


def test_prerotated_keys_without_rope():
    """inv_freq=None: q and k already at logical positions, no rotation in the kernel."""
    gen = torch.Generator().manual_seed(9)
    block, d, hq, hkv, dtype = 16, 128, 3, 1, torch.float16
    layout = make_layout([[30, 18, 41]], block)
    _, _, v, q_log, k_log = make_qkv(layout, hq, hkv, d, dtype, default_inv_freq(d), gen)
    q, k = q_log.to(dtype), k_log.to(dtype)
    indptr, indices, mask = make_csr(layout, hq, "random", gen)
    out = run_kernel(q, k, v, indptr, indices, layout, None, d ** -0.5)
    ref = dense_reference(q.double(), k.double(), v.double(), layout, mask, d ** -0.5)
    check_close(out, ref, dtype, "pre-rotated")


def test_strided_views_and_out():
    """q, k, v as transposed views of [N, H, D] and a caller-provided out."""
    gen = torch.Generator().manual_seed(13)
    block, d, hq, hkv, dtype = 16, 64, 4, 2, torch.float16
    layout = make_layout([[9, 37, 22]], block)
    inv_freq = default_inv_freq(d)
    q, k, v, q_log, k_log = make_qkv(layout, hq, hkv, d, dtype, inv_freq, gen)
    indptr, indices, mask = make_csr(layout, hq, "random", gen)
    qs, ks, vs = (x.transpose(0, 1).contiguous().transpose(0, 1).to(DEVICE) for x in (q, k, v))
    assert qs.stride(-1) == 1 and not qs.is_contiguous()
    out = torch.full((hq, layout.n, d), float("nan"), dtype=dtype, device=DEVICE)
    res = sparse_attention(qs, ks, vs, indptr.to(DEVICE), indices.to(DEVICE), layout.block_valid.to(DEVICE),
                           layout.block_offset.to(DEVICE), inv_freq.to(DEVICE), scale=d ** -0.5, block=block, out=out)
    assert res is out
    check_close(out.cpu(), dense_reference(q_log, k_log, v.double(), layout, mask, d ** -0.5), dtype, "strided")


@pytest.mark.parametrize("rope", [True, False])
def test_reference_twin_matches_dense(rope):
    gen = torch.Generator().manual_seed(17)
    block, d, hq, hkv, dtype = 16, 64, 4, 1, torch.float32
    layout = make_layout([[11, 40], [26, 5, 19]], block, starts=[[0, 11], [0, 80_000, 80_005]])
    inv_freq = default_inv_freq(d)
    q, k, v, q_log, k_log = make_qkv(layout, hq, hkv, d, dtype, inv_freq, gen, nan_padding=True)
    if not rope:
        q, k = q_log.to(dtype), k_log.to(dtype)
    indptr, indices, mask = make_csr(layout, hq, "random", gen)
    out = sparse_attention_ref(q, k, v, indptr, indices, layout.block_valid, layout.block_offset,
                               inv_freq if rope else None, scale=d ** -0.5, block=block)
    check_close(out, dense_reference(q_log, k_log, v.double(), layout, mask, d ** -0.5), dtype, "reference twin")


def test_launcher_rejects_bad_inputs():
    block, d, n = 16, 64, 32
    q = torch.randn(4, n, d, device=DEVICE, dtype=torch.float16)
    k = v = torch.randn(2, n, d, device=DEVICE, dtype=torch.float16)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    good = dict(indptr=torch.zeros(4 * 2 + 1, **i32), indices=torch.zeros(0, **i32),
                block_valid=torch.full((2,), block, **i32), block_offset=torch.zeros(2, **i32))

    def call(**kw):
        args = {**dict(q=q, k=k, v=v, **good, inv_freq=None), **kw}
        sparse_attention(args["q"], args["k"], args["v"], args["indptr"], args["indices"], args["block_valid"],
                         args["block_offset"], args["inv_freq"], scale=kw.get("scale", 0.125),
                         block=kw.get("block", block))

    with pytest.raises(ValueError, match="block=24"):
        call(block=24)
    with pytest.raises(ValueError, match="indptr must be int32"):
        call(indptr=torch.zeros(4 * 2 + 1, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        call(k=torch.randn(3, n, d, device=DEVICE, dtype=torch.float16), v=torch.randn(3, n, d, device=DEVICE,
                                                                                         dtype=torch.float16))
    with pytest.raises(ValueError, match="head_dim=48"):
        call(q=q[..., :48], k=k[..., :48], v=v[..., :48])
    with pytest.raises(ValueError, match="inv_freq"):
        call(inv_freq=torch.ones(d, device=DEVICE))
    with pytest.raises(ValueError, match="scale"):
        call(scale=-1.0)


# ---- Only some query blocks computed (q_blocks) -------------------------------------------------------------

Q_BLOCK_REQUESTS = [[("prefix", 5), ("doc", 37), ("doc", 20), ("doc", 33), ("query", 9)],
                    [("prefix", 17), ("doc", 40), ("query", 3)],
                    [("doc", 24), ("doc", 50), ("query", 20)]]


def q_block_case(seed: int, block: int, dtype):
    """Three requests, several documents each; every prefix / query block and a few document blocks computed
    (the reuse prefill's pattern). 4 query / 2 kv heads, head_dim 64, NaN in padding, a random block mask.
    -> (layout, BatchLayout, inv_freq, q, k, v, dense reference output of every row, q_blocks, CSR rows of
    q_blocks only with spare capacity: (starts, indices, row_end))."""
    gen = torch.Generator().manual_seed(seed)
    lay = build_layout(Q_BLOCK_REQUESTS, block)
    layout = layout_of(lay)
    inv_freq = default_inv_freq(64)
    q, k, v, q_log, k_log = make_qkv(layout, 4, 2, 64, dtype, inv_freq, gen, nan_padding=True)
    _, _, mask = make_csr(layout, 4, "random", gen)
    want = dense_reference(q_log, k_log, v.double(), layout, mask, 64 ** -0.5)   # every row, full CSR
    doc_blocks = (lay.block_kind == DOC).nonzero()[:, 0]
    some_docs = doc_blocks[torch.randperm(doc_blocks.numel(), generator=gen)[:3]]
    q_blocks = torch.cat([(lay.block_kind != DOC).nonzero()[:, 0], some_docs]).sort().values.to(torch.int32)
    sub = mask[:, q_blocks.long()]                                                # [Hq, NQ, NB]: rows h * NQ + i
    counts = sub.flatten(0, 1).sum(1)
    indptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)
    indices = sub.flatten(0, 1).nonzero()[:, 1].to(torch.int32)
    return layout, lay, inv_freq, q, k, v, want, q_blocks, spare_capacity(indptr, indices, gen)


def computed_slots(layout: Layout, q_blocks):
    """bool [N]: the slots of the computed blocks."""
    computed = torch.zeros(len(layout.block_request), dtype=torch.bool)
    computed[q_blocks.long()] = True
    return computed.repeat_interleave(layout.block)


@pytest.mark.parametrize("dtype, block, rope_on", [
    (torch.float32, 16, "k"), (torch.float16, 32, "k"), (torch.float32, 32, "pre"), (torch.float16, 16, "pre")])
def test_q_blocks_padded_layout(dtype, block, rope_on):
    """q_blocks with q / out padded: the computed blocks' rows (padding rows 0) equal the dense reference over
    the full CSR; the other rows of a pre-filled out are untouched. The tl kernel, the twin and the SDPA twin."""
    layout, lay, inv_freq, q, k, v, want, q_blocks, (starts, indices, row_end) = q_block_case(47, block, dtype)
    rows = computed_slots(layout, q_blocks)
    args = (q, k, v, starts, indices, layout.block_valid, layout.block_offset, inv_freq)
    cfg = AttentionConfig(num_warps=4, num_stages=2, rope_on=rope_on)
    kernel = sparse_attention_tl.launch(*on_device(*args), scale=64 ** -0.5, block=block,
                                        out=torch.full_like(q, 7.0, device=DEVICE), row_end=row_end.to(DEVICE),
                                        q_blocks=q_blocks.to(DEVICE), config=cfg).cpu()
    twin = sparse_attention_ref(*args, scale=64 ** -0.5, block=block, out=torch.full_like(q, 7.0), row_end=row_end,
                                q_blocks=q_blocks)
    for name, out in (("tl", kernel), ("twin", twin)):
        check_close(out[:, rows], want[:, rows], dtype, f"q_blocks padded {name} block={block} rope_on={rope_on}")
        assert torch.equal(out[:, ~rows], torch.full_like(out[:, ~rows], 7.0)), f"{name} wrote other blocks' rows"
    sdpa = sparse_attention_sdpa(q, k, v, starts, indices, lay, inv_freq, scale=64 ** -0.5, row_end=row_end,
                                  q_blocks=q_blocks)
    check_close(sdpa[:, rows], want[:, rows], dtype, "q_blocks sparse_attention_sdpa")
    assert torch.equal(sdpa[:, ~rows], torch.zeros_like(sdpa[:, ~rows]))


@pytest.mark.parametrize("dtype, block", [(torch.float32, 32), (torch.float16, 16)])
def test_q_blocks_token_order(dtype, block):
    """q_blocks with q_block_start: q / out hold only the computed blocks' real tokens ([n, Hq, D] buffers seen
    as [Hq, n, D]); q_block_start of the other blocks holds garbage, never read. Through `sparse_attention`
    (the tl kernel here) and the twin, against the dense reference over the full CSR."""
    layout, lay, inv_freq, q, k, v, want, q_blocks, (starts, indices, row_end) = q_block_case(53, block, dtype)
    real = ((layout.pos >= 0) & computed_slots(layout, q_blocks)).nonzero()[:, 0]   # ascending physical slots
    q_start = torch.full((len(layout.block_request),), -1_000_000, dtype=torch.int32)
    q_start[q_blocks.long()] = torch.searchsorted(real, q_blocks.long() * block).to(torch.int32)
    q_tok = q[:, real].transpose(0, 1).contiguous().transpose(0, 1)
    args = (q_tok, k, v, starts, indices, layout.block_valid, layout.block_offset, inv_freq)
    rows = dict(q_block_start=q_start, row_end=row_end, q_blocks=q_blocks)
    buf = torch.full((real.numel(), 4, 64), float("nan"), dtype=dtype, device=DEVICE)
    out = sparse_attention(*on_device(*args), scale=64 ** -0.5, block=block, out=buf.transpose(0, 1),
                           **{name: x.to(DEVICE) for name, x in rows.items()})
    check_close(out.cpu(), want[:, real], dtype, f"q_blocks token order kernel block={block}")
    twin = sparse_attention_ref(*args, scale=64 ** -0.5, block=block, **rows)
    check_close(twin, want[:, real], dtype, "q_blocks token order twin")


def paged_pool(k, v, block: int, gen: torch.Generator, spare: int = 5):
    """k, v [Hkv, NB * block, D] in logical order -> token-major pools ([slots, Hkv, D] seen as [Hkv, slots, D], as
    the KV store holds a layer) with the blocks at shuffled pages among `spare` extra pages of NaN, and kv_pages
    int32 [NB]: what the kernels must read in place."""
    hkv, n, d = k.shape
    nb = n // block
    pages = torch.randperm(nb + spare, generator=gen)[:nb]
    pools = []
    for x in (k, v):
        pool = torch.full(((nb + spare) * block, hkv, d), float("nan"), dtype=x.dtype)
        pool.view(nb + spare, block, hkv, d)[pages] = x.transpose(0, 1).reshape(nb, block, hkv, d)
        pools.append(pool.transpose(0, 1))
    return pools[0], pools[1], pages.to(torch.int32)


@pytest.mark.parametrize("dtype, block, rope_on", [
    (torch.float32, 16, "k"), (torch.float16, 32, "pre"), (torch.float16, 16, "k"), (torch.float32, 32, "pre")])
def test_kv_pages_read_in_place(dtype, block, rope_on):
    """kv_pages: k / v are pools whose pages hold the layout's blocks in shuffled order (NaN elsewhere), read in
    place with q in token order and only some query blocks computed (the reuse prefill's call): the tl kernel,
    the twin and the key pass equal the dense reference over the logical blocks."""
    layout, lay, inv_freq, q, k, v, want, q_blocks, (starts, indices, row_end) = q_block_case(61, block, dtype)
    gen = torch.Generator().manual_seed(62)
    k_pool, v_pool, pages = paged_pool(k, v, block, gen)
    real = ((layout.pos >= 0) & computed_slots(layout, q_blocks)).nonzero()[:, 0]
    q_start = torch.full((len(layout.block_request),), -1_000_000, dtype=torch.int32)
    q_start[q_blocks.long()] = torch.searchsorted(real, q_blocks.long() * block).to(torch.int32)
    q_tok = q[:, real].transpose(0, 1).contiguous().transpose(0, 1)
    args = (q_tok, k_pool, v_pool, starts, indices, layout.block_valid, layout.block_offset, inv_freq)
    rows = dict(q_block_start=q_start, row_end=row_end, q_blocks=q_blocks, kv_pages=pages)
    cfg = AttentionConfig(num_warps=4, num_stages=2, rope_on=rope_on)
    out = torch.full((real.numel(), 4, 64), float("nan"), dtype=dtype, device=DEVICE).transpose(0, 1)
    sparse_attention_tl.launch(*on_device(*args), scale=64 ** -0.5, block=block, out=out,
                               **{name: x.to(DEVICE) for name, x in rows.items()}, config=cfg)
    check_close(out.cpu(), want[:, real], dtype, f"kv_pages tl block={block} rope_on={rope_on}")
    twin = sparse_attention_ref(*args, scale=64 ** -0.5, block=block, **rows)
    check_close(twin, want[:, real], dtype, "kv_pages twin")
    # The key pass reads the pages and writes logical order: equal to rotating the logical keys.
    keys = rotate_key_blocks(k_pool.to(DEVICE), layout.block_offset.to(DEVICE), inv_freq.to(DEVICE), block=block,
                             pages=pages.to(DEVICE)).cpu()
    ref_keys = rotate_key_blocks_ref(k, layout.block_offset, inv_freq, block=block)
    real_slots = layout.pos >= 0
    torch.testing.assert_close(keys[:, real_slots].float(), ref_keys[:, real_slots].float(), atol=ATOL[dtype],
                               rtol=0)


def test_kv_pages_without_rope():
    """kv_pages with keys already at logical positions (inv_freq None): K and V both read from their pages."""
    gen = torch.Generator().manual_seed(63)
    block, d, hq, hkv, dtype = 16, 64, 4, 2, torch.float32
    layout = make_layout([[30, 18, 41], [7, 50]], block)
    _, _, v, q_log, k_log = make_qkv(layout, hq, hkv, d, dtype, default_inv_freq(d), gen)
    q, k = q_log.to(dtype), k_log.to(dtype)
    indptr, indices, mask = make_csr(layout, hq, "random", gen)
    k_pool, v_pool, pages = paged_pool(k, v, block, gen)
    ref = dense_reference(q.double(), k.double(), v.double(), layout, mask, d ** -0.5)
    for rope_on in ROPE_MODES:
        out = sparse_attention_tl.launch(*on_device(q, k_pool, v_pool, indptr, indices, layout.block_valid,
                                                    layout.block_offset), None, scale=d ** -0.5, block=block,
                                         out=torch.empty_like(q, device=DEVICE), kv_pages=pages.to(DEVICE),
                                         config=AttentionConfig(num_warps=4, num_stages=2, rope_on=rope_on))
        check_close(out.cpu(), ref, dtype, f"kv_pages without RoPE ({rope_on})")


def test_kv_pages_rejected_when_malformed():
    layout, lay, inv_freq, q, k, v, want, q_blocks, (starts, indices, row_end) = q_block_case(64, 16, torch.float32)
    k_pool, v_pool, pages = paged_pool(k, v, 16, torch.Generator().manual_seed(65))
    args = (q, k_pool, v_pool, starts, indices, layout.block_valid, layout.block_offset, inv_freq)
    rows = dict(row_end=row_end, q_blocks=q_blocks)
    dev_rows = dict(row_end=row_end.to(DEVICE), q_blocks=q_blocks.to(DEVICE))
    with pytest.raises(ValueError, match="kv_pages must be None or int32"):
        sparse_attention(*on_device(*args), scale=0.125, block=16, kv_pages=pages.long().to(DEVICE), **dev_rows)
    with pytest.raises(ValueError, match="give one page per block of the layout"):
        sparse_attention(*on_device(*args), scale=0.125, block=16, kv_pages=pages[:-1].to(DEVICE), **dev_rows)
    beyond = pages.clone()
    beyond[0] = k_pool.shape[1] // 16
    with pytest.raises(ValueError, match="kv_pages must be pages of k / v"):
        sparse_attention_ref(*args, scale=0.125, block=16, kv_pages=beyond, **rows)


def test_q_blocks_rejected_when_malformed():
    layout, lay, inv_freq, q, k, v, want, q_blocks, (starts, indices, row_end) = q_block_case(59, 16, torch.float32)
    args = (q, k, v, starts, indices, layout.block_valid, layout.block_offset, inv_freq)
    dev = on_device(*args)
    row_end_d, q_blocks_d = on_device(row_end, q_blocks)
    nb = len(layout.block_request)
    with pytest.raises(ValueError, match="q_blocks must be None or int32"):
        sparse_attention(*dev, scale=0.125, block=16, row_end=row_end_d, q_blocks=q_blocks_d.long())
    with pytest.raises(ValueError, match="q_blocks must be None or int32"):
        sparse_attention(*dev, scale=0.125, block=16, q_blocks=torch.arange(nb + 1, dtype=torch.int32,
                                                                             device=DEVICE))
    with pytest.raises(ValueError, match="indptr must be int32"):   # rows counted against NB, not NQ
        sparse_attention(*dev, scale=0.125, block=16, row_end=row_end_d)
    with pytest.raises(ValueError, match="row_end must be"):
        sparse_attention(*dev, scale=0.125, block=16, row_end=row_end_d[:-1], q_blocks=q_blocks_d)
    repeated = q_blocks.clone()
    repeated[1] = repeated[0]
    with pytest.raises(ValueError, match="distinct block ids"):
        sparse_attention_ref(*args, scale=0.125, block=16, row_end=row_end, q_blocks=repeated)


# ---- RoPE parameters --------------------------------------------------------------------------------------

ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4096},
}


def _llama_config(rope_parameters):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                       intermediate_size=64, vocab_size=32, max_position_embeddings=32768,
                       rope_parameters=dict(rope_parameters))


@pytest.mark.parametrize("name", list(ROPE_CASES))
def test_rope_spec_and_rotation_match_transformers(name):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = _llama_config(ROPE_CASES[name])
    spec = rope_inv_freq(config)
    assert isinstance(spec, RopeSpec) and spec.inv_freq.dtype == torch.float32 and spec.inv_freq.shape == (64,)
    rotary = LlamaRotaryEmbedding(config)
    assert torch.equal(spec.inv_freq, rotary.inv_freq.float())
    assert spec.attention_scaling == pytest.approx(rotary.attention_scaling)
    x = torch.randn(1, 2, 10, 128, dtype=torch.float32)
    positions = torch.arange(3, 13)
    cos, sin = rotary(x, positions[None])
    want, _ = apply_rotary_pos_emb(x, x, cos, sin)
    got = apply_rope_ref(x[0], positions, spec.inv_freq, attention_scaling=spec.attention_scaling)
    err = (got - want[0]).abs().max().item()
    print(f"{name}: apply_rope_ref vs transformers max abs err {err:.2e}")
    assert err < 1e-5


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_rope_types_not_linear_in_position_are_refused(rope_type):
    config = _llama_config({"rope_type": "default", "rope_theta": 10000.0})
    config.rope_parameters = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match=f"rope_type='{rope_type}' is unsupported"):
        rope_inv_freq(config)
