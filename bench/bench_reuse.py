"""TTFT with the document KV store (modes "reuse" / "hybrid") against dense and sift, in the same run.

The 8B Llama shape of bench_ttft.py (random bf16 weights, 32 layers, 32 query / 8 KV heads, head_dim 128),
prompts of `--contexts` tokens: 2048-token documents of random token ids and a 512-token query, bits from the
same anchor generator (tile 128). The first context's whole measurement runs once, discarded, before the table.
Per context, one request, each configuration the median of `--reps` after a warm-up (emptying the store for
"cold", or its HBM tier for "DRAM", happens before each timed call, untimed):

    dense           transformers + SDPA, plain forward of the unsegmented prompt
    query_only      transformers + SDPA forward of the 512-token query alone, no context: the floor of any
                    warm reuse (its MLPs and projections must run; only attention to the context is added)
    hf_cache        transformers + SDPA with the documents' KV already in a DynamicCache: only the query's
                    forward is timed (the peer: what a plain prefix cache gives)
    sift            SiftEngine mode "sift"
    reuse_cold      mode "reuse" with an empty store (every document computed after the profiling prefix, in the
                    request's own forward, and inserted); its TTFT ends when the call's stream is done;
                    reuse_cold_writeback_done also waits for the copy of the new entries to DRAM, which runs on
                    the store's side stream and outlives the call
    reuse_hbm       mode "reuse", every document in HBM
    reuse_dram      mode "reuse", every document in pinned DRAM only (promoted layer by layer on a side stream)
    hybrid_hbm      mode "hybrid:<--hybrid-policy>" (default: the engine's default policy), every document in HBM

First, the engine-level check on a two-document prompt: "reuse" and "hybrid" prefill and generation with the
Triton kernels against the torch backend on the same model. Also reported: the store's bookkeeping time (lookups,
page allocation) as a share of the warm TTFT, and the DRAM-warm run's host-to-device bytes over its TTFT
(achieved GB/s). Writes bench/results/reuse.json.

    python bench/bench_reuse.py [--contexts 16384,32768,65536] [--reps 3]
    python bench/bench_reuse.py --smoke     # tiny random Llama on CPU: checks the script runs
"""
from __future__ import annotations

import gc
import json
import pathlib
import statistics
import tempfile
import time

import common  # bench/common.py (the script's folder is on sys.path)

common.smoke_env()  # before any kernel module imports triton

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from bench_ttft import TILE, SyntheticIndex, anchor_bits, llama_config, timed, write_index  # noqa: E402
from common import IdTokenizer  # noqa: E402
from sift.runtime import KVStore, Request, SiftEngine, reuse  # noqa: E402


def build(smoke: bool, contexts: list[int], doc_tokens: int, tmp: pathlib.Path, hbm_gib: float, dram_gib: float):
    from transformers import AutoModelForCausalLM

    config = llama_config(smoke)
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    gen = torch.Generator().manual_seed(0)
    docs = {f"doc{i}": torch.randint(3, config.vocab_size, (doc_tokens,), generator=gen).tolist()
            for i in range(max(contexts) // doc_tokens)}
    vectors = config.num_hidden_layers * config.num_attention_heads
    bits = {d: anchor_bits(len(t), vectors, gen) for d, t in docs.items()}
    write_index(tmp / "index", docs, bits, tile=TILE, config=config)
    index = SyntheticIndex.open(tmp / "index", device=device)
    store = KVStore(hbm_bytes=int(hbm_gib * 2**30), dram_bytes=int(dram_gib * 2**30))
    engine = SiftEngine(model, IdTokenizer(config.bos_token_id, config.eos_token_id), index, kv_store=store)
    return model, engine, store, docs, gen


def hf_cache_ttft(model, engine: SiftEngine, req: Request, reps: int) -> float:
    """The query's forward over the context's KV held in a DynamicCache (the context prefilled once, untimed)."""
    ids = engine.prompt_ids(req)
    n_query = len(engine.tokenize(req)[-1][1])
    context = torch.tensor([ids[:-n_query]], device=engine.device)
    query = torch.tensor([ids[-n_query:]], device=engine.device)
    with torch.inference_mode():
        cache = model(input_ids=context, use_cache=True, logits_to_keep=1).past_key_values
        positions = torch.arange(context.shape[1], len(ids), device=engine.device)[None]

        def run():
            out = model(input_ids=query, position_ids=positions, past_key_values=cache, use_cache=True,
                        logits_to_keep=1).logits
            cache.crop(-query.shape[1])   # back to the context alone
            return out

        t, _ = timed(run, reps)
    assert isinstance(cache, DynamicCache)
    del cache
    return t


def check_backends(model, engine: SiftEngine, store: KVStore, req: Request) -> dict:
    """The engine-level check of the kernels on the reuse path: modes "reuse" (cold, then warm) and "hybrid"
    with the Triton backend against the torch backend (SDPA per request, the kernels' ref twins for the
    decode) on the same model and store, greedy generation included."""
    twin = SiftEngine(model, engine.tokenizer, engine.index, kv_store=store, backend="torch")
    out = {}
    for mode in ("reuse", "hybrid"):
        store.clear()
        a = engine.generate([req, req], max_new_tokens=4, mode=mode)
        store.clear()
        b = twin.generate([req, req], max_new_tokens=4, mode=mode)
        out[f"{mode}_rel_err_triton_vs_torch"] = common.rel_err(a.prefill.logits, b.prefill.logits)
        out[f"{mode}_tokens_equal"] = a.token_ids == b.token_ids
    store.clear()
    cold = engine.prefill([req], mode="reuse")
    warm = engine.prefill([req], mode="reuse")
    out["warm_equals_cold_max_abs"] = float((warm.logits - cold.logits).abs().max())
    store.clear()
    return out


def timed_after(setup, fn, reps: int) -> tuple[float, float, object]:
    """Median seconds of `reps` calls of fn after one warm-up, `setup` run (and the whole device synchronised)
    before each call, outside the timed region: until the call's own stream is done (its TTFT: the logits are
    ready), and until the whole device is (the KV store's write-back to DRAM, which runs on a side stream and
    outlives the call, included)."""
    ttft, drained, out = [], [], None
    cuda = torch.cuda.is_available()
    for rep in range(reps + 1):
        setup()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.current_stream().synchronize()
        t1 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
        if rep:
            ttft.append(t1 - t0)
            drained.append(time.perf_counter() - t0)
    return statistics.median(ttft), statistics.median(drained), out


def measure(model, engine: SiftEngine, store: KVStore, req: Request, reps: int, policy: str) -> dict:
    prompt = torch.tensor([engine.prompt_ids(req)], device=engine.device)

    @torch.inference_mode()
    def dense():
        return model(input_ids=prompt, logits_to_keep=1).logits[0, -1].float()

    query = torch.tensor([engine.tokenize(req)[-1][1]], device=engine.device)

    @torch.inference_mode()
    def query_only():
        return model(input_ids=query, logits_to_keep=1).logits

    row = {}
    row["dense_s"], dense_logits = timed(dense, reps)
    row["query_only_s"], _ = timed(query_only, reps)
    row["hf_cache_s"] = hf_cache_ttft(model, engine, req, reps)
    row["sift_s"], sift = timed(lambda: engine.prefill([req], mode="sift"), reps)

    reuse = lambda: engine.prefill([req], mode="reuse")  # noqa: E731
    row["reuse_cold_s"], row["reuse_cold_writeback_done_s"], res_cold = timed_after(store.clear, reuse, reps)
    row["reuse_hbm_s"], res_hbm = timed(lambda: engine.prefill([req], mode="reuse"), reps)
    assert res_hbm.store["computed"] == 0 and res_hbm.store["dram"] == 0, res_hbm.store

    before = store.stats()["bytes_h2d"]
    row["reuse_dram_s"], _, res_dram = timed_after(lambda: store.clear(dram=False), reuse, reps)
    moved = [(store.stats()["bytes_h2d"] - before) // (reps + 1)]
    assert res_dram.store["dram"] == len(req.docs), res_dram.store
    row["hybrid_hbm_s"], res_hyb = timed(lambda: engine.prefill([req], mode=f"hybrid:{policy}"), reps)
    for name in ("hf_cache", "sift", "reuse_cold", "reuse_hbm", "reuse_dram", "hybrid_hbm"):
        row[f"{name}_speedup"] = row["dense_s"] / row[f"{name}_s"]
    row["reuse_cold_over_sift"] = row["reuse_cold_s"] / row["sift_s"]
    row["store_bookkeeping_fraction_hbm"] = res_hbm.stages["store"] / res_hbm.stages["total"]
    row["dram_bytes_h2d"] = moved[-1]
    row["dram_h2d_gbps_over_ttft"] = moved[-1] / row["reuse_dram_s"] / 1e9
    row["tile_fraction"] = dict(sift=sift.tile_fraction, reuse=res_hbm.tile_fraction, hybrid=res_hyb.tile_fraction,
                                reuse_cold=res_cold.tile_fraction)
    row["hybrid_recomputed_fraction"] = res_hyb.recomputed_fraction
    row["stages_reuse_hbm"] = res_hbm.stages
    row["stages_reuse_dram"] = res_dram.stages
    row["rel_err_vs_dense"] = {
        "sift": common.rel_err(sift.logits[0], dense_logits), "reuse": common.rel_err(res_hbm.logits[0], dense_logits),
        "hybrid": common.rel_err(res_hyb.logits[0], dense_logits)}
    row["warm_equals_cold_max_abs"] = float((res_hbm.logits - res_cold.logits).abs().max())
    return row


def main() -> None:
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="16384,32768,65536")
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--query-tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hybrid-policy", default=reuse.DEFAULT_POLICY, help="policy of the hybrid row")
    ap.add_argument("--hbm-gib", type=float, default=24.0, help="the store's HBM pool")
    ap.add_argument("--dram-gib", type=float, default=24.0, help="the store's pinned DRAM tier")
    args = ap.parse_args()
    if args.smoke:
        args.contexts, args.doc_tokens, args.query_tokens, args.reps = "512", 128, 32, 1
        args.hbm_gib, args.dram_gib = 0.05, 0.05
    elif not torch.cuda.is_available():
        raise SystemExit("bench_reuse needs a CUDA GPU (or --smoke)")
    contexts = [int(x) for x in args.contexts.split(",") if x]
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model, engine, store, docs, gen = build(args.smoke, contexts, args.doc_tokens, pathlib.Path(tmp),
                                                args.hbm_gib, args.dram_gib)
        query = " ".join(map(str, torch.randint(3, model.config.vocab_size, (args.query_tokens,),
                                                generator=gen).tolist()))
        small = list(docs)[:2]
        check = check_backends(model, engine, store, Request("", [(d, " ".join(map(str, docs[d]))) for d in small],
                                                              query))
        print(json.dumps(check), flush=True)
        for i, ctx in enumerate(contexts):
            names = list(docs)[: ctx // args.doc_tokens]
            req = Request("", [(d, " ".join(map(str, docs[d]))) for d in names], query)
            if i == 0:   # the whole measurement once, discarded: clocks, allocator and kernel caches settle
                measure(model, engine, store, req, 1, args.hybrid_policy)
                store.clear()
            row = dict(context=ctx, documents=len(names),
                       **measure(model, engine, store, req, args.reps, args.hybrid_policy))
            print(json.dumps(row), flush=True)
            rows.append(row)
            store.clear()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        stats = store.stats()
    setup = dict(model="llama-8B-shape random bf16" if not args.smoke else "tiny llama fp32 cpu",
                 doc_tokens=args.doc_tokens, query_tokens=args.query_tokens, reps=args.reps, tile=TILE,
                 hbm_gib=args.hbm_gib, dram_gib=args.dram_gib, block=engine.block, smoke=args.smoke,
                 hybrid_policy=args.hybrid_policy)
    common.write_result("reuse", dict(setup=setup, seconds=time.perf_counter() - t0, check=check, rows=rows,
                                      store=stats),
                        common.out_dir(args))
    print(f"\n{'context':>8} {'dense':>8} {'hf_cache':>9} {'sift':>8} {'cold':>8} {'hbm':>8} {'dram':>8} "
          f"{'hybrid':>8}   speedups vs dense (hbm / dram / hybrid)")
    for r in rows:
        print(f"{r['context']:>8} " + " ".join(f"{r[k] * 1e3:>7.1f}ms" for k in (
            "dense_s", "hf_cache_s", "sift_s", "reuse_cold_s", "reuse_hbm_s", "reuse_dram_s", "hybrid_hbm_s"))
            + f"   {r['reuse_hbm_speedup']:.1f}x / {r['reuse_dram_speedup']:.1f}x / {r['hybrid_hbm_speedup']:.1f}x")


if __name__ == "__main__":
    main()
