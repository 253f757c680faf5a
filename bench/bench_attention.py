"""Check and time the sparse prefill attention kernels on one GPU; writes bench/results/attention.json.

    python bench/bench_attention.py [--lengths 16384,32768,65536] [--masks a,b] [--rounds 3]
    python bench/bench_attention.py --smoke      # CPU, Triton interpreter, tiny shapes: the script runs

1. Correctness in bf16 against the ref twin (many segments, lengths not multiples of 128, offsets past 65,535,
   NaN in padding, every timed kernel) and, with every causal block listed, against dense causal SDPA over the
   unsegmented prompt.
2. Timings at B=1, Hq=32, Hkv=8, D=128, bf16, L in --lengths: the tl kernel and the Gluon Hopper kernel with
   RoPE (sparse_rope), the same without RoPE (pre-rotated keys, sparse_none), every causal block (dense_rope),
   FlexAttention with the identical block mask, cuDNN and flash SDPA dense causal. Mask (a): documents of 2048
   tokens keep 30% of their own causal blocks, 6% of earlier documents' and the first block; the 512-token query
   is dense. Mask (b): real SmolLM2 SIFT bits tiled to L (bench/masks.py). Every timing is a do_bench median;
   --rounds interleaved rounds, the minimum kept (single runs of one persistent kernel vary by several percent).

The correctness checks are gates (bench/common.py `Checks`): the output's relative error per (head, query block)
within c * u * sqrt(depth) of the reference, u the unit roundoff of the inputs' dtype (DEPTH_* below says which
roundings count); the script exits with status 1 after writing its result when one fails.
"""
from __future__ import annotations

import json
import time

from common import Checks, gpu_ms, out_dir, parser, relative_error, smoke_env, write_result

SMOKE = smoke_env()

import torch  # noqa: E402

from sift.kernels import sparse_attention as sa  # noqa: E402
from sift.kernels import sparse_attention_sm90 as sm90  # noqa: E402
from sift.kernels import sparse_attention_tl as tlk  # noqa: E402
from sift.kernels.layout import QUERY, build_layout  # noqa: E402
from sift.kernels.rope import apply_rope_ref  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
BLOCK = 128
HQ, HKV, D = (4, 1, 128) if SMOKE else (32, 8, 128)
DTYPE = torch.float16 if SMOKE else torch.bfloat16  # bf16 is broken in the interpreter
SCALE = D ** -0.5
KERNELS = ("tl",) if SMOKE else ("tl", "gluon")   # the Gluon kernel needs an sm_90 GPU
# Roundings to the inputs' dtype that a kernel's output goes through and its ref twin's does not share (the
# twin attends in fp32 from the same inputs, rotates in fp64 and rounds its output once): P before the P V product,
# the kernel's output and the twin's; with RoPE also the key pass's rotated keys and the query tile rotated in
# packed arithmetic (cos / sin rounded, two roundings per element).
DEPTH_ATTENTION, DEPTH_ATTENTION_ROPE = 3, 7
# Against fp32 SDPA over keys rotated at logical positions in fp64: the kernel's own roundings (with RoPE) and the
# query, key and value inputs rounded to the dtype once each.
DEPTH_DENSE_VS_SDPA = DEPTH_ATTENTION_ROPE + 3
# Against FlexAttention on the same inputs and block mask (pre-rotated keys): both kernels round P and the output.
DEPTH_VS_FLEX = 4


def run(kernel, q, k, v, ptr, idx, block_valid, block_offset, inv_freq, out):
    """One call of the tl kernel (its default config at block 128) or the Gluon kernel, into out."""
    args = (q, k, v, ptr, idx, block_valid, block_offset, inv_freq)
    if kernel == "gluon":
        return sm90.launch(*args, scale=SCALE, out=out)
    return tlk.launch(*args, scale=SCALE, block=BLOCK, out=out)


def slot_positions(lay):
    """Per physical slot: (segment-local position, logical position), -1 on padding; int64 [NB * block] each."""
    local = torch.full((lay.n_slots,), -1, dtype=torch.long, device=lay.device)
    pos = local.clone()
    local[lay.token_phys] = lay.token_local_pos
    pos[lay.token_phys] = lay.token_logical_pos
    return local, pos


def delta_stats(ptr, idx, offset):
    """Fractions of the listed tiles with delta == 0 and with a nonzero delta differing from the row's previous
    entry (a cos/sin recompute), over all heads. ptr, idx: CSR; offset: block_offset."""
    nb = offset.numel()
    counts = (ptr[1:] - ptr[:-1]).long()
    rows = torch.repeat_interleave(torch.arange(counts.numel(), device=idx.device), counts)
    delta = offset[idx.long()].long() - offset[rows % nb].long()
    prev_same = torch.zeros_like(delta, dtype=torch.bool)
    prev_same[1:] = (rows[1:] == rows[:-1]) & (delta[1:] == delta[:-1])
    n = max(delta.numel(), 1)
    return dict(delta0=(delta == 0).sum().item() / n, trig_recompute=((delta != 0) & ~prev_same).sum().item() / n)


def csr(mask):
    """bool [H, NB, NB] -> indptr int32 [H*NB+1], indices int32 (ascending per row)."""
    counts = mask.flatten(0, 1).sum(1)
    indptr = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=mask.device)
    indptr[1:] = counts.cumsum(0)
    return indptr, mask.flatten(0, 1).nonzero()[:, 1].to(torch.int32)


def mask_a_layout(L):
    """One request of L tokens: documents of 2048 tokens (the last one shorter) and a 512-token query."""
    n_full, rest = divmod(L - 512, 2048)
    docs = [2048] * n_full + ([rest] if rest else [])
    return build_layout([[("doc", n) for n in docs] + [("query", 512)]], BLOCK, device=DEV)


def mask_a(lay, gen, hq=None):
    """Mask (a) over a `mask_a_layout`: docs attend 30% of own lower-triangle blocks + own first block + diagonal,
    6% of earlier docs' blocks + the sequence's first block; query rows dense causal. -> bool [hq, NB, NB]."""
    seg = lay.block_segment.long()
    nb = seg.numel()
    ar = torch.arange(nb, device=DEV)
    causal = ar[None, :] <= ar[:, None]
    same = seg[:, None] == seg[None, :]
    seg_first = lay.seg_first_block.long()[seg]
    own_first = same & (ar[None, :] == seg_first[:, None])
    r = torch.rand(hq or HQ, nb, nb, device=DEV, generator=gen)
    doc = ((same & causal & (r < 0.30)) | own_first | (ar[None, :] == ar[:, None]) | (ar[None, :] == 0)
           | ((seg[None, :] < seg[:, None]) & (r < 0.06)))
    query_row = (lay.block_kind == QUERY)[:, None]
    return torch.where(query_row, causal, doc & causal)


def segments_case(hq, hkv, n_first, dtype, gen):
    """Many short segments (not multiples of 128) in two requests, the second placed at logical position 70,000
    (offsets past 65,535); NaN in every padding slot of q / k / v; a random 40% causal block mask per head plus
    the diagonal. -> (layout, block_offset, q, k, v, mask [hq, NB, NB])."""
    rng = torch.Generator().manual_seed(1)
    segs = [torch.randint(1, 400, (n_first,), generator=rng).tolist(), torch.randint(1, 300, (6,), generator=rng).tolist()]
    lay = build_layout([[("doc", n) for n in s] for s in segs], BLOCK, device=DEV)
    block_offset = (lay.block_offset + 70_000 * lay.block_request).to(torch.int32)
    nb, n = lay.n_blocks, lay.n_slots
    q = torch.randn(hq, n, D, device=DEV, dtype=dtype, generator=gen)
    k = torch.randn(hkv, n, D, device=DEV, dtype=dtype, generator=gen)
    v = torch.randn(hkv, n, D, device=DEV, dtype=dtype, generator=gen)
    pad = slot_positions(lay)[0] < 0
    for x in (q, k, v):
        x[:, pad] = float("nan")
    ar = torch.arange(nb, device=DEV)
    req = lay.block_request
    causal = (ar[None, :] <= ar[:, None]) & (req[:, None] == req[None, :])
    mask = (torch.rand(hq, nb, nb, device=DEV, generator=gen) < 0.4) & causal
    mask |= torch.eye(nb, dtype=torch.bool, device=DEV)
    return lay, block_offset, q, k, v, mask


def blocks(x):
    """[H, n_slots, D] -> [H, n_slots / BLOCK, BLOCK, D]: the (head, query block) groups a gate is checked per."""
    return x.unflatten(1, (-1, BLOCK))


def rope_freq():
    return 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32, device=DEV) / D))


def correctness(checks: Checks):
    gen = torch.Generator(device=DEV).manual_seed(0)
    inv_freq = rope_freq()
    hq, hkv = (2, 1) if SMOKE else (8, 2)
    lay, offset, q, k, v, mask = segments_case(hq, hkv, 3 if SMOKE else 30, DTYPE, gen)
    args = (*csr(mask), lay.block_valid, offset)
    for rope in (True, False):
        f = inv_freq if rope else None
        ref = sa.sparse_attention_ref(q, k, v, *args, f, scale=SCALE, block=BLOCK)
        for kernel in KERNELS:
            out = run(kernel, q, k, v, *args, f, torch.full_like(q, float("nan")))
            checks.close(f"twin/{kernel}/{'rope' if rope else 'none'}", blocks(out), blocks(ref), DTYPE,
                         DEPTH_ATTENTION_ROPE if rope else DEPTH_ATTENTION, group_dims=2)
    # Dense path == dense causal SDPA (fp32) on each request's unsegmented prompt at logical positions.
    segs = [[30, 200, 129, 1], [77, 300]] if SMOKE else [[300, 2047, 129, 1, 555, 1000, 260], [77, 3001, 128, 500]]
    lay = build_layout([[("doc", n) for n in s] for s in segs], BLOCK, device=DEV)
    nb, n = lay.n_blocks, lay.n_slots
    q_raw = torch.randn(HQ, n, D, device=DEV, generator=gen)
    k_raw = torch.randn(HKV, n, D, device=DEV, generator=gen)
    v = torch.randn(HKV, n, D, device=DEV, dtype=DTYPE, generator=gen)
    local, pos = slot_positions(lay)
    loc, lpos = local.clamp(min=0), pos.clamp(min=0)
    q = apply_rope_ref(q_raw, loc, inv_freq).to(DTYPE)
    k = apply_rope_ref(k_raw, loc, inv_freq).to(DTYPE)
    ar = torch.arange(nb, device=DEV)
    req = lay.block_request
    mask = ((ar[None, :] <= ar[:, None]) & (req[:, None] == req[None, :])).expand(HQ, nb, nb)
    out = sa.sparse_attention(q, k, v, *csr(mask), lay.block_valid, lay.block_offset, inv_freq, scale=SCALE,
                              block=BLOCK)
    req_of_slot = req.long().repeat_interleave(BLOCK)
    for r in range(len(segs)):
        slots = ((req_of_slot == r) & (pos >= 0)).nonzero()[:, 0]
        slots = slots[pos[slots].argsort()]
        ql = apply_rope_ref(apply_rope_ref(q[:, slots].double(), -loc[slots], inv_freq), lpos[slots], inv_freq)
        kl = apply_rope_ref(apply_rope_ref(k[:, slots].double(), -loc[slots], inv_freq), lpos[slots], inv_freq)
        ref = torch.nn.functional.scaled_dot_product_attention(
            ql.float()[None], kl.float().repeat_interleave(HQ // HKV, 0)[None],
            v[:, slots].float().repeat_interleave(HQ // HKV, 0)[None], is_causal=True, scale=SCALE)[0]
        checks.close(f"dense_vs_sdpa/request{r}", out[:, slots], ref, DTYPE, DEPTH_DENSE_VS_SDPA, group_dims=1)


def bench(fn):
    if SMOKE:
        fn()
        return float("nan")
    return gpu_ms(fn)


def flex_block_mask(mask, nb):
    """FlexAttention's BlockMask of `mask`: non-diagonal blocks as full blocks, the diagonal causal."""
    from torch.nn.attention.flex_attention import BlockMask

    ar = torch.arange(nb, device=DEV)
    full = mask & ~torch.eye(nb, dtype=torch.bool, device=DEV)
    full_num = full.sum(-1).to(torch.int32)[None]
    full_idx = torch.sort(full.to(torch.int8), dim=-1, descending=True, stable=True).indices.to(torch.int32)[None]
    part_num = torch.ones(1, HQ, nb, dtype=torch.int32, device=DEV)
    part_idx = ar.to(torch.int32).view(1, 1, nb, 1).expand(1, HQ, nb, nb).contiguous()

    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    if SMOKE:  # eager FlexAttention (CPU) applies mask_mod to every block and ignores the block lists
        def causal_mod(b, h, q_idx, kv_idx):  # noqa: F811
            return (q_idx >= kv_idx) & mask[h, q_idx // BLOCK, kv_idx // BLOCK]

    return BlockMask.from_kv_blocks(part_num, part_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=causal_mod)


def mask_case(kind, L, gen):
    """-> (block_valid, block_offset, bool mask [HQ, NB, NB]) of mask (a) or (b) at L tokens."""
    if kind == "a":
        lay = mask_a_layout(L)
        return lay.block_valid, lay.block_offset, mask_a(lay, gen)
    from masks import dense_mask, real_mask

    rm = real_mask(L, HQ, DEV)
    return rm.layout.block_valid, rm.layout.block_offset, dense_mask(rm, HQ)


def time_mask(kind, L, rounds, gen, flex, checks: Checks):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    inv_freq = rope_freq()
    nb = L // BLOCK
    block_valid, block_offset, mask = mask_case(kind, L, gen)
    assert mask.shape[-1] == nb, (mask.shape, nb)
    ar = torch.arange(nb, device=DEV)
    causal = (ar[None, :] <= ar[:, None]).expand(HQ, nb, nb)
    q = torch.randn(HQ, L, D, device=DEV, dtype=DTYPE, generator=gen)
    k = torch.randn(HKV, L, D, device=DEV, dtype=DTYPE, generator=gen)
    v = torch.randn(HKV, L, D, device=DEV, dtype=DTYPE, generator=gen)
    out = torch.empty_like(q)
    tiles = mask.sum().item()
    diag = HQ * nb
    cells = (tiles - diag) * BLOCK * BLOCK + diag * BLOCK * (BLOCK + 1) // 2  # all heads
    dense_cells = HQ * L * (L + 1) // 2
    row = dict(mask=kind, L=L, tiles=tiles, tile_fraction=tiles / (HQ * nb * (nb + 1) // 2), cells=cells,
               dense_cells=dense_cells)
    sp, de = csr(mask), csr(causal)
    row["delta_stats"] = delta_stats(*sp, block_offset)

    def record(key, ms, c):  # the minimum median over the interleaved rounds
        if key not in row or ms < row[key]["ms"]:
            row[key] = dict(ms=ms, tflops=4 * D * c / ms / 1e9)

    bm = flex_block_mask(mask, nb)
    q4, k4, v4 = q[None], k[None], v[None]
    kx, vx = k.repeat_interleave(HQ // HKV, 0)[None], v.repeat_interleave(HQ // HKV, 0)[None]
    for _ in range(rounds):
        for kernel in KERNELS:
            for tag, (ptr, idx), f in (("sparse_rope", sp, inv_freq), ("sparse_none", sp, None),
                                       ("dense_rope", de, inv_freq)):
                if tag == "dense_rope" and kind != "a":  # dense: mask-independent
                    continue
                fn = lambda: run(kernel, q, k, v, ptr, idx, block_valid, block_offset, f, out)  # noqa: E731
                record(f"{tag}/{kernel}", bench(fn), cells if tag.startswith("sparse") else dense_cells)
        try:
            if "flex_vs_ours_rel" not in row:
                fo = flex(q4, k4, v4, block_mask=bm, enable_gqa=True, scale=SCALE)
                ours = sa.sparse_attention(q, k, v, *sp, block_valid, block_offset, None, scale=SCALE, block=BLOCK)
                row["flex_vs_ours_rel"] = relative_error(blocks(ours), blocks(fo[0]), group_dims=2)
                checks.close(f"flex_vs_ours/{kind}/{L}", blocks(ours), blocks(fo[0]), DTYPE, DEPTH_VS_FLEX,
                             group_dims=2)
            record("flex_sparse", bench(lambda: flex(q4, k4, v4, block_mask=bm, enable_gqa=True, scale=SCALE)),
                   cells)
        except Exception as e:  # recorded, not fatal: FlexAttention is a baseline
            row["error/flex"] = repr(e)[:300]
        for tag, backend in (("cudnn_dense", SDPBackend.CUDNN_ATTENTION), ("flash_dense", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q4, kx, vx, is_causal=True)  # noqa
                    record(tag, bench(fn), dense_cells)
            except Exception as e:  # a backend this GPU / build lacks is recorded, not fatal
                row[f"error/{tag}"] = repr(e)[:300]
    return row


def timings(results, lengths, masks, rounds, checks: Checks):
    from torch.nn.attention.flex_attention import flex_attention

    flex = flex_attention if SMOKE else torch.compile(flex_attention, dynamic=False)
    gen = torch.Generator(device=DEV).manual_seed(1)
    rows = []
    for kind in masks:
        for L in lengths:
            rows.append(time_mask(kind, L, 1 if SMOKE else rounds, gen, flex, checks))
            print(json.dumps(rows[-1]))
            if not SMOKE:
                torch.cuda.empty_cache()
    results["timings"] = rows


def summary(results):
    print("\nRoPE overhead: sparse+rope ms (vs the same kernel pre-rotated). d0% = tiles with delta == 0, trig% = "
          "tiles that recompute cos/sin")
    print("     L tiles%   d0% trig% | " + " | ".join(f"{n:>19s}" for n in KERNELS))
    for row in results["timings"]:
        cells = []
        for n in KERNELS:
            r, z = row.get(f"sparse_rope/{n}", {}).get("ms"), row.get(f"sparse_none/{n}", {}).get("ms")
            cells.append(f"{r:8.3f} ({100 * (r / z - 1):+6.1f}%)" if r and z else f"{'n/a':>19s}")
        ds = row["delta_stats"]
        print(f"{row['mask']} {row['L']:6d} {100 * row['tile_fraction']:6.1f} {100 * ds['delta0']:5.1f} "
              f"{100 * ds['trig_recompute']:5.1f} | " + " | ".join(cells))
    print("\n     L tiles% | " + " | ".join(f"{k:>12s}" for k in ("dense/" + KERNELS[-1], "flex", "cudnn", "flash")))
    for row in results["timings"]:
        g = lambda key: row.get(key, {}).get("ms", float("nan"))  # noqa: E731
        print(f"{row['mask']} {row['L']:6d} {100 * row['tile_fraction']:6.1f} | "
              + " | ".join(f"{g(k):12.3f}" for k in (f"dense_rope/{KERNELS[-1]}", "flex_sparse", "cudnn_dense",
                                                      "flash_dense")))


def main():
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16384,32768,65536", help="context lengths (tokens), comma-separated")
    ap.add_argument("--masks", default="a,b", help="masks to time: a (generated), b (real SmolLM2 bits)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every timing; the minimum is kept")
    args = ap.parse_args()
    lengths = [1024] if SMOKE else [int(x) for x in args.lengths.split(",")]
    results = dict(shapes=dict(B=1, Hq=HQ, Hkv=HKV, D=D, dtype=str(DTYPE).removeprefix("torch."), block=BLOCK),
                   kernels=list(KERNELS), rounds=args.rounds)
    t0 = time.time()
    checks = Checks()
    try:
        correctness(checks)
        if checks.ok:  # a kernel that computes something else is not timed
            timings(results, lengths, [m for m in args.masks.split(",") if m], args.rounds, checks)
    finally:
        results["wall_s"] = round(time.time() - t0, 1)
        results["checks"] = checks.to_json()
        results["ok"] = checks.ok
        write_result("attention", results, out_dir(args))
    if "timings" in results:
        summary(results)
    raise SystemExit(checks.exit_status())


if __name__ == "__main__":
    main()
