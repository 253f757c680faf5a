"""A RAG request trace through the document KV store: hit ratios per tier and TTFT, against the HBM budget.

10,000 documents of 2048 tokens, requests of N distinct documents (N those of the measured row below) drawn by
Zipf popularity (alpha 0.8 / 1.0 / 1.2) in random order, the HBM budget swept from 1 to 40 GiB with a pinned DRAM tier behind it. The trace runs
through the store's own code (`KVStore.lease` / `commit` / `release`: its LRU, pinning, write-back, demotion
and promotion), with pages scaled down: the pool has exactly as many pages as the 8B Llama shape would have in
that budget (one page = 128 tokens of K and V, 32 layers, 8 KV heads, head_dim 128, bf16 = 16 MiB), each page
just holds a few bytes, so the bookkeeping is the real one without the memory.

TTFT per request is then modelled from the per-request costs measured on the GPU by bench_reuse.py (its JSON
in bench/results/reuse.json, the row of --costs-context, by default its shortest context: N documents of 2048
tokens + a 512-token query, the shape of a request here): the HBM-warm TTFT, plus per DRAM-hit document 1/N of
(DRAM-warm - HBM-warm), plus per missed document 1/N of (cold - HBM-warm). Dense and sift TTFT are those measured ones (no cache). The model assumes
per-document costs add up, which the measured rows support only approximately: it is labelled as a model.

Also: the memory one document uses when 8 requests of one batch hold it at 8 different offsets, measured with
the engine itself on a small random Llama on CPU (pool pages referenced by the 8 block tables, store bytes).

A budget below one request's pages (N x 256 MiB of documents plus its own pages) is refused by the store, as the engine refuses it: such points are reported as not feasible. Checks (exit status 1 after writing the
result if one fails): the store ends every trace with nothing pinned and within its capacities, and the 8 requests
of the one-copy measurement point at one set of pages.

Routing across a cluster (`--replicas N`, default 8): the same trace over N replicas, each with a store of its
own (`--route-hbm-gib` and `--dram-gib` per replica), routed by the server's policy
(`sift.runtime.server.routing.rank`: most of the request's documents held, load as the tie-breaker) or at random
(what a load balancer that ignores documents does). Load is the requests in flight on each replica, modelled as
its share of the last 4N requests routed (a busy cluster holding about 4 requests per replica). The bound beside
them: one store holding all N replicas' memory ("pooled"), what a perfect partition of the documents reaches.
Reported per policy: the share of requests landing on a replica that holds all of their documents (and the mean
share held), the documents' HBM / DRAM / miss ratios, the modelled TTFT, and the busiest replica's share of
requests.

    python bench/bench_trace.py [--requests 6000] [--alphas 0.8,1.0,1.2] [--hbm-gib 1,2.5,5,10,20,40]
        [--replicas 8] [--route-hbm-gib 10,20] [--costs-context 32768]
    python bench/bench_trace.py --smoke
"""
from __future__ import annotations

import collections
import json
import pathlib
import random
import time

import common  # bench/common.py

common.smoke_env()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from sift.runtime.kv_store import Geometry, KVStore  # noqa: E402

BLOCK, LAYERS, KV_HEADS, HEAD_DIM = 128, 32, 8, 128
REAL_PAGE = 2 * LAYERS * KV_HEADS * BLOCK * HEAD_DIM * 2            # 16 MiB
TINY = Geometry(n_layers=1, n_kv_heads=1, head_dim=2, block=BLOCK, dtype=torch.float16, device=torch.device("cpu"))


def zipf_requests(n_docs: int, n_requests: int, per_request: int, alpha: float, rng) -> list[list[int]]:
    weights = 1.0 / np.arange(1, n_docs + 1) ** alpha
    weights /= weights.sum()
    ranks = rng.permutation(n_docs)                 # popularity is not correlated with document ids
    out = []
    for _ in range(n_requests):
        docs = set()
        while len(docs) < per_request:
            docs.update(rng.choice(n_docs, size=per_request - len(docs), p=weights).tolist())
        out.append([int(ranks[d]) for d in rng.permutation(sorted(docs))])
    return out


def run_trace(requests, hbm_gib: float, dram_gib: float, doc_tokens: int, warmup: int,
              checks: common.Checks) -> dict:
    """The requests through a store with the 8B shape's page counts -> per-request (hbm, dram, miss) counts."""
    pages = int(hbm_gib * 2**30) // REAL_PAGE
    dram_pages = int(dram_gib * 2**30) // REAL_PAGE
    store = KVStore(hbm_bytes=pages * TINY.page_bytes, dram_bytes=dram_pages * TINY.page_bytes)
    store.attach(TINY, "trace")
    own = -(-512 // BLOCK) + 1                      # the query's pages and the prefix's
    counts = []
    for i, docs in enumerate(requests):
        lease = store.lease({f"d{d}": doc_tokens for d in docs}, scratch_pages=own)
        st = list(lease.status.values())
        lease.commit()
        lease.release()
        if i >= warmup:
            counts.append((st.count("hbm"), st.count("dram"), st.count("miss")))
    s = store.stats()
    checks.true(f"trace/{hbm_gib:g}GiB/store_released_and_within_capacity",
                s["pinned"] == 0 and s["hbm_bytes"] <= s["hbm_capacity"] and s["dram_bytes"] <= s["dram_capacity"],
                f"pinned {s['pinned']}, HBM {s['hbm_bytes']} of {s['hbm_capacity']}, DRAM {s['dram_bytes']} of "
                f"{s['dram_capacity']}")
    return dict(counts=np.array(counts), pages=pages, dram_pages=dram_pages, stats=s)


def route_trace(requests, replicas: int, policy: str, hbm_gib: float, dram_gib: float, doc_tokens: int,
                warmup: int, checks: common.Checks, seed: int = 0) -> dict:
    """The requests over `replicas` stores (the 8B shape's page counts each), routed by `policy` ("affinity":
    the server's `rank`; "random"; "pooled": one store of all replicas' memory, the bound a perfect partition
    of the documents would reach) -> per-request (hbm, dram, miss) counts and requests per replica."""
    from sift.runtime.server.routing import ReplicaView, rank

    pooled = policy == "pooled"
    pages = int(hbm_gib * 2**30) // REAL_PAGE * (replicas if pooled else 1)
    dram_pages = int(dram_gib * 2**30) // REAL_PAGE * (replicas if pooled else 1)
    stores = []
    for _ in range(1 if pooled else replicas):
        store = KVStore(hbm_bytes=pages * TINY.page_bytes, dram_bytes=dram_pages * TINY.page_bytes)
        store.attach(TINY, "trace")
        stores.append(store)
    own = -(-512 // BLOCK) + 1
    rng = random.Random(seed)
    in_flight = collections.deque(maxlen=4 * replicas)
    counts, served = [], np.zeros(replicas, dtype=np.int64)
    for i, docs in enumerate(requests):
        keys = [f"d{d}" for d in docs]
        if policy == "affinity":
            load = collections.Counter(in_flight)
            views = []
            for r, store in enumerate(stores):
                st = store.stats()
                held = st["entries_hbm"] + st["entries_dram"]
                views.append(ReplicaView(r, sum(k in store for k in keys), load[r], held))
            chosen = rank(views, rng=rng)[0]
        elif pooled:
            chosen = 0
        else:
            chosen = rng.randrange(replicas)
        in_flight.append(chosen)
        lease = stores[chosen].lease({k: doc_tokens for k in keys}, scratch_pages=own)
        st = list(lease.status.values())
        lease.commit()
        lease.release()
        if i >= warmup:
            counts.append((st.count("hbm"), st.count("dram"), st.count("miss")))
            served[chosen] += 1
    pinned = sum(s.stats()["pinned"] for s in stores)
    checks.true(f"routing/{policy}/{hbm_gib:g}GiB/store_released", pinned == 0, f"{pinned} entries pinned")
    return dict(counts=np.array(counts), served=served)


def ttft_model(costs: dict, counts: np.ndarray, per_request: int) -> np.ndarray:
    hbm, dram, miss = costs["reuse_hbm_s"], costs["reuse_dram_s"], costs["reuse_cold_s"]
    return hbm + counts[:, 1] * (dram - hbm) / per_request + counts[:, 2] * (miss - hbm) / per_request


def one_copy_check() -> dict:
    """8 requests of one batch hold one document at 8 offsets: the store keeps one copy, every block table
    points at the same pages."""
    from bench_reuse import build
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model, engine, store, docs, _ = build(True, [8 * 64], 64, pathlib.Path(tmp), 0.05, 0.0)
        from sift.runtime import Request, SamplingParams
        names = list(docs)[:8]
        text = {d: " ".join(map(str, docs[d])) for d in names}
        reqs = [Request("", [(d, text[d]) for d in names[i:] + names[:i]], "1 2 3") for i in range(8)]
        group = engine._group(reqs, SamplingParams(max_tokens=1, temperature=0.0), "reuse", timed=True)
        engine._prefill_only(group)
        doc0_pages, offsets = set(), set()
        blk = engine.block
        for r, state in enumerate(group.states):
            d = (8 - r) % 8                # the ordinal of names[0] inside request r
            seg_blocks = [-(-len(ids) // blk) for _, ids in state.segments]   # prefix, documents, query
            f, n = sum(seg_blocks[:1 + d]), seg_blocks[1 + d]
            doc0_pages.add(tuple(state.table[0][f:f + n].tolist()))
            offsets.add(int(state.table[1][f]))
        s = store.stats()
        entry_bytes = -(-len(docs[names[0]]) // blk) * store.geometry.page_bytes
        return dict(requests=8, distinct_page_lists_of_the_document=len(doc0_pages), offsets=sorted(offsets),
                    store_entries=s["entries_hbm"], store_hbm_bytes=s["hbm_bytes"],
                    one_document_bytes=entry_bytes, copies_per_document=s["hbm_bytes"] / (8 * entry_bytes))


def routing(args, costs: dict, per_request: int, rng, checks: common.Checks) -> list[dict]:
    """Affinity against random routing over --replicas stores, for each alpha and --route-hbm-gib."""
    rows = []
    for alpha in map(float, args.alphas.split(",")):
        reqs = zipf_requests(args.documents, args.requests + args.warmup, per_request, alpha, rng)
        for gib in map(float, args.route_hbm_gib.split(",")):
            for policy in ("affinity", "random", "pooled"):
                t = route_trace(reqs, args.replicas, policy, gib, args.dram_gib, 2048, args.warmup, checks)
                c = t["counts"]
                n = c.sum(0) / c.sum()
                ttft = ttft_model(costs, c, per_request)
                row = dict(alpha=alpha, replicas=args.replicas, hbm_gib=gib, dram_gib=args.dram_gib, policy=policy,
                           all_docs_warm=float(((c[:, 0] + c[:, 1]) == per_request).mean()),
                           all_docs_in_hbm=float((c[:, 0] == per_request).mean()),
                           warm_share=float(n[0] + n[1]), hit_hbm=float(n[0]), hit_dram=float(n[1]), miss=float(n[2]),
                           ttft_mean_s=float(ttft.mean()), ttft_p99_s=float(np.percentile(ttft, 99)),
                           busiest_share=None if policy == "pooled" else float(t["served"].max() / t["served"].sum()))
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def plot(result: dict, path: pathlib.Path) -> None:
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    fig = Figure(figsize=(11, 4.2))
    ax1, ax2 = fig.subplots(1, 2)
    for alpha, rows in result["alphas"].items():
        rows = [r for r in rows if r["feasible"]]
        x = [r["hbm_gib"] for r in rows]
        ax1.plot(x, [r["hit_hbm"] for r in rows], "o-", label=f"HBM hits, alpha {alpha}")
        ax1.plot(x, [r["hit_hbm"] + r["hit_dram"] for r in rows], "x--", label=f"HBM + DRAM, alpha {alpha}")
        ax2.plot(x, [r["ttft_mean_s"] * 1e3 for r in rows], "o-", label=f"mean, alpha {alpha}")
        ax2.plot(x, [r["ttft_p99_s"] * 1e3 for r in rows], "x--", label=f"p99, alpha {alpha}")
    c = result["costs"]
    ax2.axhline(c["dense_s"] * 1e3, color="k", lw=1, label="dense")
    ax2.axhline(c["sift_s"] * 1e3, color="grey", lw=1, ls=":", label="sift")
    ax1.set(xscale="log", xlabel="HBM budget (GiB)", ylabel="share of documents", title="Hit ratio per tier")
    ax2.set(xscale="log", ylim=(0, None), xlabel="HBM budget (GiB)", ylabel="TTFT (ms, modelled)",
            title=f"TTFT per request ({result['per_request']} x 2K documents + 512-token query)")
    budgets = sorted({r["hbm_gib"] for rows in result["alphas"].values() for r in rows if r["feasible"]})
    for ax in (ax1, ax2):
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--documents", type=int, default=10_000)
    ap.add_argument("--requests", type=int, default=6_000)
    ap.add_argument("--warmup", type=int, default=1_000, help="requests run before counting")
    ap.add_argument("--alphas", default="0.8,1.0,1.2")
    ap.add_argument("--hbm-gib", default="1,2.5,5,10,20,40")
    ap.add_argument("--dram-gib", type=float, default=64.0)
    ap.add_argument("--replicas", type=int, default=8, help="replicas of the routing model")
    ap.add_argument("--route-hbm-gib", default="10,20", help="HBM budget per replica in the routing model")
    ap.add_argument("--costs", default=str(common.RESULTS / "reuse.json"),
                    help="bench_reuse.py's result: one of its rows gives the per-request costs")
    ap.add_argument("--costs-context", type=int, default=None,
                    help="the context of that row (default: the shortest measured); its documents make a request")
    args = ap.parse_args()
    if args.smoke:
        args.documents, args.requests, args.warmup, args.alphas, args.hbm_gib = 300, 200, 50, "1.0", "1,5"
        args.replicas, args.route_hbm_gib = 2, "5"
    t0 = time.perf_counter()
    measured = json.loads(pathlib.Path(args.costs).read_text())
    setup, rows = measured["setup"], measured["rows"]
    if (setup["doc_tokens"], setup["query_tokens"]) != (2048, 512):
        raise SystemExit(f"{args.costs} measured documents of {setup['doc_tokens']} tokens and a query of "
                         f"{setup['query_tokens']}: the trace models 2048 and 512 (re-run bench_reuse.py)")
    context = args.costs_context or min(r["context"] for r in rows)
    row = next((r for r in rows if r["context"] == context), None)
    if row is None:
        raise SystemExit(f"{args.costs} has no row of context {context} (it has "
                         f"{', '.join(str(r['context']) for r in rows)}): pass --costs-context")
    per_request = row["documents"]
    costs = {k: row[k] for k in ("dense_s", "sift_s", "reuse_cold_s", "reuse_hbm_s", "reuse_dram_s")}
    rng = np.random.default_rng(0)
    checks = common.Checks()
    result = dict(costs=costs, costs_context=context, documents=args.documents, requests=args.requests,
                  warmup=args.warmup, per_request=per_request, doc_tokens=2048, dram_gib=args.dram_gib, page_bytes_modelled=REAL_PAGE, alphas={})
    for alpha in map(float, args.alphas.split(",")):
        reqs = zipf_requests(args.documents, args.requests + args.warmup, per_request, alpha, rng)
        result["alphas"][str(alpha)] = []
        for gib in map(float, args.hbm_gib.split(",")):
            need = per_request * (2048 // BLOCK) + -(-512 // BLOCK) + 1
            if int(gib * 2**30) // REAL_PAGE < need:
                # the engine refuses such a store (every page a call attends to must fit): no reuse possible
                row = dict(hbm_gib=gib, feasible=False, needs_gib=need * REAL_PAGE / 2**30)
                result["alphas"][str(alpha)].append(row)
                print(json.dumps(dict(alpha=alpha, **row)), flush=True)
                continue
            t = run_trace(reqs, gib, args.dram_gib, 2048, args.warmup, checks)
            n = t["counts"].sum(0) / t["counts"].sum()
            ttft = ttft_model(costs, t["counts"], per_request)
            row = dict(hbm_gib=gib, feasible=True, hbm_pages=t["pages"], hit_hbm=float(n[0]), hit_dram=float(n[1]),
                       miss=float(n[2]), ttft_mean_s=float(ttft.mean()), ttft_p99_s=float(np.percentile(ttft, 99)),
                       speedup_mean_vs_dense=costs["dense_s"] / float(ttft.mean()),
                       speedup_mean_vs_sift=costs["sift_s"] / float(ttft.mean()),
                       evictions=t["stats"]["evictions"], demotions=t["stats"]["demotions"])
            result["alphas"][str(alpha)].append(row)
            print(json.dumps(dict(alpha=alpha, **row)), flush=True)
    result["routing"] = routing(args, costs, per_request, rng, checks)
    result["one_copy"] = one = one_copy_check()
    print(json.dumps(one), flush=True)
    checks.true("one_copy/one_set_of_pages", one["distinct_page_lists_of_the_document"] == 1
                and one["copies_per_document"] == 1.0,
                f"{one['distinct_page_lists_of_the_document']} page lists, {one['copies_per_document']} copies")
    result["seconds"] = time.perf_counter() - t0
    result["checks"], result["ok"] = checks.to_json(), checks.ok
    out = common.out_dir(args)
    common.write_result("trace", result, out)
    plot(result, out / "trace.png")
    print(f"wrote {out / 'trace.png'}")
    raise SystemExit(checks.exit_status())


if __name__ == "__main__":
    main()
