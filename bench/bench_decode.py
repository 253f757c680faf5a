"""GPU benchmark of the two decode-side kernels, per layer:

1. SIFT index decode (`block_indices`): B=1, 32 query heads, contexts of L = 16K / 32K / 64K tokens of 2048-token
   documents after a 1-token prefix, plus a 512-token query; tile 64, kernel block 128; random bits with ~30% LA
   (plus the diagonal and sink the profiler always sets) and ~6% CA density.
2. Decode-phase attention (`decode_attention`) of one new token over the same context, 8B-shaped layer (32 query
   heads, 8 kv heads, D=128, bf16), next to torch SDPA for a single query over the same keys pre-rotated at their
   logical positions.

Every result is checked against its reference before it is timed (bench/common.py `Checks`): the index decode
equal to its ref twin index for index, the decode attention's output within c * u * sqrt(depth) of the twin's
and of SDPA's, per head (relative error; DEPTH_* below). Exit status 1 after writing the result if a check
failed. Times are triton.testing.do_bench medians in microseconds; `*_device_us` the same calls queued behind a
GPU spin (host launch cost hidden), `*_host_us` the host's time per call. Writes bench/results/decode.json.

3. With `--parts sweep`: the split kernel's schedules (`DecodeConfig`: key slots per step, warps, pipeline
   stages) at batch 1 and 8 (`--batches`), each checked against the twin, then timed with the engine's split
   count; beside them the floor, the KV bytes over the bandwidth of a large device-to-device copy in the same run.

    python bench/bench_decode.py [--parts index,attention,sweep] [--contexts 16384,32768,65536] [--splits 8,16,...]
    python bench/bench_decode.py --parts sweep --contexts 16384,32768 [--configs n32w4s3,n64w4s3,...]
    python bench/bench_decode.py --smoke      # CPU, Triton interpreter, tiny shapes: the checks only
"""
from __future__ import annotations

import json
import math
import re
import time

from common import Checks, check_close, out_dir, parser, smoke_env, write_result

SMOKE = smoke_env()  # before the kernels import triton

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from sift.format import n_pages  # noqa: E402
from sift.kernels.bits import pack_msb  # noqa: E402
from sift.kernels.block_indices import (block_indices, block_indices_layers, block_indices_ref,  # noqa: E402
                                        dense_indptr, pack_doc_bits)
from sift.kernels.decode_attention import (  # noqa: E402
    DecodeConfig,
    decode_attention,
    decode_attention_ref,
    default_config,
    default_num_splits,
    layout_kv_table,
)
from sift.kernels.layout import build_layout  # noqa: E402
from sift.kernels.rope import apply_rope_ref  # noqa: E402
from sift.runtime.backends import DECODE_GROUP_BYTES  # noqa: E402
from bench_generate import copy_bandwidth  # noqa: E402

DOC_TOKENS, QUERY_TOKENS, PREFIX_TOKENS = (256, 64, 1) if SMOKE else (2048, 512, 1)
TILE, BLOCK = 64, 128
HQ, HKV, HEAD_DIM = (4, 1, 64) if SMOKE else (32, 8, 128)
N_LAYERS = 2 if SMOKE else 32  # layers of bits per document (the multi-layer decode groups consecutive layers)
LA_DENSITY, CA_DENSITY = 0.30, 0.06
ROPE_THETA = 500000.0
DTYPE = torch.float16 if SMOKE else torch.bfloat16  # bf16 is broken in the interpreter
# Roundings to DTYPE one output goes through that the twin's does not share (the twin attends in fp32 from the
# same inputs, with fp64 angles, and rounds its output once): q rotated and rounded per segment, P before the P V
# product, the kernel's output and the twin's.
DEPTH_DECODE = 4
# Against SDPA over keys rotated at logical positions: the kernel's roundings, the keys rounded at their local
# positions (the cache) and at their logical ones (SDPA's input), q rounded for SDPA, SDPA's P and output.
DEPTH_DECODE_VS_SDPA = DEPTH_DECODE + 4


def bench(fn) -> float:
    if SMOKE:  # nothing is timed on CPU
        fn()
        return float("nan")
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3  # ms -> us


def host_us(fn, n: int = 50) -> float:
    """Host time per call, the GPU kept busy (spinning) so that no call waits for it: median of 5 x n calls."""
    if SMOKE:
        return float("nan")
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        torch.cuda._sleep(400_000_000)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def queued_us(fn, n: int = 50) -> float:
    """Device time per call with the host's launch cost hidden: the GPU first spins (torch.cuda._sleep) while the
    host enqueues n calls, then runs them back to back between two events. This is the cost a call adds to a
    prefill whose host runs ahead of the device (the engine's case); do_bench's figure includes the host's
    Python launch time whenever that is longer than the kernels."""
    if SMOKE:
        fn()
        return float("nan")
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning: more than n host launches take
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n)
    return sorted(times)[len(times) // 2]


def context_request(context: int) -> list[tuple[str, int]]:
    """One request of `context` document tokens: a 1-token prefix, DOC_TOKENS-token documents, the query."""
    return [("prefix", PREFIX_TOKENS)] + [("doc", DOC_TOKENS)] * (context // DOC_TOKENS) + [("query", QUERY_TOKENS)]


def rope_inv_freq(dev: torch.device) -> torch.Tensor:
    return (1.0 / (ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))).to(dev)


def random_bits(n_tokens: list[int], gen: torch.Generator, n_layers: int = 1):
    la_blobs, ca_blobs = [], []
    for n in n_tokens:
        p = n_pages(n, TILE)
        i, j = torch.tril_indices(p, p)
        la = (torch.rand(n_layers * HQ, p * (p + 1) // 2, generator=gen) < LA_DENSITY) | (i == j) | (j == 0)
        ca = torch.rand(n_layers * HQ, p, generator=gen) < CA_DENSITY
        la_blobs.append(pack_msb(la).numpy().tobytes())
        ca_blobs.append(pack_msb(ca).numpy().tobytes())
    return la_blobs, ca_blobs


def same_csr(indptr, indices, ref_indptr, ref_indices) -> bool:
    """Two CSRs of block indices equal row for row (the decode allocates an upper bound of indices: compare
    the used part)."""
    nnz = int(indptr[-1])
    return bool(torch.equal(indptr.cpu(), ref_indptr.cpu()) and torch.equal(indices[:nnz].cpu(), ref_indices.cpu()))


def padded_as_csr(starts, idx, ends):
    """A one-pass (padded) decode's rows -> (indptr, indices) of the compact CSR."""
    counts = (ends - starts[:-1]).long().cpu()
    indptr = torch.zeros(counts.numel() + 1, dtype=torch.int32)
    indptr[1:] = counts.cumsum(0)
    return indptr, torch.cat([idx[a:b].cpu() for a, b in zip(starts[:-1].tolist(), ends.tolist())])


SWEEP = ((8, 64, 4), (4, 64, 4), (2, 64, 4), (1, 64, 4), (4, 128, 4), (2, 128, 4), (2, 64, 2), (1, 64, 2),
         (1, 128, 4), (1, 32, 1), (2, 32, 1), (1, 16, 1), (2, 16, 1))


def bench_index_decode(context: int, dev: torch.device, gen: torch.Generator, checks: Checks) -> dict:
    requests = [context_request(context)]
    layout = build_layout(requests, BLOCK, device=dev)
    n_tok = layout.doc_n_tokens.tolist()
    la_blobs, ca_blobs = random_bits(n_tok, gen, N_LAYERS)
    bits = pack_doc_bits(la_blobs, ca_blobs, n_tok, tile=TILE, n_layers=N_LAYERS, n_heads=HQ, device=dev)
    la_ptr, ca_ptr = bits.layer_ptrs(0)
    args = (layout, bits.la_bytes, la_ptr, bits.ca_bytes, ca_ptr, TILE)

    indptr, indices = block_indices(*args)
    ref_indptr, ref_indices = block_indices_ref(*args)
    nnz = int(indptr[-1])
    checks.true(f"index_decode/{context}", same_csr(indptr, indices, ref_indptr, ref_indices),
                "equal to block_indices_ref")
    dense = HQ * layout.causal_block_pairs

    def decode_layer():  # the two-pass compact CSR: the layer's offsets, then the decode
        la, ca = bits.layer_ptrs(0)
        return block_indices(layout, bits.la_bytes, la, bits.ca_bytes, ca, TILE)

    row_start = dense_indptr(layout, HQ)  # once per prefill in the engine

    all_la, all_ca = bits.all_layer_ptrs()  # once per prefill in the engine

    def decode_layer_one_pass():  # what the engine does per layer: one pass into padded rows
        return block_indices(layout, bits.la_bytes, all_la[0], bits.ca_bytes, all_ca[0], TILE, padded=True,
                             row_start=row_start)

    starts, pidx, ends = decode_layer_one_pass()
    one_pass = padded_as_csr(starts, pidx, ends)
    checks.true(f"index_decode_one_pass/{context}", same_csr(*one_pass, ref_indptr, ref_indices),
                "equal to block_indices_ref")

    sweep = {}  # launch shapes of the one-pass decode: heads per program, key blocks per step, warps
    for hb, bj, nw in SWEEP[:2] if SMOKE else SWEEP:
        la, ca = bits.layer_ptrs(0)
        f = lambda: block_indices(layout, bits.la_bytes, la, bits.ca_bytes, ca, TILE, padded=True,  # noqa: E731
                                  row_start=row_start, heads_per_program=hb, block_j=bj, num_warps=nw)
        name = f"hb{hb}_j{bj}_w{nw}"
        try:
            _, gidx, gends = f()
        except Exception as e:  # a launch shape that does not compile is recorded, not fatal
            sweep[name] = repr(e)[:200]
            continue
        checks.true(f"index_decode_one_pass/{context}/{name}",
                    same_csr(*padded_as_csr(starts, gidx, gends), ref_indptr, ref_indices),
                    "equal to block_indices_ref")
        sweep[name] = queued_us(f)
    # Consecutive layers in one launch, as the engine groups them (DECODE_GROUP_BYTES of indices per group).
    group = max(1, min(N_LAYERS, DECODE_GROUP_BYTES // (4 * dense)))

    def decode_group():
        return block_indices_layers(layout, bits.la_bytes, all_la[:group], bits.ca_bytes, all_ca[:group], TILE,
                                    row_start=row_start)

    _, gidx, gends = decode_group()
    for layer in sorted({0, group - 1}):
        want = block_indices_ref(layout, bits.la_bytes, all_la[layer], bits.ca_bytes, all_ca[layer], TILE)
        checks.true(f"index_decode_layers/{context}/layer{layer}",
                    same_csr(*padded_as_csr(starts, gidx[layer], gends[layer]), *want), "equal to block_indices_ref")
    return {
        "layers_per_launch": group,
        "index_decode_grouped_device_us_per_layer": queued_us(decode_group) / group,
        "one_pass_sweep_device_us": sweep,
        "n_tokens": layout.n_tokens,
        "n_docs": context // DOC_TOKENS,
        "n_blocks": layout.n_blocks,
        "nnz_blocks": nnz,
        "dense_blocks": dense,
        "block_density": nnz / dense,
        "index_decode_us": bench(lambda: block_indices(*args)),
        "index_decode_with_layer_ptrs_us": bench(decode_layer),
        "index_decode_device_us": queued_us(decode_layer),
        "index_decode_one_pass_device_us": queued_us(decode_layer_one_pass),
        "index_decode_one_pass_us": bench(decode_layer_one_pass),
    }


def bench_decode_attention(context: int, dev: torch.device, gen: torch.Generator, splits_sweep: list[int],
                           checks: Checks) -> dict:
    requests = [context_request(context)]
    layout = build_layout(requests, BLOCK, device=dev)
    inv_freq = rope_inv_freq(dev)
    dtype = DTYPE
    k_raw = torch.randn(HKV, layout.n_tokens, HEAD_DIM, generator=gen).to(dev)
    v = torch.randn(HKV, layout.n_tokens, HEAD_DIM, generator=gen).to(dev, dtype)
    q_raw = torch.randn(1, HQ, HEAD_DIM, generator=gen).to(dev)
    q_pos = layout.n_tokens  # the first generated token

    k_cache = layout.scatter(apply_rope_ref(k_raw, layout.token_local_pos, inv_freq).to(dtype), dim=1)
    v_cache = layout.scatter(v, dim=1)
    kv_indptr, kv_indices = layout_kv_table(layout)
    q_offset = torch.tensor([q_pos], dtype=torch.int32, device=dev)  # q passed un-rotated
    scale = 1.0 / math.sqrt(HEAD_DIM)
    kv_offset = layout.block_offset[kv_indices.long()]  # each entry's segment offset
    args = (q_raw.to(dtype), k_cache, v_cache, q_offset, kv_indptr, kv_indices, layout.block_valid, kv_offset,
            inv_freq)
    splits = default_num_splits(1, HKV, kv_indices.numel(), dev)

    # SDPA over keys pre-rotated at logical positions (contiguous, no padding): the dense baseline.
    k_log = apply_rope_ref(k_raw, layout.token_logical_pos, inv_freq).to(dtype)[None]  # [1, Hkv, L, D]
    q_log = apply_rope_ref(q_raw[0][:, None], torch.tensor([q_pos], device=dev), inv_freq).to(dtype)[None]
    v4 = v[None]

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q_log, k_log, v4, scale=scale, enable_gqa=True)

    got = decode_attention(*args, scale=scale, block=BLOCK)
    ref = decode_attention_ref(*args, scale=scale, block=BLOCK)
    base = sdpa()[0, :, 0]  # [Hq, D]
    # Per head: a dropped block or a wrong rotation shows in the heads it touches.
    vs_twin = check_close(f"decode_attention_vs_twin/{context}", got[0], ref[0], dtype, DEPTH_DECODE, group_dims=1)
    vs_sdpa = check_close(f"decode_attention_vs_sdpa/{context}", got[0], base, dtype, DEPTH_DECODE_VS_SDPA,
                          group_dims=1)
    checks.add(vs_twin)
    checks.add(vs_sdpa)
    for s_ in splits_sweep:  # every split count computes the same attention
        checks.close(f"decode_attention_vs_twin/{context}/splits{s_}",
                     decode_attention(*args, scale=scale, block=BLOCK, num_splits=s_)[0], ref[0], dtype, DEPTH_DECODE,
                     group_dims=1)
    kv_bytes = 2 * HKV * layout.n_tokens * HEAD_DIM * 2
    t_decode = bench(lambda: decode_attention(*args, scale=scale, block=BLOCK))
    t_sdpa = bench(sdpa)
    row = {
        "num_splits": splits,
        "rel_err_vs_ref": vs_twin.value,
        "rel_err_vs_sdpa": vs_sdpa.value,
        "decode_attention_us": t_decode,
        "sdpa_us": t_sdpa,
        "decode_attention_kv_GBps": kv_bytes / t_decode / 1e3,
        "sdpa_kv_GBps": kv_bytes / t_sdpa / 1e3,
        # Device time (host launch cost hidden: what a decode step captured in a CUDA graph, or a host running
        # ahead, pays) and host time per call (what an eager decode loop pays when the GPU waits for it).
        "decode_attention_device_us": queued_us(lambda: decode_attention(*args, scale=scale, block=BLOCK)),
        "sdpa_device_us": queued_us(sdpa),
        "decode_attention_host_us": host_us(lambda: decode_attention(*args, scale=scale, block=BLOCK)),
        "sdpa_host_us": host_us(sdpa),
        "num_splits_sweep_device_us": {
            s_: queued_us(lambda s_=s_: decode_attention(*args, scale=scale, block=BLOCK, num_splits=s_))
            for s_ in splits_sweep},
    }
    row["decode_attention_device_kv_GBps"] = kv_bytes / row["decode_attention_device_us"] / 1e3
    row["sdpa_device_kv_GBps"] = kv_bytes / row["sdpa_device_us"] / 1e3
    return row


def parse_config(text: str) -> DecodeConfig:
    """"n64w8s3" -> DecodeConfig(block_n=64, num_warps=8, num_stages=3)."""
    m = re.fullmatch(r"n(\d+)w(\d+)s(\d+)", text)
    if not m:
        raise SystemExit(f"--configs: {text!r} is not of the form n<slots>w<warps>s<stages>, e.g. n64w8s3")
    return DecodeConfig(int(m[1]), int(m[2]), int(m[3]))


def config_name(c: DecodeConfig) -> str:
    return f"n{c.block_n}w{c.num_warps}s{c.num_stages}"


CONFIG_SWEEP = ",".join(f"n{n}w{w}s{s}" for n, w in ((32, 4), (64, 4), (64, 8), (128, 8)) for s in (2, 3, 4))


def sweep_configs(context: int, batch: int, configs: list[DecodeConfig], dev: torch.device, gen: torch.Generator,
                  bandwidth: float, checks: Checks) -> dict:
    """Every config on `batch` requests of `context` tokens each (separate KV), the engine's split count."""
    layout = build_layout([context_request(context)] * batch, BLOCK, device=dev)
    inv_freq = rope_inv_freq(dev)
    k_cache = torch.randn(HKV, layout.n_slots, HEAD_DIM, generator=gen).to(dev, DTYPE)
    v_cache = torch.randn(HKV, layout.n_slots, HEAD_DIM, generator=gen).to(dev, DTYPE)
    kv_indptr, kv_indices = layout_kv_table(layout)
    q = torch.randn(batch, HQ, HEAD_DIM, generator=gen).to(dev, DTYPE)
    q_offset = layout.req_n_tokens.to(torch.int32)  # q un-rotated at the first generated position
    args = (q, k_cache, v_cache, q_offset, kv_indptr, kv_indices, layout.block_valid,
            layout.block_offset[kv_indices.long()], inv_freq)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    splits = default_num_splits(batch, HKV, kv_indices.numel(), dev)
    ref = decode_attention_ref(*args, scale=scale, block=BLOCK)
    kv_bytes = 2 * HKV * int(layout.block_valid.sum()) * HEAD_DIM * k_cache.element_size()
    times = {}
    for config in configs:
        name = config_name(config)
        try:
            got = decode_attention(*args, scale=scale, block=BLOCK, config=config)
        except Exception as exc:  # a schedule the compiler cannot fit (shared memory, registers) is reported
            times[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            continue
        if checks.close(f"sweep/{context}/b{batch}/{name}", got, ref, DTYPE, DEPTH_DECODE, group_dims=2):
            times[name] = queued_us(lambda c=config: decode_attention(*args, scale=scale, block=BLOCK, config=c))
    timed = {k: v for k, v in times.items() if isinstance(v, float)}
    best = min(timed, key=timed.get) if timed and not SMOKE else config_name(default_config(batch))
    floor_us = kv_bytes / bandwidth * 1e6
    by_splits = {s_: queued_us(lambda s_=s_: decode_attention(*args, scale=scale, block=BLOCK, num_splits=s_,
                                                               config=parse_config(best)))
                 for s_ in sorted({max(1, splits // 2), splits, 2 * splits})}
    return {"context": context, "batch": batch, "num_splits": splits, "kv_bytes": kv_bytes, "floor_us": floor_us,
            "default": config_name(default_config(batch)), "device_us": times, "best": best,
            "best_over_floor": timed[best] / floor_us if timed and not SMOKE else None,
            "best_by_splits_device_us": by_splits}


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--parts", default="index,attention", help="benchmarks to run: index, attention")
    ap.add_argument("--contexts", default="16384,32768,65536", help="context lengths (tokens), comma-separated")
    ap.add_argument("--splits", default="8,16,33,66,132,264", help="num_splits values of the decode sweep")
    ap.add_argument("--configs", default=CONFIG_SWEEP, help="split-kernel schedules of --parts sweep: "
                    "n<key slots per step>w<warps>s<stages>")
    ap.add_argument("--batches", default="1,8", help="batch sizes of --parts sweep")
    args = ap.parse_args()
    if args.smoke:
        args.contexts, args.splits, args.batches = "1024", "2,3", "1,2"
        args.configs = "n32w4s2,n64w4s3"
    elif not torch.cuda.is_available():
        raise SystemExit("bench_decode.py needs a CUDA GPU (or --smoke)")
    parts = args.parts.split(",")
    dev = torch.device("cpu" if SMOKE else "cuda")
    gen = torch.Generator().manual_seed(0)
    results, sweeps, checks = [], [], Checks()
    bandwidth = copy_bandwidth(SMOKE) if "sweep" in parts else None
    for context in [int(x) for x in args.contexts.split(",")]:
        row = {"context": context}
        if "index" in parts:
            row.update(bench_index_decode(context, dev, gen, checks))
        if "attention" in parts:
            row.update(bench_decode_attention(context, dev, gen, [int(x) for x in args.splits.split(",")], checks))
        if "sweep" in parts:
            for batch in [int(x) for x in args.batches.split(",")]:
                sweeps.append(sweep_configs(context, batch, [parse_config(c) for c in args.configs.split(",")],
                                            dev, gen, bandwidth, checks))
                print(json.dumps(sweeps[-1]), flush=True)
        if len(row) > 1:
            results.append(row)
            print(json.dumps(row), flush=True)
    setup = {
        "batch": 1, "q_heads": HQ, "kv_heads": HKV, "head_dim": HEAD_DIM, "dtype": str(DTYPE).removeprefix("torch."),
        "tile": TILE, "block": BLOCK, "doc_tokens": DOC_TOKENS, "query_tokens": QUERY_TOKENS,
        "prefix_tokens": PREFIX_TOKENS, "la_density": LA_DENSITY, "ca_density": CA_DENSITY,
        "timer": "triton.testing.do_bench median, microseconds; *_device_us: queued behind a GPU spin "
                 "(host launch cost hidden), median of 5 x 50 calls",
    }
    if sweeps:
        setup["bandwidth_bytes_per_s"] = bandwidth
        print(f"{'context':>8} {'batch':>5} {'splits':>6} {'floor us':>9} {'default us':>10} {'best':>10} "
              f"{'best us':>8}")
        for r in sweeps:
            d = r["device_us"].get(r["default"], "-")
            b = r["device_us"].get(r["best"], "-")
            print(f"{r['context']:>8} {r['batch']:>5} {r['num_splits']:>6} {r['floor_us']:>9.1f} "
                  f"{d if isinstance(d, str) else f'{d:10.1f}':>10} {r['best']:>10} "
                  f"{b if isinstance(b, str) else f'{b:8.1f}':>8}")
    write_result("decode", {"setup": setup, "results": results, "sweeps": sweeps, "checks": checks.to_json(),
                            "ok": checks.ok}, out_dir(args))
    raise SystemExit(checks.exit_status())


if __name__ == "__main__":
    main()
