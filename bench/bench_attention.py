"""Check and time the sparse prefill attention kernel on one GPU; writes JSON to $OUT (or bench/results/).

Run on the device machine from the repository root:  PYTHONUNBUFFERED=1 python3 bench/bench_attention.py
(the package need not be installed: a shim maps `kernels/` to `sift.kernels`).

1. Correctness in bf16 against the torch twin (many segments, lengths not multiples of 128, offsets past 65,535,
   NaN in padding, every kernel config that is timed) and, with every causal block listed, against dense causal
   SDPA over the unsegmented prompt.
2. Timings at B=1, Hq=32, Hkv=8, D=128, bf16, L in 16K/32K/64K: mask (a) with in-kernel RoPE, the same without
   RoPE (pre-rotated keys), every causal block (dense path), FlexAttention with the identical block mask, cuDNN and
   flash SDPA dense causal. Every timing is a do_bench median; ROUNDS (default 3) interleaved rounds, the
   minimum kept (single runs of one persistent kernel varied by several percent between calls).
"""
from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
from _checkout import use_checkout  # noqa: E402

use_checkout()
from sift.kernels import sparse_attention as sa  # noqa: E402
from sift.kernels.rope import apply_rope_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMOKE = DEV == "cpu"  # CPU smoke run of this script under TRITON_INTERPRET=1: tiny sizes, nothing timed
BLOCK = 128
HQ, HKV, D = (4, 1, 128) if SMOKE else (32, 8, 128)
DTYPE = torch.float16 if SMOKE else torch.bfloat16  # bf16 is broken in the interpreter
CONFIGS = [  # runs 1-7 (2026-11-29) timed other tl variants (bench/README_attention.md)
    sa.default_config(128, 128, backend="triton"),   # the tl kernel: "pre" RoPE, Q through the output rows
    sa.default_config(128, 128),                     # the Gluon Hopper kernel (kernels/sparse_attention_sm90.py)
]
ROUNDS = int(os.environ.get("ROUNDS", "3"))  # interleaved rounds of every timing; the minimum median is kept
# e.g. CONFIGS="128,8,2,pre,0,1;128,4,2,pre,0,0,gluon": block_n,warps,stages,rope_on[,q_reload,pre_via_out,backend]
if os.environ.get("CONFIGS"):
    CONFIGS = [sa.KernelConfig(int(f[0]), int(f[1]), int(f[2]), f[3], *(x == "1" for x in f[4:6]), *f[6:7])
               for f in (c.split(",") for c in os.environ["CONFIGS"].split(";"))]


def cfg_name(c):
    return f"n{c.block_n}w{c.num_warps}s{c.num_stages}{c.rope_on}{'-reload' if c.q_reload else ''}" \
           f"{'-out' if c.pre_via_out else ''}{'' if c.backend == 'triton' else '-' + c.backend}"


def launch_name(c):
    """Name of the launch shape: without RoPE, rope_on and q_reload do not matter (same compiled kernel)."""
    return f"n{c.block_n}w{c.num_warps}s{c.num_stages}{'' if c.backend == 'triton' else '-' + c.backend}"


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


def layout_from_segments(requests, starts=None):
    """Segment lengths per request (-> padded to 128) -> block_valid, block_offset, seg id, slot logical/local pos."""
    valid, offset, seg_of_block, req_of_block, pos, local = [], [], [], [], [], []
    seg = 0
    for r, lengths in enumerate(requests):
        nxt = 0
        for s, length in enumerate(lengths):
            first = starts[r][s] if starts else nxt
            nxt = first + length
            for b in range(math.ceil(length / BLOCK)):
                real = min(BLOCK, length - b * BLOCK)
                valid.append(real), offset.append(first), seg_of_block.append(seg), req_of_block.append(r)
                loc = list(range(b * BLOCK, b * BLOCK + real)) + [-1] * (BLOCK - real)
                local += loc
                pos += [first + x if x >= 0 else -1 for x in loc]
            seg += 1
    t = lambda x, dt=torch.int32: torch.tensor(x, dtype=dt, device=DEV)  # noqa: E731
    return dict(block_valid=t(valid), block_offset=t(offset), seg=t(seg_of_block, torch.long),
                req=t(req_of_block, torch.long), pos=t(pos, torch.long), local=t(local, torch.long))


def csr(mask):
    """bool [H, NB, NB] -> indptr int32 [H*NB+1], indices int32 (ascending per row)."""
    counts = mask.flatten(0, 1).sum(1)
    indptr = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=mask.device)
    indptr[1:] = counts.cumsum(0)
    return indptr, mask.flatten(0, 1).nonzero()[:, 1].to(torch.int32)


def mask_a(seg, n_docs, gen):
    """Mask (a): docs attend 30% of own lower-triangle tiles + own first page + diagonal, 6% of earlier docs'
    pages + the sequence's first page; query rows (segment n_docs) dense causal. -> bool [HQ, NB, NB]."""
    nb = seg.numel()
    ar = torch.arange(nb, device=DEV)
    causal = ar[None, :] <= ar[:, None]
    same = seg[:, None] == seg[None, :]
    seg_first = torch.zeros_like(ar)
    seg_first.scatter_reduce_(0, seg, ar, reduce="amin", include_self=False)
    own_first = same & (ar[None, :] == seg_first[:, None])
    r = torch.rand(HQ, nb, nb, device=DEV, generator=gen)
    doc = ((same & causal & (r < 0.30)) | own_first | (ar[None, :] == ar[:, None]) | (ar[None, :] == 0)
           | ((seg[None, :] < seg[:, None]) & (r < 0.06)))
    query_row = (seg == n_docs)[:, None]
    return torch.where(query_row, causal, doc & causal)


def rel_err(out, ref):
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item(), (out - ref).abs().max().item(), bool(out.isfinite().all())


def segments_case(hq, hkv, n_first, dtype, gen):
    """Many short segments (not multiples of 128), two requests, one placed past 65,535; NaN in every padding
    slot of q / k / v; a random 40% causal block mask per head plus the diagonal.
    -> (layout dict, q, k, v, mask [hq, NB, NB])."""
    rng = torch.Generator().manual_seed(1)
    segs = [torch.randint(1, 400, (n_first,), generator=rng).tolist(), torch.randint(1, 300, (6,), generator=rng).tolist()]
    starts = [torch.tensor([0] + segs[0][:-1]).cumsum(0).tolist(),
              [0, 70_000, 150_000, 150_000 + segs[1][2], 200_000, 200_000 + segs[1][4]]]
    lay = layout_from_segments(segs, starts)
    nb = lay["seg"].numel()
    n = nb * BLOCK
    q = torch.randn(hq, n, D, device=DEV, dtype=dtype, generator=gen)
    k = torch.randn(hkv, n, D, device=DEV, dtype=dtype, generator=gen)
    v = torch.randn(hkv, n, D, device=DEV, dtype=dtype, generator=gen)
    pad = lay["pos"] < 0
    for x in (q, k, v):
        x[:, pad] = float("nan")
    ar = torch.arange(nb, device=DEV)
    causal = (ar[None, :] <= ar[:, None]) & (lay["req"][:, None] == lay["req"][None, :])
    mask = (torch.rand(hq, nb, nb, device=DEV, generator=gen) < 0.4) & causal
    mask |= torch.eye(nb, dtype=torch.bool, device=DEV)
    return lay, q, k, v, mask


def correctness(results):
    gen = torch.Generator(device=DEV).manual_seed(0)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32, device=DEV) / D))
    hq, hkv = (2, 1) if SMOKE else (8, 2)
    lay, q, k, v, mask = segments_case(hq, hkv, 3 if SMOKE else 30, DTYPE, gen)
    indptr, indices = csr(mask)
    args = (indptr, indices, lay["block_valid"], lay["block_offset"])
    ref = sa.sparse_attention_ref(q, k, v, *args, inv_freq, scale=D ** -0.5, block=BLOCK)
    ref_none = sa.sparse_attention_ref(q, k, v, *args, None, scale=D ** -0.5, block=BLOCK)
    checks = {}
    for cfg in CONFIGS:
        for rope in (True, False):
            out = torch.full_like(q, float("nan"))
            sa._launch(q, k, v, *args, inv_freq if rope else None, scale=D ** -0.5, block=BLOCK, out=out, config=cfg)
            r, m, fin = rel_err(out, ref if rope else ref_none)
            checks[f"twin/{cfg_name(cfg)}/{'rope' if rope else 'none'}"] = dict(rel=r, max_abs=m, finite=fin,
                                                                               ok=fin and r < 1.5e-2)
    # Dense path == dense causal SDPA (fp32) on each request's unsegmented prompt at logical positions.
    segs = [[30, 200, 129, 1], [77, 300]] if SMOKE else [[300, 2047, 129, 1, 555, 1000, 260], [77, 3001, 128, 500]]
    lay = layout_from_segments(segs)
    nb = lay["seg"].numel()
    n = nb * BLOCK
    hq, hkv = HQ, HKV
    q_raw = torch.randn(hq, n, D, device=DEV, generator=gen)
    k_raw = torch.randn(hkv, n, D, device=DEV, generator=gen)
    v = torch.randn(hkv, n, D, device=DEV, dtype=DTYPE, generator=gen)
    loc, pos = lay["local"].clamp(min=0), lay["pos"].clamp(min=0)
    q = apply_rope_ref(q_raw, loc, inv_freq).to(DTYPE)
    k = apply_rope_ref(k_raw, loc, inv_freq).to(DTYPE)
    ar = torch.arange(nb, device=DEV)
    mask = ((ar[None, :] <= ar[:, None]) & (lay["req"][:, None] == lay["req"][None, :])).expand(hq, nb, nb)
    indptr, indices = csr(mask)
    out = sa.sparse_attention(q, k, v, indptr, indices, lay["block_valid"], lay["block_offset"], inv_freq,
                              scale=D ** -0.5, block=BLOCK)
    req_of_slot = lay["req"].repeat_interleave(BLOCK)
    for r in range(len(segs)):
        slots = ((req_of_slot == r) & (lay["pos"] >= 0)).nonzero()[:, 0]
        slots = slots[lay["pos"][slots].argsort()]
        ql = apply_rope_ref(apply_rope_ref(q[:, slots].double(), -loc[slots], inv_freq), pos[slots], inv_freq)
        kl = apply_rope_ref(apply_rope_ref(k[:, slots].double(), -loc[slots], inv_freq), pos[slots], inv_freq)
        ref = torch.nn.functional.scaled_dot_product_attention(
            ql.float()[None], kl.float().repeat_interleave(hq // hkv, 0)[None],
            v[:, slots].float().repeat_interleave(hq // hkv, 0)[None], is_causal=True, scale=D ** -0.5)[0]
        rr, m, fin = rel_err(out[:, slots], ref)
        checks[f"dense_vs_sdpa/request{r}"] = dict(rel=rr, max_abs=m, finite=fin, ok=fin and rr < 1.5e-2)
    results["correctness"] = checks
    for name, c in checks.items():
        print(f"check {name:32s} rel {c['rel']:.2e} max_abs {c['max_abs']:.2e} {'OK' if c['ok'] else 'FAIL'}")


def bench(fn):
    if SMOKE:
        fn()
        return float("nan")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def timings(results, lengths):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    flex = flex_attention if SMOKE else torch.compile(flex_attention, dynamic=False)
    gen = torch.Generator(device=DEV).manual_seed(1)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32, device=DEV) / D))
    rows = []
    for kind, L in [(kind, L) for kind in MASKS for L in lengths]:
        nb = L // BLOCK
        if kind == "a":
            n_full, rest = divmod(L - 512, 2048)
            docs = [2048] * n_full + ([rest] if rest else [])
            lay = layout_from_segments([docs + [512]])
            assert lay["seg"].numel() == nb
            mask = mask_a(lay["seg"], len(docs), gen)
        else:  # mask (b): real SmolLM2 bits tiled to L, decoded by the runtime's block_indices (bench/masks.py)
            sys.path.insert(0, str(ROOT / "bench"))
            from masks import dense_mask, real_mask
            rm = real_mask(L, HQ, DEV)
            assert rm.layout.n_blocks == nb, (rm.layout.n_blocks, nb)
            lay = dict(block_valid=rm.layout.block_valid, block_offset=rm.layout.block_offset)
            mask = dense_mask(rm, HQ)
        ar = torch.arange(nb, device=DEV)
        causal = (ar[None, :] <= ar[:, None]).expand(HQ, nb, nb)
        q = torch.randn(HQ, L, D, device=DEV, dtype=DTYPE, generator=gen)
        k = torch.randn(HKV, L, D, device=DEV, dtype=DTYPE, generator=gen)
        v = torch.randn(HKV, L, D, device=DEV, dtype=DTYPE, generator=gen)
        out = torch.empty_like(q)
        tiles = mask.sum().item()
        causal_tiles = HQ * nb * (nb + 1) // 2
        diag = HQ * nb
        cells = (tiles - diag) * BLOCK * BLOCK + diag * BLOCK * (BLOCK + 1) // 2  # all heads
        dense_cells = HQ * L * (L + 1) // 2
        flops = lambda c: 4 * D * c  # noqa: E731
        row = dict(mask=kind, L=L, tiles=tiles, tile_fraction=tiles / causal_tiles, cells=cells, dense_cells=dense_cells)
        sp = csr(mask)
        de = csr(causal)
        lv = (lay["block_valid"], lay["block_offset"])
        row["delta_stats"] = delta_stats(*sp, lay["block_offset"])
        def record(key, ms, c):  # the minimum median over the interleaved rounds
            if key not in row or ms < row[key]["ms"]:
                row[key] = dict(ms=ms, tflops=flops(c) / ms / 1e9)

        # FlexAttention with the identical block mask: non-diagonal tiles as full blocks, diagonal causal.
        eye = torch.eye(nb, dtype=torch.bool, device=DEV)
        full = mask & ~eye
        full_num = full.sum(-1).to(torch.int32)[None]
        full_idx = torch.sort(full.to(torch.int8), dim=-1, descending=True, stable=True).indices.to(torch.int32)[None]
        part_num = torch.ones(1, HQ, nb, dtype=torch.int32, device=DEV)
        part_idx = ar.to(torch.int32).view(1, 1, nb, 1).expand(1, HQ, nb, nb).contiguous()

        def causal_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        bm = BlockMask.from_kv_blocks(part_num, part_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=causal_mod)
        q4, k4, v4 = q[None], k[None], v[None]
        kx, vx = k.repeat_interleave(HQ // HKV, 0)[None], v.repeat_interleave(HQ // HKV, 0)[None]
        for _ in range(1 if SMOKE else ROUNDS):
            done = set()
            for cfg in CONFIGS:
                name = cfg_name(cfg)
                try:
                    for tag, (ptr, idx), rope in (("sparse_rope", sp, True), ("sparse_none", sp, False),
                                                  ("dense_rope", de, True)):
                        if tag == "dense_rope" and (cfg.rope_on == "q" or kind != "a"):  # dense: mask-independent
                            continue
                        key = f"{tag}/{name}"
                        if tag == "sparse_none":  # the same kernel for every rope_on / q_reload: time it once
                            key = f"{tag}/{launch_name(cfg)}"
                            if key in done:
                                continue
                            done.add(key)
                        f = lambda: sa._launch(q, k, v, ptr, idx, *lv, inv_freq if rope else None,  # noqa: E731
                                               scale=D ** -0.5, block=BLOCK, out=out, config=cfg)
                        record(key, bench(f), cells if tag.startswith("sparse") else dense_cells)
                except Exception as e:  # a config that does not compile (shared memory) is recorded, not fatal
                    row[f"error/{name}"] = repr(e)[:300]
            try:
                if "flex_vs_ours_rel" not in row:
                    fo = flex(q4, k4, v4, block_mask=bm, enable_gqa=True, scale=D ** -0.5)
                    ours = sa._launch(q, k, v, *sp, *lv, None, scale=D ** -0.5, block=BLOCK, out=None, config=None)
                    row["flex_vs_ours_rel"] = rel_err(ours, fo[0])[0]
                record("flex_sparse", bench(lambda: flex(q4, k4, v4, block_mask=bm, enable_gqa=True, scale=D ** -0.5)),
                       cells)
            except Exception as e:
                row["error/flex"] = repr(e)[:300]
            for tag, backend in (("cudnn_dense", SDPBackend.CUDNN_ATTENTION),
                                 ("flash_dense", SDPBackend.FLASH_ATTENTION)):
                try:
                    with sdpa_kernel(backend):
                        f = lambda: torch.nn.functional.scaled_dot_product_attention(q4, kx, vx, is_causal=True)  # noqa
                        record(tag, bench(f), dense_cells)
                except Exception as e:
                    row[f"error/{tag}"] = repr(e)[:300]
        rows.append(row)
        print(json.dumps(row))
        del q, k, v, out, kx, vx
        torch.cuda.empty_cache()
    results["timings"] = rows


def summary(results):
    names = {cfg_name(c): launch_name(c) for c in CONFIGS}
    for row in results["timings"]:
        print(row.get("mask", "a"), row["L"], {k: round(v["ms"], 3) for k, v in row.items() if isinstance(v, dict) and "ms" in v})
    print("\nRoPE overhead per config: sparse+rope ms (vs the same launch shape pre-rotated). d0% = tiles with "
          "delta == 0, trig% = tiles that recompute cos/sin")
    print("     L tiles%   d0% trig% | " + " | ".join(f"{n:>19s}" for n in names))
    for row in results["timings"]:
        cells = []
        for n, ln in names.items():
            r, z = row.get(f"sparse_rope/{n}", {}).get("ms"), row.get(f"sparse_none/{ln}", {}).get("ms")
            cells.append(f"{r:8.3f} ({100 * (r / z - 1):+6.1f}%)" if r and z else f"{'n/a':>19s}")
        ds = row.get("delta_stats", {})
        print(f"{row.get('mask', 'a')} {row['L']:6d} {100 * row['tile_fraction']:6.1f} {100 * ds.get('delta0', float('nan')):5.1f} "
              f"{100 * ds.get('trig_recompute', float('nan')):5.1f} | " + " | ".join(cells))
    print("\n     L tiles% | best sparse+rope (cfg)           | same shape no-rope | rope ovh | dense(ours) | "
          "flex   | cudnn  | flash")
    for row in results["timings"]:
        sparse = {k.split("/", 1)[1]: v["ms"] for k, v in row.items() if k.startswith("sparse_rope/")}
        dense = {k.split("/", 1)[1]: v["ms"] for k, v in row.items() if k.startswith("dense_rope/")}
        if not sparse:
            continue
        best = min(sparse, key=sparse.get)
        none = row.get(f"sparse_none/{names.get(best, best)}", {}).get("ms", float("nan"))
        bd = min(dense.values()) if dense else float("nan")
        g = lambda key: row.get(key, {}).get("ms", float("nan"))  # noqa: E731
        print(f"{row.get('mask', 'a')} {row['L']:6d} {100 * row['tile_fraction']:6.1f} | {sparse[best]:7.3f} ms ({best:18s})   | "
              f"{none:7.3f} ms         | {100 * (sparse[best] / none - 1):+6.1f}% | {bd:7.3f} ms  | "
              f"{g('flex_sparse'):6.3f} | {g('cudnn_dense'):6.3f} | {g('flash_dense'):6.3f}")


MASKS = [m for m in os.environ.get("MASKS", "a,b").split(",") if m]  # a: anchor generator; b: real SmolLM2 bits


def main():
    lengths = [int(x) for x in os.environ.get("LENGTHS", "1024" if SMOKE else "16384,32768,65536").split(",")]
    results = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   device="cpu (smoke)" if SMOKE else torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   shapes=dict(B=1, Hq=HQ, Hkv=HKV, D=D, dtype="bf16", block=BLOCK),
                   configs=[cfg_name(c) for c in CONFIGS])
    out_dir = Path(os.environ.get("OUT") or ROOT / "bench" / "results" / ("smoke" if SMOKE else ""))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "attention.json"
    t0 = time.time()
    try:
        correctness(results)
        timings(results, lengths)
    finally:
        results["wall_s"] = round(time.time() - t0, 1)
        path.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {path} ({results['wall_s']} s)")
    summary(results)


if __name__ == "__main__":
    main()
