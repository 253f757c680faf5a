"""Where one decode step's time goes, against the bytes it must read -> bench/results/decode-step.json.

The engine of bench/bench_generate.py (8B Llama shape, random bf16 weights, 2048-token documents of random ids
plus a 512-token query, mode reuse with the documents warm in HBM) decodes with its captured CUDA graphs. Per
context and batch:

    wall       seconds per `engine.step()` over 60 steps (what a request sees as its time per output token)
    replay     device time of the captured step: 20 back-to-back replays of its CUDA graph, CUDA events
    kernels    the same step run eagerly under torch.profiler (3 steps): every kernel's device time, grouped
               into GEMMs (cuBLAS / cuBLASLt: the weights' matrix-vector products and the lm_head), attention
               (the engine's decode kernels), and everything else (norms, rotary, activations, copies: each a
               separate small kernel in a transformers forward), with the kernel count of each group

beside each group's floor: the bytes it must read over the bandwidth of a large device-to-device copy measured in
the same run (GEMMs: every weight but the embedding table; attention: every request's KV). The gap between
`replay` and the sum of the floors is what a faster step has to win, and the groups say where.

Each figure is measured for both decode forwards (`--paths`): "fast", runtime/llama_decode.py's (stacked q / k / v
and gate / up projections, fused element-wise kernels), and "module", the model's own modules with the fused
RMSNorms (the runner with its fast forward switched off), one engine after the other on the same model.

    python bench/profile_decode_step.py              # a CUDA GPU: ~2 minutes on an H200
    python bench/profile_decode_step.py --smoke      # tiny random Llama on CPU: checks the script runs
"""
from __future__ import annotations

import gc
import pathlib
import tempfile
import time

import common  # bench/common.py (the script's folder is on sys.path)
from common import IdTokenizer

common.smoke_env()  # before any kernel module imports triton

import torch  # noqa: E402

from bench_generate import copy_bandwidth  # noqa: E402
from bench_ttft import TILE, SyntheticIndex, anchor_bits, build_llama, write_index  # noqa: E402
from sift.runtime import Request, SamplingParams, SiftEngine  # noqa: E402

GEMM_MARKS = ("gemm", "gemv", "nvjet", "cublas", "cutlass", "splitk", "sm90_xmma")
ATTENTION_MARKS = ("_decode_",)


def group_of(kernel: str) -> str:
    name = kernel.lower()
    if any(m in name for m in ATTENTION_MARKS):
        return "attention"
    if any(m in name for m in GEMM_MARKS):
        return "gemm"
    return "other"


def kernel_groups(runner, bucket: int, steps: int) -> dict:
    """The eager step under torch.profiler -> per group: device ms per step and kernels per step."""
    from torch.profiler import ProfilerActivity, profile

    runner._step(bucket, True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner._step(bucket, True)
        torch.cuda.synchronize()
    groups = {g: {"ms": 0.0, "kernels": 0, "by_kernel": {}} for g in ("gemm", "attention", "other")}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if us <= 0 or e.key.startswith(("ProfilerStep", "cudaDeviceSynchronize")):
            continue
        g = groups[group_of(e.key)]
        g["ms"] += us / 1e3 / steps
        g["kernels"] += e.count / steps
        # per kernel name: device ms per step and calls per step, to see which kernels of a group cost what
        g["by_kernel"][e.key[:80]] = [us / 1e3 / steps, e.count / steps]
    for g in groups.values():
        g["by_kernel"] = dict(sorted(g["by_kernel"].items(), key=lambda kv: -kv[1][0])[:12])
    return groups


def replay_ms(runner, bucket: int, reps: int = 20) -> float:
    graph = runner.graphs[bucket, True][0]
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="16384,32768", help="document tokens per request")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--paths", default="fast,module", help="decode forwards measured: fast, module")
    args = ap.parse_args()
    paths = args.paths.split(",")
    if not set(paths) <= {"fast", "module"}:
        raise SystemExit(f"--paths {args.paths!r}: a comma-separated list of fast, module")
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("profile_decode_step needs a CUDA GPU (or --smoke)")
    doc_tokens, query_tokens = (128, 32) if smoke else (2048, 512)
    contexts = [512] if smoke else [int(x) for x in args.contexts.split(",")]
    batches = [1, 2] if smoke else [int(x) for x in args.batches.split(",")]
    t_start = time.perf_counter()
    model = build_llama(smoke, smoke_dtype=torch.float32)
    config = model.config
    itemsize = torch.finfo(model.dtype).bits // 8
    embed = model.get_input_embeddings().weight
    weights_bytes = sum(p.numel() for p in model.parameters()) * itemsize - embed.numel() * itemsize
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * itemsize
    bandwidth = copy_bandwidth(smoke)
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, config.vocab_size, (n,), generator=gen).tolist()

    docs = {f"doc{i}": ids(doc_tokens) for i in range(max(contexts) // doc_tokens)}
    queries = [ids(query_tokens) for _ in range(max(batches))]
    tmp = pathlib.Path(tempfile.mkdtemp())
    vectors = config.num_hidden_layers * config.num_attention_heads
    write_index(tmp / "index", docs, {d: anchor_bits(len(t), vectors, gen) for d, t in docs.items()}, tile=TILE,
                config=config)
    index = SyntheticIndex.open(tmp / "index", device=model.device)
    tok = IdTokenizer(config.bos_token_id, None)
    rows = []
    for path in paths:
        # --smoke: backend triton in the interpreter, so that the fast forward (Triton kernels only) runs on CPU
        engine = SiftEngine(model, tok, index, kv_cache_bytes=(64 << 20) if smoke else 40 << 30,
                            backend="triton" if smoke else "auto")
        if path == "module":
            engine.runner.fast = None
        elif engine.runner.fast is None:
            raise SystemExit(f"the fast decode forward does not serve this model: {engine.runner.fast_refusal}")
        engine.warmup()
        rows += measure(engine, path, docs, queries, contexts, batches, doc_tokens, query_tokens, weights_bytes,
                        kv_per_token, bandwidth, smoke)
        del engine
        gc.collect()
        if not smoke:
            torch.cuda.empty_cache()
    setup = dict(contexts=contexts, batches=batches, paths=paths, doc_tokens=doc_tokens, query_tokens=query_tokens,
                 mode="reuse", tile=TILE, bandwidth_bytes_per_s=bandwidth, weights_bytes_read=weights_bytes,
                 kv_bytes_per_token=kv_per_token, smoke=smoke)
    common.write_result("decode-step", dict(setup=setup, seconds=time.perf_counter() - t_start, rows=rows),
                        common.out_dir(args))
    print(f"\n{'path':>6} {'ctx':>6} {'batch':>5} {'wall':>7} {'replay':>7} {'floor':>7} | {'GEMMs (floor, n)':>22} | "
          f"{'attention (floor, n)':>22} | {'other (n)':>14}")
    for r in rows:
        g = r.get("groups")
        head = f"{r['path']:>6} {r['context'] / 1024:>5g}K {r['batch']:>5} {r['wall_ms']:>5.2f}ms"
        if g is None:
            print(head)
            continue
        print(f"{head} {r['replay_ms']:>5.2f}ms "
              f"{r['floor_ms']:>5.2f}ms | {g['gemm']['ms']:>5.2f} ({g['gemm']['floor_ms']:.2f}, "
              f"{g['gemm']['kernels']:.0f}) ms | {g['attention']['ms']:>5.2f} ({g['attention']['floor_ms']:.2f}, "
              f"{g['attention']['kernels']:.0f}) ms | {g['other']['ms']:>5.2f} ({g['other']['kernels']:.0f}) ms")


def measure(engine, path: str, docs, queries, contexts, batches, doc_tokens: int, query_tokens: int,
            weights_bytes: int, kv_per_token: int, bandwidth: float, smoke: bool) -> list[dict]:
    """The rows of one engine (one decode forward): every context and batch, requests aborted after each."""
    runner = engine.runner
    rows = []
    for ctx in contexts:
        names = list(docs)[:ctx // doc_tokens]
        for batch in batches:
            reqs = [Request("", [(d, " ".join(map(str, docs[d]))) for d in names], " ".join(map(str, q)))
                    for q in queries[:batch]]
            params = SamplingParams(max_tokens=400, temperature=0.0)
            rids = [engine.add_request(r, params, "reuse") for r in reqs]
            last = {}
            warm, n = (3, 4) if smoke else (20, 60)      # --smoke: the interpreted kernels take ~1 s a step
            for _ in range(warm):                        # prefill, then a few decode steps
                last.update((o.request_id, o) for o in engine.step())
            common_sync(smoke)
            t = time.perf_counter()
            for _ in range(n):
                last.update((o.request_id, o) for o in engine.step())
            common_sync(smoke)
            wall = (time.perf_counter() - t) / n * 1e3
            bucket = runner.bucket()
            tokens = sum(len(last[i].token_ids) for i in rids) / batch
            context = 1 + len(names) * doc_tokens + query_tokens + tokens
            floors = {"gemm": 1e3 * weights_bytes / bandwidth,
                      "attention": 1e3 * batch * context * kv_per_token / bandwidth}
            row = dict(path=path, context=ctx, batch=batch, bucket=bucket, wall_ms=wall,
                       floor_ms=floors["gemm"] + floors["attention"])
            if not smoke:
                row["replay_ms"] = replay_ms(runner, bucket)
                groups = kernel_groups(runner, bucket, 3)
                for g, v in groups.items():
                    v["floor_ms"] = floors.get(g, 0.0)
                row["groups"] = groups
                row["kernels_ms"] = sum(v["ms"] for v in groups.values())
            rows.append(row)
            print(row, flush=True)
            for i in rids:
                engine.abort(i)
            while engine.has_unfinished():
                engine.step()
    return rows


def common_sync(smoke: bool) -> None:
    if not smoke:
        torch.cuda.synchronize()


if __name__ == "__main__":
    common.run_main(main)
