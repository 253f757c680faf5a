"""Quick H200 check of the Gluon Hopper kernel (kernels/sparse_attention_sm90.py) against the torch twin and the tl
kernel, then a short timing of mask (a) (MASK=b: mask (b)): the tl kernel, the Gluon kernel with each K ring depth
of K_STAGES, the RoPE overhead in pairs (event-timed and as CUDA graph replays, i.e. GPU time only; in full and
with the key pass skipped, the Q rotation's share), the host time of one call, with PREV_KERNEL this kernel against
that one in pairs (GPU time), the key pass alone and cuDNN dense. Meant to run under `timeout` (a barrier bug hangs
rather than fails).

    K_STAGES=3,2 PAIRS=7 [TIMERS=graph] [MASK=b] [PREV_KERNEL=/tmp/prev.py] PYTHONUNBUFFERED=1 timeout 300 \
        python3 bench/check_sm90.py [16384,32768,65536]
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402
from bench_attention import BLOCK, D, DEV, csr, layout_from_segments, mask_a, rel_err, sa, segments_case  # noqa: E402

GLUON = sa.KernelConfig(block_n=128, num_warps=4, num_stages=2, rope_on="pre", backend="gluon")
TL = sa.KernelConfig(block_n=128, num_warps=8, num_stages=2, rope_on="pre", pre_via_out=True)
# Tile orders (band, sec, dynamic) of the persistent kernel: "-" = NB (one band) / Hkv (all heads together).
ORDERS = [(None if b == "-" else int(b), None if c == "-" else int(c), d == "1")
          for b, c, d in (o.split("/") for o in os.environ.get("ORDERS", "-/1/1").split(";"))]
K_STAGES = [int(x) for x in os.environ.get("K_STAGES", "3").split(",")]   # K ring depths to time
ROUNDS = int(os.environ.get("ROUNDS", "2"))
PAIRS = int(os.environ.get("PAIRS", "7"))
# A second kernel module to time in the same run (e.g. the previous commit's, `git show
# HEAD~1:kernels/sparse_attention_sm90.py > /tmp/prev.py`): its `launch` replaces sm90.launch for variant "prev".
PREV_KERNEL = os.environ.get("PREV_KERNEL")
TIMERS = os.environ.get("TIMERS", "events,graph").split(",")   # how the RoPE-overhead pairs are timed
MASK = os.environ.get("MASK", "a")   # timed mask: "a" (the anchor generator) or "b" (real SmolLM2 bits, masks.py)
if MASK not in ("a", "b"):
    raise SystemExit(f"MASK={MASK!r}: use MASK=a (the anchor generator) or MASK=b (real SmolLM2 bits)")


@functools.lru_cache(maxsize=1)
def _prev_launch():
    from _checkout import load_file
    return load_file(PREV_KERNEL, "sm90_prev").launch


def abba(row, tag, time_a, time_b):
    """PAIRS pairs timed in the order A B B A (a drift of the clocks over a pair cancels): row[tag + "_paired"] =
    the median of the per-pair ratios (A1 + A2) / (B1 + B2) - 1, row[tag + "_pairs"] = all of them."""
    ratios = []
    for _ in range(PAIRS):
        a = time_a()
        b = time_b() + time_b()
        ratios.append((a + time_a()) / b)
    row[f"{tag}_paired"] = round(sorted(ratios)[len(ratios) // 2] - 1, 4)
    row[f"{tag}_pairs"] = [round(r - 1, 4) for r in ratios]


@contextlib.contextmanager
def launch_with(prev=False, **kw):
    """sm90.launch with these keyword arguments (K ring depth, tile order) while inside; prev: PREV_KERNEL's."""
    import inspect

    from sift.kernels import sparse_attention_sm90 as sm90
    launch = sm90.launch
    base = _prev_launch() if prev else launch
    known = inspect.signature(base).parameters   # an older module may not take every keyword (e.g. cos_sin)
    sm90.launch = lambda *a, **k_: base(*a, **{n: x for n, x in {**k_, **kw}.items() if n in known})
    try:
        yield
    finally:
        sm90.launch = launch


def gluon_variants():
    """(name, config) per K ring depth of K_STAGES, with sm90.launch taking it while iterated."""
    for ks in K_STAGES:
        with launch_with(k_stages=ks):
            yield f"k{ks}", GLUON


def check(name, fn_out, ref, tol=1.5e-2):
    r, m, fin = rel_err(fn_out, ref)
    ok = fin and r < tol
    print(f"check {name:40s} rel {r:.2e} max_abs {m:.2e} {'OK' if ok else 'FAIL'}", flush=True)
    return ok


def main():
    gen = torch.Generator(device=DEV).manual_seed(0)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32, device=DEV) / D))
    ok = True
    # 1. Padded layout, many short segments, NaN in padding, offsets past 65,535, GQA 4, random mask.
    hq, hkv = 8, 2
    lay, q, k, v, mask = segments_case(hq, hkv, 30, torch.bfloat16, gen)
    nb = lay["seg"].numel()
    pad = lay["pos"] < 0
    mask[1, 5] = False   # one empty row: output must be 0
    indptr, indices = csr(mask)
    args = (indptr, indices, lay["block_valid"], lay["block_offset"])
    for rope in (True, False):
        f = inv_freq if rope else None
        ref = sa.sparse_attention_ref(q, k, v, *args, f, scale=D ** -0.5, block=BLOCK)
        for mode, cfg in gluon_variants():
            out = torch.full_like(q, float("nan"))
            sa._launch(q, k, v, *args, f, scale=D ** -0.5, block=BLOCK, out=out, config=cfg)
            torch.cuda.synchronize()
            ok &= check(f"padded/{'rope' if rope else 'none'}/{mode}", out, ref)
    # 1b. K / V as the first slots of longer per-head buffers (the engine's cache with room for generated tokens),
    # NaN in the rest: the TMA views step heads by the buffer's row pitch.
    n_slots = k.shape[1]
    k_big = torch.full((hkv, n_slots + 3 * BLOCK, D), float("nan"), device=DEV, dtype=k.dtype)
    v_big = torch.full_like(k_big, float("nan"))
    k_big[:, :n_slots], v_big[:, :n_slots] = k, v
    from sift.kernels import sparse_attention_sm90 as sm90
    takes = sm90.supports(q, k_big[:, :n_slots], v_big[:, :n_slots], BLOCK, None)
    print(f"check pitched_kv taken by the Gluon kernel: {takes}", flush=True)
    ok &= takes
    for rope in (True, False):
        f = inv_freq if rope else None
        ref = sa.sparse_attention_ref(q, k, v, *args, f, scale=D ** -0.5, block=BLOCK)
        for mode, cfg in gluon_variants():
            out = torch.full_like(q, float("nan"))
            sa._launch(q, k_big[:, :n_slots], v_big[:, :n_slots], *args, f, scale=D ** -0.5, block=BLOCK, out=out,
                       config=cfg)
            torch.cuda.synchronize()
            ok &= check(f"pitched_kv/{'rope' if rope else 'none'}/{mode}", out, ref)
    # 2. Token order: q the transpose view of an [n_tok, Hq, D] buffer, out likewise (the engine's layout).
    valid = lay["block_valid"].long()
    tok_start = torch.zeros(nb, dtype=torch.int32, device=DEV)
    tok_start[1:] = valid.cumsum(0)[:-1].to(torch.int32)
    n_tok = int(valid.sum())
    real = ~pad
    q_tok = torch.empty(n_tok, hq, D, device=DEV, dtype=torch.bfloat16)
    q_tok.copy_(q[:, real].transpose(0, 1))
    ref = sa.sparse_attention_ref(q, k, v, *args, inv_freq, scale=D ** -0.5, block=BLOCK)
    for mode, cfg in gluon_variants():
        out_tok = torch.full((n_tok, hq, D), float("nan"), device=DEV, dtype=torch.bfloat16)
        sa._launch(q_tok.transpose(0, 1), k, v, *args, inv_freq, scale=D ** -0.5, block=BLOCK,
                   out=out_tok.transpose(0, 1), config=cfg, q_block_start=tok_start)
        torch.cuda.synchronize()
        ok &= check(f"token_order/rope/{mode}", out_tok.transpose(0, 1), ref[:, real])
    # 3. Bigger: mask (a) at 16K, GQA 4, against the tl kernel (bf16 both) and the twin on a few heads.
    ba.HQ = 32
    L = 16384
    n_full, rest = divmod(L - 512, 2048)
    lay = layout_from_segments([[2048] * n_full + ([rest] if rest else []) + [512]])
    m = mask_a(lay["seg"], n_full + (1 if rest else 0), gen)
    sp = csr(m)
    q = torch.randn(32, L, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(8, L, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(8, L, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    lv = (lay["block_valid"], lay["block_offset"])
    o_t = sa._launch(q, k, v, *sp, *lv, inv_freq, scale=D ** -0.5, block=BLOCK, out=None, config=TL)
    for mode, cfg in gluon_variants():
        o_g = sa._launch(q, k, v, *sp, *lv, inv_freq, scale=D ** -0.5, block=BLOCK, out=None, config=cfg)
        torch.cuda.synchronize()
        ok &= check(f"mask_a16k/gluon_{mode}_vs_tl", o_g, o_t)
    print("ALL OK" if ok else "SOME FAILED", flush=True)

    lengths = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "16384,32768,65536").split(",")]
    rows = []
    for L in lengths:
        nb = L // BLOCK
        if MASK == "b":   # as bench_attention.py builds it
            from masks import dense_mask, real_mask
            rm = real_mask(L, 32, DEV)
            lay = dict(block_valid=rm.layout.block_valid, block_offset=rm.layout.block_offset)
            m = dense_mask(rm, 32)
        else:
            n_full, rest = divmod(L - 512, 2048)
            docs = [2048] * n_full + ([rest] if rest else [])
            lay = layout_from_segments([docs + [512]])
            m = mask_a(lay["seg"], len(docs), gen)
        sp = csr(m)
        ar = torch.arange(nb, device=DEV)
        de = csr((ar[None, :] <= ar[:, None]).expand(32, nb, nb))
        q = torch.randn(32, L, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        k = torch.randn(8, L, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(8, L, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        out = torch.empty_like(q)
        lv = (lay["block_valid"], lay["block_offset"])
        row = dict(mask=MASK, L=L, tile_fraction=m.sum().item() / (32 * nb * (nb + 1) // 2))
        # Listed blocks of another segment than their query block's (delta != 0): what rotating keys inside the
        # kernel, per (tile, block), would rotate (runs 11-13; the pass rotates every key block once instead).
        rid = torch.repeat_interleave(torch.arange(nb, device=DEV).repeat(32), (sp[0][1:] - sp[0][:-1]).long())
        off = lay["block_offset"]
        row["rotated_fraction"] = round((off[sp[1].long()] != off[rid]).float().mean().item(), 4)
        variants = [("tl", TL, {})] + [
            (f"gluon-k{ks}-b{b}s{c}{'-dyn' if dyn else ''}", GLUON,
             dict(band=b, sec=c, dynamic=dyn, k_stages=ks)) for b, c, dyn in ORDERS for ks in K_STAGES]
        if PREV_KERNEL:
            variants.append(("prev", GLUON, dict(prev=True, k_stages=K_STAGES[0])))
        def call(cfg, f, rows_=sp):
            """One attention call over the CSR `rows_` (f: inv_freq, or None for pre-rotated keys)."""
            return lambda: sa._launch(q, k, v, *rows_, *lv, f, scale=D ** -0.5, block=BLOCK, out=out, config=cfg)

        for _ in range(ROUNDS):  # interleaved rounds, the minimum of the medians is kept
            for name, cfg, kw in variants:
                with launch_with(**kw):
                    for tag, rows_, f in (("sparse_rope", sp, inv_freq), ("sparse_none", sp, None),
                                          ("dense_rope", de, inv_freq)):
                        if name == "tl" and tag == "dense_rope":
                            continue
                        ms = round(triton.testing.do_bench(call(cfg, f, rows_), warmup=25, rep=100,
                                                           return_mode="median"), 4)
                        row[f"{name}/{tag}"] = min(ms, row.get(f"{name}/{tag}", ms))
        # RoPE overhead of each Gluon variant, paired: rope and pre-rotated calls in the order A B B A (a drift
        # of the clocks over the pair cancels), the median of the per-pair ratios (A1 + A2) / (B1 + B2) is kept
        # (single timings of either varied by several percent between runs). "q_only":
        # the same with the key pass skipped (keys left as they are: timing only), the Q rotation's share.
        # "_graph": the same pairs timed as CUDA graph replays (GPU time only: do_bench's events also count the
        # host's launch work when the GPU waits for it, which the pass's second launch exposes).
        rotate_key_blocks = sa._rotate_key_blocks
        for name, cfg, kw in variants[1:]:
            with launch_with(**kw):
                for part, timer in ((p_, t_) for t_ in TIMERS for p_ in ("rope", "q_only")):
                    if part == "q_only":   # keys untouched; the query tiles' cos / sin table still written
                        sa._rotate_key_blocks = lambda k_, bo, f_, bl, o_, cs=None: (
                            k_ if cs is None else (sa.cos_sin_table(bo, f_, out=cs), k_)[1])
                    def timed(f, timer=timer):
                        if timer == "events":
                            return triton.testing.do_bench(call(cfg, f), warmup=10, rep=50, return_mode="median")
                        return triton.testing.do_bench_cudagraph(call(cfg, f), rep=50, return_mode="median")
                    abba(row, f"{name}/{part}_overhead{'_graph' if timer == 'graph' else ''}",
                         lambda: timed(inv_freq), lambda: timed(None))
                    sa._rotate_key_blocks = rotate_key_blocks
                # Host time of one call (the GPU kept busy, so nothing waits on it).
                for f in (inv_freq, None):
                    fn = call(cfg, f)
                    torch.cuda._sleep(200_000_000)   # ~0.1 s
                    t0 = time.perf_counter()
                    for _ in range(20):
                        fn()
                    us = (time.perf_counter() - t0) / 20 * 1e6
                    row[f"{name}/host_us_{'none' if f is None else 'rope'}"] = round(us, 1)
                    torch.cuda.synchronize()
        # This kernel against PREV_KERNEL's, paired the same way (A B B A, GPU time): single timings of either
        # move by several percent between calls, more than the change being judged.
        if PREV_KERNEL:
            for f in (inv_freq, None):
                def timed_vs_prev(prev, f=f):
                    with launch_with(prev=prev, k_stages=K_STAGES[0]):
                        return triton.testing.do_bench_cudagraph(call(GLUON, f), rep=50, return_mode="median")
                abba(row, f"vs_prev_{'none' if f is None else 'rope'}_graph", lambda: timed_vs_prev(False),
                     lambda: timed_vs_prev(True))
        kbuf = torch.empty_like(k)
        row["rotate_key_pass"] = round(triton.testing.do_bench(
            lambda: sa._rotate_key_blocks(k, lay["block_offset"], inv_freq, BLOCK, kbuf), warmup=25, rep=100,
            return_mode="median"), 4)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        kx, vx = k.repeat_interleave(4, 0)[None], v.repeat_interleave(4, 0)[None]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            row["cudnn_dense"] = round(triton.testing.do_bench(
                lambda: torch.nn.functional.scaled_dot_product_attention(q[None], kx, vx, is_causal=True),
                warmup=25, rep=100, return_mode="median"), 4)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, k, v, out, kx, vx
        torch.cuda.empty_cache()
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "check_sm90.json"), "w") as fh:
            settings = {k_: os.environ.get(k_) for k_ in ("K_STAGES", "ORDERS", "ROUNDS", "PAIRS", "PREV_KERNEL",
                                                          "TIMERS", "MASK")}
            settings["pair_order"] = "ABBA"
            json.dump(dict(device=torch.cuda.get_device_name(), settings=settings, lengths=lengths, ok=ok,
                           timings=rows), fh, indent=1)


if __name__ == "__main__":
    main()
