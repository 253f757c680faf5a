"""TTFT with the document KV store (modes "reuse" / "hybrid") against dense and sift, in the same run.

The 8B Llama shape of bench_ttft.py (random bf16 weights, 32 layers, 32 query / 8 KV heads, head_dim 128),
prompts of `--contexts` tokens: 2048-token documents of random token ids and a 512-token query, bits from the
same anchor generator (tile 128). The first context's whole measurement runs once, discarded, before the table.
Per context, one request, each configuration the median of `--reps` after a warm-up (emptying the store for
"cold", or its HBM tier for "DRAM", happens before each timed call, untimed):

    dense           transformers + SDPA, plain forward of the unsegmented prompt
    query_only      transformers + SDPA forward of the 512-token query alone, no context: the floor of any
                    warm reuse (its MLPs and projections must run; only attention to the context is added)
    hf_cache        the peer, a plain prefix cache: transformers + SDPA running only the query over the
                    documents' KV already in a cache (the context prefilled once, untimed), in the faster of
                    hf_dynamic  a DynamicCache: each layer's update concatenates the cached K / V with the
                                query's, a copy of the whole context's KV per layer and call (what a
                                DynamicCache does on every forward); `crop` then drops the query's entries
                                (a view, no copy), so that the cache serves the next request
                    hf_static   a StaticCache of exactly context + query slots: the query's K / V are written
                                into their slots in place, the context's are not copied; each layer's length
                                counter is then set back to the context's (no data moves)
                    Both are checked against the dense forward's logits before they are timed.
    sift            SiftEngine mode "sift"
    reuse_cold      mode "reuse" with an empty store (every document computed after the profiling prefix, in the
                    request's own forward, and inserted); its TTFT ends when the call's stream is done;
                    reuse_cold_writeback_done also waits for the copy of the new entries to DRAM, which runs on
                    the store's side stream and outlives the call
    reuse_hbm       mode "reuse", every document in HBM
    reuse_dram      mode "reuse", every document in pinned DRAM only (promoted layer by layer on a side stream)
    hybrid_hbm      mode "hybrid:<--hybrid-policy>" (default: the engine's default policy), every document in HBM
    modes           each mode of --modes (e.g. hybrid:first@0.3,auto@0.3,ape), every document in HBM, with its
                    share of the documents' tokens recomputed and its TTFT over sift's; the random documents
                    carry no context sensitivity, so "auto" recomputes them in prompt order after the first,
                    which costs what ranking by sensitivity costs

First, the engine-level check on a two-document prompt (bench_ttft.py `engine_check`): modes "reuse" and
"hybrid" through the Triton kernels against an fp32 run of the same weights through the kernels' ref twins,
within twice the error of the bf16 ref twins; greedy generations through both backends are recorded. Also
reported: the store's bookkeeping time (lookups, page allocation) as a share of the warm TTFT, and the DRAM-warm
run's host-to-device bytes over its TTFT (achieved GB/s). Every speed-up names its baseline: `*_speedup` is
against dense, `reuse_hbm_over_hf_cache` against the peer. Exit status 1 after writing the result if a check
failed. Writes bench/results/reuse.json.

    python bench/bench_reuse.py [--contexts 16384,32768,65536] [--reps 5]
    python bench/bench_reuse.py --smoke     # tiny random Llama on CPU, fp16, Triton interpreter: the script runs
"""
from __future__ import annotations

import copy
import gc
import json
import pathlib
import statistics
import tempfile
import time

import common  # bench/common.py (the script's folder is on sys.path)

common.smoke_env()  # before any kernel module imports triton

import torch  # noqa: E402
from transformers import DynamicCache, StaticCache  # noqa: E402

from bench_ttft import TWIN_FACTOR, build_llama, engine_check, masked_engine, random_docs, timed  # noqa: E402
from sift.runtime import KVStore, Request, SiftEngine, reuse  # noqa: E402
from sift.runtime.modes import Mode  # noqa: E402

# The peer's logits against the dense forward's, both transformers + SDPA on the same bf16 weights: the two
# attention calls (over the cache with a mask, and causal over the whole prompt) round P and their output
# differently, two roundings per layer.
PEER_ROUNDINGS_PER_LAYER = 2


def build(smoke: bool, contexts: list[int], doc_tokens: int, tmp: pathlib.Path, hbm_gib: float, dram_gib: float):
    model = build_llama(smoke)
    gen = torch.Generator().manual_seed(0)
    docs = random_docs(model.config, max(contexts) // doc_tokens, doc_tokens, gen)
    store = KVStore(hbm_bytes=int(hbm_gib * 2**30), dram_bytes=int(dram_gib * 2**30))
    engine = masked_engine(model, tmp, "anchor", docs, gen, kv_store=store)
    return model, engine, store, docs, gen


def hf_peer(model, engine: SiftEngine, req: Request, kind: str):
    """The peer (module docstring) over `req`'s context, prefilled now: -> (run, what a call writes), run() the
    query's forward over the cache (fp32 logits of its last position), the cache rewound after it."""
    ids = engine.prompt_ids(req)
    n_query = len(engine.tokenize(req)[-1][1])
    n_ctx = len(ids) - n_query
    context = torch.tensor([ids[:n_ctx]], device=engine.device)
    query = torch.tensor([ids[n_ctx:]], device=engine.device)
    positions = torch.arange(n_ctx, len(ids), device=engine.device)[None]
    cfg = model.config
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) \
        * model.dtype.itemsize     # K and V of one token, all layers
    if kind == "dynamic":
        cache = DynamicCache(config=cfg)
        copied = kv_bytes * len(ids)        # each layer's torch.cat writes the context's and the query's K / V

        def rewind():
            cache.crop(-n_query)            # drops the query's entries: a view of the context's, no copy
    else:
        cache = StaticCache(config=cfg, max_cache_len=len(ids))
        copied = kv_bytes * n_query         # the query's K / V written into their slots

        def rewind():
            for layer in cache.layers:      # each layer's length counter back to the context's
                layer.cumulative_length.fill_(n_ctx)
    with torch.inference_mode():
        model(input_ids=context, past_key_values=cache, use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def run():
        out = model(input_ids=query, position_ids=positions, past_key_values=cache, use_cache=True,
                    logits_to_keep=1).logits[0, -1].float()
        rewind()
        return out

    return run, dict(bytes_written_per_call=copied, context_tokens=n_ctx)


def hf_cache_ttft(model, engine: SiftEngine, req: Request, reps: int, kind: str, dense_logits: torch.Tensor,
                  checks: common.Checks) -> tuple[float, dict]:
    """The peer's TTFT (median seconds) and what a call writes; its logits checked against the dense forward's
    first (a loose bound: two bf16 computations of the whole model; `check_reuse` holds the peer to the tight
    one on the check prompt)."""
    run, info = hf_peer(model, engine, req, kind)
    run()   # the second call is checked: it runs on the rewound cache, as every timed call does
    checks.close(f"hf_{kind}/{len(engine.prompt_ids(req))}/logits_vs_dense", run(), dense_logits, model.dtype,
                 PEER_ROUNDINGS_PER_LAYER * model.config.num_hidden_layers)
    t, _ = timed(run, reps)
    return t, info


def check_reuse(model, engine: SiftEngine, store: KVStore, req: Request, checks: common.Checks) -> dict:
    """The engine-level check of the kernels on the reuse path (module docstring) and of the peer (its second
    call's logits against the fp32 forward, within TWIN_FACTOR x the bf16 dense forward's error); then warm and
    cold reuse give the same logits, and greedy generation through the Triton and torch backends (recorded:
    random weights give near-ties, where a correct bf16 run may pick either token)."""
    cfg = model.config
    page_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * engine.block * \
        (cfg.hidden_size // cfg.num_attention_heads) * 4                      # an fp32 page of the reference
    pages = len(engine.prompt_ids(req)) // engine.block + len(req.docs) + 4   # blocks, each segment's last one
    model32 = copy.deepcopy(model).float()
    out = engine_check(model, engine, req, ("reuse", "hybrid"), checks, store_gib=2 * pages * page_bytes / 2**30,
                       model32=model32)
    prompt = torch.tensor([engine.prompt_ids(req)], device=engine.device)
    with torch.inference_mode():
        dense, dense32 = (m(input_ids=prompt, logits_to_keep=1).logits[0, -1].float() for m in (model, model32))
    del model32
    for kind in ("dynamic", "static"):
        run, _ = hf_peer(model, engine, req, kind)
        run()
        checks.within_twin(f"hf_{kind}/logits_vs_fp32", run(), dense, dense32, factor=TWIN_FACTOR,
                           ref_dtype=torch.float32, depth=cfg.num_hidden_layers)
    twin = SiftEngine(model, engine.tokenizer, engine.index, kv_store=store, backend="torch", block=engine.block)
    for mode in ("reuse", "hybrid"):
        store.clear()
        a = engine.generate([req, req], max_new_tokens=4, mode=mode)
        store.clear()
        b = twin.generate([req, req], max_new_tokens=4, mode=mode)
        out[mode]["tokens_equal_triton_vs_torch"] = a.token_ids == b.token_ids
    store.clear()
    cold = engine.prefill([req], mode="reuse")
    warm = engine.prefill([req], mode="reuse")
    checks.equal("reuse/warm_equals_cold", warm.logits, cold.logits, "logits equal bit for bit")
    store.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
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


def measure(model, engine: SiftEngine, store: KVStore, req: Request, reps: int, policy: str,
            checks: common.Checks, modes: tuple[str, ...] = ()) -> dict:
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
    row["hf_dynamic_s"], row["hf_dynamic"] = hf_cache_ttft(model, engine, req, reps, "dynamic", dense_logits, checks)
    row["hf_static_s"], row["hf_static"] = hf_cache_ttft(model, engine, req, reps, "static", dense_logits, checks)
    row["hf_cache"] = min(("hf_dynamic", "hf_static"), key=lambda k: row[f"{k}_s"])
    row["hf_cache_s"] = row[f"{row['hf_cache']}_s"]
    row["sift_s"], sift = timed(lambda: engine.prefill([req], mode="sift"), reps)

    reuse = lambda: engine.prefill([req], mode="reuse")  # noqa: E731
    row["reuse_cold_s"], row["reuse_cold_writeback_done_s"], res_cold = timed_after(store.clear, reuse, reps)
    row["reuse_hbm_s"], res_hbm = timed(lambda: engine.prefill([req], mode="reuse"), reps)
    checks.true(f"reuse_hbm/{row_tokens(engine, req)}/all_hits_in_hbm",
                res_hbm.store["computed"] == 0 and res_hbm.store["dram"] == 0, str(res_hbm.store))

    before = store.stats()["bytes_h2d"]
    row["reuse_dram_s"], _, res_dram = timed_after(lambda: store.clear(dram=False), reuse, reps)
    moved = [(store.stats()["bytes_h2d"] - before) // (reps + 1)]
    checks.true(f"reuse_dram/{row_tokens(engine, req)}/all_hits_in_dram", res_dram.store["dram"] == len(req.docs),
                str(res_dram.store))
    row["hybrid_hbm_s"], res_hyb = timed(lambda: engine.prefill([req], mode=f"hybrid:{policy}"), reps)
    for name in ("hf_cache", "sift", "reuse_cold", "reuse_hbm", "reuse_dram", "hybrid_hbm"):
        row[f"{name}_speedup"] = row["dense_s"] / row[f"{name}_s"]
    row["reuse_cold_over_sift"] = row["reuse_cold_s"] / row["sift_s"]
    row["reuse_hbm_over_hf_cache"] = row["hf_cache_s"] / row["reuse_hbm_s"]     # the speed-up against the peer
    row["reuse_dram_over_hf_cache"] = row["hf_cache_s"] / row["reuse_dram_s"]
    row["store_bookkeeping_fraction_hbm"] = res_hbm.stages["store"] / res_hbm.stages["total"]
    row["dram_bytes_h2d"] = moved[-1]
    row["dram_h2d_gbps_over_ttft"] = moved[-1] / row["reuse_dram_s"] / 1e9
    row["tile_fraction"] = dict(sift=sift.tile_fraction, reuse=res_hbm.tile_fraction, hybrid=res_hyb.tile_fraction,
                                reuse_cold=res_cold.tile_fraction)
    row["hybrid_recomputed_fraction"] = res_hyb.recomputed_fraction
    row["stages_reuse_hbm"] = res_hbm.stages
    row["stages_reuse_dram"] = res_dram.stages
    # Sparse and reused attention are other computations than dense: their distance to it is reported, not gated.
    row["rel_err_vs_dense"] = {
        "sift": common.relative_error(sift.logits[0], dense_logits),
        "reuse": common.relative_error(res_hbm.logits[0], dense_logits),
        "hybrid": common.relative_error(res_hyb.logits[0], dense_logits)}
    checks.equal(f"reuse/{row_tokens(engine, req)}/warm_equals_cold", res_hbm.logits, res_cold.logits,
                 "logits equal bit for bit")
    row["modes"] = {}
    for mode in modes:  # every document already in HBM (the reuse rows above put it there)
        seconds, res = timed(lambda: engine.prefill([req], mode=mode), reps)
        row["modes"][mode] = dict(s=seconds, over_sift=seconds / row["sift_s"], speedup=row["dense_s"] / seconds,
                                  recomputed_fraction=res.recomputed_fraction, tile_fraction=res.tile_fraction,
                                  rel_err_vs_dense=common.relative_error(res.logits[0], dense_logits))
    return row


def row_tokens(engine: SiftEngine, req: Request) -> int:
    return len(engine.prompt_ids(req))


def main() -> None:
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="16384,32768,65536")
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--query-tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hybrid-policy", default=reuse.DEFAULT_POLICY, help="policy of the hybrid row")
    ap.add_argument("--hbm-gib", type=float, default=24.0, help="the store's HBM pool")
    ap.add_argument("--dram-gib", type=float, default=24.0, help="the store's pinned DRAM tier")
    ap.add_argument("--modes", default="", help="comma-separated reuse modes also timed HBM-warm, e.g. "
                    "hybrid:first@0.3,auto@0.3,ape")
    args = ap.parse_args()
    modes = tuple(m for m in args.modes.split(",") if m)
    for mode in modes:   # a misspelt mode fails here, before the model is built
        if not Mode.parse(mode).reuses:
            raise SystemExit(f"--modes: {mode!r} is not a reuse mode (reuse, hybrid..., auto..., ape...)")
    if args.smoke:
        args.contexts, args.doc_tokens, args.query_tokens, args.reps = "512", 128, 32, 1
        args.hbm_gib, args.dram_gib = 0.05, 0.05
    elif not torch.cuda.is_available():
        raise SystemExit("bench_reuse needs a CUDA GPU (or --smoke)")
    contexts = [int(x) for x in args.contexts.split(",") if x]
    t0 = time.perf_counter()
    rows, checks = [], common.Checks()
    with tempfile.TemporaryDirectory() as tmp:
        model, engine, store, docs, gen = build(args.smoke, contexts, args.doc_tokens, pathlib.Path(tmp),
                                                args.hbm_gib, args.dram_gib)
        query = " ".join(map(str, torch.randint(3, model.config.vocab_size, (args.query_tokens,),
                                                generator=gen).tolist()))
        small = list(docs)[:2]
        check = check_reuse(model, engine, store, Request("", [(d, " ".join(map(str, docs[d]))) for d in small],
                                                          query), checks)
        print(json.dumps(check), flush=True)
        for i, ctx in enumerate(contexts if checks.ok else []):   # a kernel that computes something else: no timing
            names = list(docs)[: ctx // args.doc_tokens]
            req = Request("", [(d, " ".join(map(str, docs[d]))) for d in names], query)
            if i == 0:   # the whole measurement once, discarded: clocks, allocator and kernel caches settle
                measure(model, engine, store, req, 1, args.hybrid_policy, common.Checks(), modes)
                store.clear()
            row = dict(context=ctx, documents=len(names),
                       **measure(model, engine, store, req, args.reps, args.hybrid_policy, checks, modes))
            print(json.dumps(row), flush=True)
            rows.append(row)
            store.clear()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        stats = store.stats()
    setup = dict(model="llama-8B-shape random bf16" if not args.smoke else "tiny llama fp16 cpu",
                 doc_tokens=args.doc_tokens, query_tokens=args.query_tokens, reps=args.reps, tile=engine.index.tile,
                 hbm_gib=args.hbm_gib, dram_gib=args.dram_gib, block=engine.block, smoke=args.smoke,
                 hybrid_policy=args.hybrid_policy, modes=list(modes))
    common.write_result("reuse", dict(setup=setup, seconds=time.perf_counter() - t0, check=check,
                                      checks=checks.to_json(), ok=checks.ok, rows=rows, store=stats),
                        common.out_dir(args))
    print(f"\n{'context':>8} {'dense':>8} {'hf_dyn':>8} {'hf_stat':>8} {'sift':>8} {'cold':>8} {'hbm':>8} "
          f"{'dram':>8} {'hybrid':>8}   HBM-warm reuse vs dense / vs the peer (the faster hf_*)")
    for r in rows:
        print(f"{r['context']:>8} " + " ".join(f"{r[k] * 1e3:>6.1f}ms" for k in (
            "dense_s", "hf_dynamic_s", "hf_static_s", "sift_s", "reuse_cold_s", "reuse_hbm_s", "reuse_dram_s",
            "hybrid_hbm_s")) + f"   {r['reuse_hbm_speedup']:.1f}x / {r['reuse_hbm_over_hf_cache']:.2f}x")
    print("(TTFT = median of the reps after a warm-up; dense = transformers + SDPA forward of the unsegmented prompt, "
          "hf_* = the same model running the query over the context's KV in a DynamicCache / StaticCache)")
    raise SystemExit(checks.exit_status())


if __name__ == "__main__":
    main()
