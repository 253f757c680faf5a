"""GPU check of the Gluon Hopper kernel (kernels/sparse_attention_sm90.py): correctness against the ref twin and
the tl kernel, then a short timing of mask (a) or (b) with the RoPE overhead timed in pairs; writes
bench/results/check-sm90.json (mask b: check-sm90-mask-b.json).

    timeout 300 python bench/check_sm90.py [--lengths 16384,32768,65536] [--mask a] [--pairs 7] [--rounds 2]

Needs an sm_90 GPU; run it under `timeout` (a barrier bug hangs rather than fails). Exit status 1 after writing
the result if a check failed: each output's relative error per (head, query block) within c * u * sqrt(depth) of
the reference (bench/common.py `Checks`, the depths of bench_attention.py). Checks: the padded layout
(many short segments, NaN in padding, offsets past 65,535, an empty row, GQA 4) with and without RoPE; K / V as
the first slots of longer per-head buffers (the engine's cache); q and out in token order (the engine's call);
a subset of query blocks (q_blocks, a reuse prefill's call), padded and in token order, other rows untouched,
and with K / V read in place from a token-major pool of shuffled pages (kv_pages);
mask (a) at 16K against the tl kernel. Timings per length: both kernels with RoPE (sparse_rope), pre-rotated
(sparse_none) and dense causal (dense_rope); the Gluon kernel's RoPE overhead as PAIRS pairs timed A B B A as CUDA
graph replays (GPU time; a drift of the clocks over a pair cancels), the median of the per-pair ratios kept; the
host time of one call; the key pass alone; cuDNN dense causal; a reuse prefill's attention (4 query blocks over
every key block) reading the pool's pages in place against gathering them first.
"""
from __future__ import annotations

import json
import time

from common import Checks, parser, write_result

import torch  # noqa: E402
import triton.testing  # noqa: E402

from bench_attention import (BLOCK, D, DEPTH_ATTENTION, DEPTH_ATTENTION_ROPE, blocks, csr, mask_a,  # noqa: E402
                             mask_a_layout, rope_freq, run, segments_case)
from sift.kernels import sparse_attention as sa  # noqa: E402
from sift.kernels import sparse_attention_sm90 as sm90  # noqa: E402
from sift.kernels.rope import rotate_key_blocks  # noqa: E402

SCALE = D ** -0.5
CHECKS = Checks()
# Two kernels on the same bf16 inputs, each with its own roundings (gluon against tl).
DEPTH_TWO_KERNELS = 2 * DEPTH_ATTENTION_ROPE


def abba(row, tag, time_a, time_b, pairs):
    """`pairs` pairs timed in the order A B B A: row[tag + "_paired"] = the median of the per-pair ratios
    (A1 + A2) / (B1 + B2) - 1, row[tag + "_pairs"] = all of them."""
    ratios = []
    for _ in range(pairs):
        a = time_a()
        b = time_b() + time_b()
        ratios.append((a + time_a()) / b)
    row[f"{tag}_paired"] = round(sorted(ratios)[len(ratios) // 2] - 1, 4)
    row[f"{tag}_pairs"] = [round(r - 1, 4) for r in ratios]


def check(name, out, ref, depth=DEPTH_ATTENTION_ROPE):
    """bf16 out against ref, both [H, n, D]: per (head, query block) where n is the padded layout's slots, per
    (head, token) where the rows are tokens in order."""
    if out.shape[1] % BLOCK:
        return CHECKS.close(name, out, ref, torch.bfloat16, depth, group_dims=2)
    return CHECKS.close(name, blocks(out), blocks(ref), torch.bfloat16, depth, group_dims=2)


def gluon(q, k, v, ptr, idx, block_valid, block_offset, inv_freq, out, q_block_start=None, q_blocks=None,
          kv_pages=None):
    torch.cuda.synchronize()
    sm90.launch(q, k, v, ptr, idx, block_valid, block_offset, inv_freq, scale=SCALE, out=out,
                q_block_start=q_block_start, q_blocks=q_blocks, kv_pages=kv_pages)
    torch.cuda.synchronize()
    return out


def correctness() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    inv_freq = rope_freq()
    # 1. Padded layout, many short segments, NaN in padding, offsets past 65,535, GQA 4, random mask.
    hq, hkv = 8, 2
    lay, offset, q, k, v, mask = segments_case(hq, hkv, 30, torch.bfloat16, gen)
    mask[1, 5] = False   # one empty row: output must be 0
    args = (*csr(mask), lay.block_valid, offset)
    refs = {rope: sa.sparse_attention_ref(q, k, v, *args, inv_freq if rope else None, scale=SCALE, block=BLOCK)
            for rope in (True, False)}
    for rope, ref in refs.items():
        out = gluon(q, k, v, *args, inv_freq if rope else None, torch.full_like(q, float("nan")))
        check(f"padded/{'rope' if rope else 'none'}", out, ref, DEPTH_ATTENTION_ROPE if rope else DEPTH_ATTENTION)
    # 1b. K / V as the first slots of longer per-head buffers (the engine's cache with room for generated tokens),
    # NaN in the rest: the TMA views step heads by the buffer's row pitch.
    n_slots = k.shape[1]
    k_big = torch.full((hkv, n_slots + 3 * BLOCK, D), float("nan"), device="cuda", dtype=k.dtype)
    v_big = torch.full_like(k_big, float("nan"))
    k_big[:, :n_slots], v_big[:, :n_slots] = k, v
    takes = sm90.supports(q, k_big[:, :n_slots], v_big[:, :n_slots], BLOCK, None)
    CHECKS.true("pitched_kv taken by the Gluon kernel", takes)
    for rope, ref in refs.items():
        out = gluon(q, k_big[:, :n_slots], v_big[:, :n_slots], *args, inv_freq if rope else None,
                    torch.full_like(q, float("nan")))
        check(f"pitched_kv/{'rope' if rope else 'none'}", out, ref, DEPTH_ATTENTION_ROPE if rope else DEPTH_ATTENTION)
    # 2. Token order: q the transpose view of an [n_tok, Hq, D] buffer, out likewise (the engine's layout).
    valid = lay.block_valid.long()
    tok_start = torch.zeros(lay.n_blocks, dtype=torch.int32, device="cuda")
    tok_start[1:] = valid.cumsum(0)[:-1].to(torch.int32)
    real = torch.zeros(n_slots, dtype=torch.bool, device="cuda")
    real[lay.token_phys] = True
    q_tok = q[:, real].transpose(0, 1).contiguous()
    out_tok = torch.full((q_tok.shape[0], hq, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    gluon(q_tok.transpose(0, 1), k, v, *args, inv_freq, out_tok.transpose(0, 1), q_block_start=tok_start)
    check("token_order/rope", out_tok.transpose(0, 1), refs[True][:, real])
    check_q_blocks(lay, q, k, v, mask, offset, real, refs[True], inv_freq)
    # 3. Bigger: mask (a) at 16K, GQA 4, against the tl kernel (bf16 both).
    lay = mask_a_layout(16384)
    sp = csr(mask_a(lay, gen, hq=32))
    q, k, v = (torch.randn(h, 16384, D, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (32, 8, 8))
    lv = (lay.block_valid, lay.block_offset)
    o_t = run("tl", q, k, v, *sp, *lv, inv_freq, torch.empty_like(q))
    o_g = gluon(q, k, v, *sp, *lv, inv_freq, torch.empty_like(q))
    check("mask_a16k/gluon_vs_tl", o_g, o_t, DEPTH_TWO_KERNELS)


def check_q_blocks(lay, q, k, v, mask, offset, real, ref, inv_freq) -> None:
    """Every third query block and the last (q_blocks), CSR rows of those only: the computed rows equal the full
    CSR's reference `ref`, the others keep the NaN written before; padded, then q / out in token order (the
    computed blocks' tokens only, q_block_start of the other blocks garbage)."""
    nb = lay.n_blocks
    q_blocks = torch.cat([torch.arange(0, nb - 1, 3, device="cuda"), torch.tensor([nb - 1], device="cuda")])
    q_blocks = q_blocks.to(torch.int32)
    computed = torch.zeros(nb, dtype=torch.bool, device="cuda")
    computed[q_blocks.long()] = True
    rows = computed.repeat_interleave(BLOCK)
    args = (*csr(mask[:, q_blocks.long()]), lay.block_valid, offset, inv_freq)
    out = gluon(q, k, v, *args, torch.full_like(q, float("nan")), q_blocks=q_blocks)
    check("q_blocks/padded", out[:, rows], ref[:, rows])
    CHECKS.true("q_blocks/padded other rows untouched", bool(out[:, ~rows].isnan().all()))
    sel = real & rows
    counts = torch.where(computed, lay.block_valid, 0)
    tok_start = torch.where(computed, counts.cumsum(0) - counts, 1 << 30).to(torch.int32)
    q_tok = q[:, sel].transpose(0, 1).contiguous()
    out_tok = torch.full_like(q_tok, float("nan"))
    gluon(q_tok.transpose(0, 1), k, v, *args, out_tok.transpose(0, 1), q_block_start=tok_start, q_blocks=q_blocks)
    check("q_blocks/token_order", out_tok.transpose(0, 1), ref[:, sel])
    # The reuse prefill's call: K / V read in place from a token-major pool (the KV store's layer), the blocks at
    # shuffled pages among pages of NaN (kv_pages).
    k_pool, v_pool, pages = paged_pool(k, v)
    takes = sm90.supports(q_tok.transpose(0, 1), k_pool, v_pool, BLOCK, None)
    CHECKS.true("kv_pages taken by the Gluon kernel", takes)
    out_tok = torch.full_like(q_tok, float("nan"))
    gluon(q_tok.transpose(0, 1), k_pool, v_pool, *args, out_tok.transpose(0, 1), q_block_start=tok_start,
          q_blocks=q_blocks, kv_pages=pages)
    check("kv_pages/q_blocks/token_order", out_tok.transpose(0, 1), ref[:, sel])
    out = gluon(q, k_pool, v_pool, *csr(mask), lay.block_valid, offset, None, torch.full_like(q, float("nan")),
                kv_pages=pages)   # pre-rotated keys: K read from its pages too
    want = sa.sparse_attention_ref(q, k, v, *csr(mask), lay.block_valid, offset, None, scale=SCALE, block=BLOCK)
    check("kv_pages/padded/none", out, want, DEPTH_ATTENTION)


def paged_pool(k, v, spare: int = 7):
    """k, v [Hkv, NB * BLOCK, D] -> token-major pools [Hkv, slots, D] (views of [slots, Hkv, D]) holding the blocks
    at shuffled pages among `spare` pages of NaN, and kv_pages int32 [NB]."""
    hkv, n, _ = k.shape
    nb = n // BLOCK
    pages = torch.randperm(nb + spare, device=k.device)[:nb]
    pools = []
    for x in (k, v):
        pool = torch.full(((nb + spare) * BLOCK, hkv, D), float("nan"), dtype=x.dtype, device=x.device)
        pool.view(nb + spare, BLOCK, hkv, D)[pages] = x.transpose(0, 1).reshape(nb, BLOCK, hkv, D)
        pools.append(pool.transpose(0, 1))
    return pools[0], pools[1], pages.to(torch.int32)


def time_reuse_call(L, gen) -> dict:
    """A reuse prefill's attention at L tokens: 4 query blocks (512 tokens, token order) over every key block, K / V
    in a token-major pool at shuffled pages. Read in place (kv_pages: the key pass gathers K, the kernel reads V's
    pages) against gathering both into head-major logical order first (one index_select each, then the kernel
    on contiguous K / V). Median ms."""
    inv_freq = rope_freq()
    nb = L // BLOCK
    lay = mask_a_layout(L)
    q_blocks = torch.arange(nb - 4, nb, device="cuda", dtype=torch.int32)
    rows = csr(torch.ones(32, 4, nb, dtype=torch.bool, device="cuda").tril(nb - 4))
    k, v = (torch.randn(8, L, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    k_pool, v_pool, pages = paged_pool(k, v)
    q = torch.randn(4 * BLOCK, 32, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty_like(q)
    start = torch.full((nb,), 1 << 30, dtype=torch.int32, device="cuda")
    start[nb - 4:] = torch.arange(4, device="cuda", dtype=torch.int32) * BLOCK
    common_args = dict(scale=SCALE, out=out.transpose(0, 1), q_block_start=start, q_blocks=q_blocks)
    lv = (lay.block_valid, lay.block_offset, inv_freq)

    def in_place():
        sm90.launch(q.transpose(0, 1), k_pool, v_pool, *rows, *lv, kv_pages=pages, **common_args)

    def gathered():
        kg = k_pool.unflatten(1, (-1, BLOCK)).index_select(1, pages.long()).flatten(1, 2).contiguous()
        vg = v_pool.unflatten(1, (-1, BLOCK)).index_select(1, pages.long()).flatten(1, 2).contiguous()
        sm90.launch(q.transpose(0, 1), kg, vg, *rows, *lv, **common_args)

    in_place()
    ref = out.clone()
    gathered()
    # The same kernel on the same values, only read from other addresses: one rounding's worth at most.
    same = check(f"reuse_call_{L}/in_place_vs_gathered", ref.transpose(0, 1), out.transpose(0, 1), depth=1)
    ms = {name: round(triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median"), 4)
          for name, f in (("in_place", in_place), ("gathered", gathered))}
    return dict(L=L, reuse_call_ms=ms, same=same)


def layer(kind, L, gen):
    """-> (block_valid, block_offset, bool mask [32, NB, NB]) of mask (a) or (b) at L tokens."""
    if kind == "b":
        from masks import dense_mask, real_mask

        rm = real_mask(L, 32, "cuda")
        return rm.layout.block_valid, rm.layout.block_offset, dense_mask(rm, 32)
    lay = mask_a_layout(L)
    return lay.block_valid, lay.block_offset, mask_a(lay, gen, hq=32)


def time_length(kind, L, rounds, pairs, gen):
    inv_freq = rope_freq()
    nb = L // BLOCK
    block_valid, block_offset, m = layer(kind, L, gen)
    sp = csr(m)
    ar = torch.arange(nb, device="cuda")
    de = csr((ar[None, :] <= ar[:, None]).expand(32, nb, nb))
    q, k, v = (torch.randn(h, L, D, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (32, 8, 8))
    out = torch.empty_like(q)
    lv = (block_valid, block_offset)
    row = dict(mask=kind, L=L, tile_fraction=m.sum().item() / (32 * nb * (nb + 1) // 2))

    def call(kernel, f, rows=sp):
        """One attention call over the CSR `rows` (f: inv_freq, or None for pre-rotated keys)."""
        return lambda: run(kernel, q, k, v, *rows, *lv, f, out)

    for _ in range(rounds):  # interleaved rounds, the minimum of the medians is kept
        for kernel in ("tl", "gluon"):
            for tag, rows, f in (("sparse_rope", sp, inv_freq), ("sparse_none", sp, None), ("dense_rope", de, inv_freq)):
                if kernel == "tl" and tag == "dense_rope":
                    continue
                ms = round(triton.testing.do_bench(call(kernel, f, rows), warmup=25, rep=100, return_mode="median"), 4)
                row[f"{kernel}/{tag}"] = min(ms, row.get(f"{kernel}/{tag}", ms))

    def graph_ms(f):
        return triton.testing.do_bench_cudagraph(call("gluon", f), rep=50, return_mode="median")

    abba(row, "gluon/rope_overhead_graph", lambda: graph_ms(inv_freq), lambda: graph_ms(None), pairs)
    for f in (inv_freq, None):   # host time of one call, the GPU kept busy so that nothing waits on it
        fn = call("gluon", f)
        torch.cuda._sleep(200_000_000)   # ~0.1 s
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        row[f"gluon/host_us_{'none' if f is None else 'rope'}"] = round((time.perf_counter() - t0) / 20 * 1e6, 1)
        torch.cuda.synchronize()
    kbuf = torch.empty_like(k)
    row["rotate_key_pass"] = round(triton.testing.do_bench(
        lambda: rotate_key_blocks(k, block_offset, inv_freq, block=BLOCK, out=kbuf), warmup=25, rep=100,
        return_mode="median"), 4)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kx, vx = k.repeat_interleave(4, 0)[None], v.repeat_interleave(4, 0)[None]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        row["cudnn_dense"] = round(triton.testing.do_bench(
            lambda: torch.nn.functional.scaled_dot_product_attention(q[None], kx, vx, is_causal=True),
            warmup=25, rep=100, return_mode="median"), 4)
    return row


def main():
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16384,32768,65536", help="context lengths (tokens), comma-separated")
    ap.add_argument("--mask", choices=("a", "b"), default="a", help="timed mask: a (generated), b (real bits)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds; the minimum is kept")
    ap.add_argument("--pairs", type=int, default=7, help="A B B A pairs of the RoPE-overhead timing")
    args = ap.parse_args()
    if args.smoke or not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("check_sm90.py checks the Gluon kernel: it needs an sm_90 GPU (no --smoke mode)")
    correctness()
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for L in [int(x) for x in args.lengths.split(",")]:
        rows.append(time_length(args.mask, L, args.rounds, args.pairs, gen))
        print(json.dumps(rows[-1]), flush=True)
        rows[-1]["reuse_call"] = time_reuse_call(L, gen)
        print(json.dumps(rows[-1]["reuse_call"]), flush=True)
        torch.cuda.empty_cache()
    write_result("check-sm90" if args.mask == "a" else f"check-sm90-mask-{args.mask}",
                 dict(ok=CHECKS.ok, checks=CHECKS.to_json(),
                      settings=dict(mask=args.mask, rounds=args.rounds, pairs=args.pairs, pair_order="ABBA"),
                      timings=rows), args.out)
    raise SystemExit(CHECKS.exit_status())


if __name__ == "__main__":
    main()
