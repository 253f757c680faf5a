"""End-to-end generation on one GPU: time to first token, per-output-token time (TPOT) and whole-request latency
of `SiftEngine` (modes sift and reuse, warm) against transformers' `generate` (eager SDPA + DynamicCache, and a
static cache compiled by torch.compile), in the same run, each beside its memory-bandwidth floor.

Model and prompts as bench/bench_ttft.py: an 8B Llama shape with random bf16 weights made on the GPU, 2048-token
documents of random ids and a 512-token query per request (the requests of a batch share their documents, each
has its own query), bits from the anchor generator in a temporary index (tile 128). eos is switched off, so every
request generates exactly its tokens.

Per context (16K, 32K tokens of documents), batch (1, 8, 32) and system, one run of 256 tokens per request (after
a warm-up) gives: TTFT (all of the batch's first tokens out), latency of a 64-token and of a 256-token answer
(the batch's last request), TPOT = (t256 - t64) / 192, and tokens/s. The engine's requests go through the step
API (`add_request` then `step()`), as a server sends them: a large batch's prefills spread over the first steps.

Floor of a step: the bytes it must read (the weights it multiplies by, i.e. all but the embedding table, plus
every request's KV at its mean length over the timed steps) over the bandwidth of a large device-to-device copy
measured in this run ((read + written bytes) / time). Configurations whose KV or activations cannot fit are
skipped and listed.

Continuous batching (16K, modes reuse and sift): 8 requests decode 256 tokens; 8 more arrive one every 16 steps.
Reported: TTFT of the arrivals and the inter-token gaps of the running requests (median and p99: the steps that
prefill an arrival are the slow ones).

Writes bench/results/generate.json and prints a table last.

    python bench/bench_generate.py                 # H200: ~7 minutes (with the compiled cache at 16K, batch 1)
    python bench/bench_generate.py --quick         # 16K, batches 1 and 8, no compiled cache: ~2 minutes
    python bench/bench_generate.py --smoke         # tiny random Llama on CPU: checks the script runs
"""
from __future__ import annotations

import gc
import json
import pathlib
import statistics
import tempfile
import time

import common  # bench/common.py (the script's folder is on sys.path)
from common import IdTokenizer

common.smoke_env()  # before any kernel module imports triton

import torch  # noqa: E402

from bench_ttft import TILE, SyntheticIndex, anchor_bits, build_llama, write_index  # noqa: E402
from sift.runtime import Request, SamplingParams, SiftEngine  # noqa: E402

MARKS = (1, 64, 256)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(smoke: bool) -> float:
    """Bytes per second of a large device-to-device copy, counting the bytes read and the bytes written."""
    n = (64 << 20) if smoke else (4 << 30)
    device = "cpu" if smoke else "cuda"
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync()
    reps = 2 if smoke else 20
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync()
    bw = 2 * n * reps / (time.perf_counter() - t)
    del src, dst
    return bw


class Marks:
    """When each of MARKS' tokens came out, seconds after `t0`, per request (the batch's latest is reported)."""

    def __init__(self, marks: tuple[int, ...]):
        self.marks, self.t0, self.seen = marks, time.perf_counter(), {}

    def record(self, request: str, n_tokens: int) -> None:
        got = self.seen.setdefault(request, {})
        for m in self.marks:
            if n_tokens >= m and m not in got:
                got[m] = time.perf_counter() - self.t0

    def result(self, batch: int) -> dict:
        at = {m: max(s[m] for s in self.seen.values()) for m in self.marks}
        first, mid, last = self.marks
        tpot = (at[last] - at[mid]) / (last - mid)
        return dict(ttft_s=at[first], latency_mid_s=at[mid], latency_last_s=at[last], tpot_ms=1e3 * tpot,
                    tokens_per_s=batch / tpot)


class HFStreamer:
    """transformers' streamer interface: put() is called with the prompt, then once per generated step."""

    def __init__(self, marks: Marks, batch: int):
        self.marks, self.batch, self.calls = marks, batch, -1

    def put(self, value) -> None:
        self.calls += 1
        if self.calls:
            for r in range(self.batch):
                self.marks.record(str(r), self.calls)

    def end(self) -> None:
        pass


def hf_run(model, prompts: list[list[int]], marks: tuple[int, ...], static: bool) -> dict:
    """transformers' generate on the unsegmented prompts (equal lengths: no padding), greedy, exactly marks[-1]
    tokens."""
    ids = torch.tensor(prompts, device=model.device)
    m = Marks(marks)
    kwargs = dict(cache_implementation="static") if static else {}
    sync()
    m.t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=marks[-1], min_new_tokens=marks[-1],
                       do_sample=False, streamer=HFStreamer(m, len(prompts)), pad_token_id=0, **kwargs)
    sync()
    return m.result(len(prompts))


def engine_run(engine: SiftEngine, reqs: list[Request], mode: str, marks: tuple[int, ...]) -> dict:
    """The requests through the step API, all added at once, greedy, marks[-1] tokens each."""
    params = SamplingParams(max_tokens=marks[-1], temperature=0.0)
    sync()
    m = Marks(marks)
    for r in reqs:
        engine.add_request(r, params, mode)
    while engine.has_unfinished():
        for out in engine.step():
            m.record(out.request_id, len(out.token_ids))
    sync()
    return m.result(len(reqs))


def continuous(engine: SiftEngine, running: list[Request], arrivals: list[Request], mode: str, every: int,
               n_tokens: int) -> dict:
    """`running` decode n_tokens each; one of `arrivals` is added every `every` steps."""
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0)
    sync()
    for r in running:
        engine.add_request(r, params, mode)
    added, first, last_out, gaps, queue, step = {}, {}, {}, [], list(arrivals), 0
    running_ids = set()
    while engine.has_unfinished() or queue:
        if queue and step and step % every == 0:
            added[engine.add_request(queue.pop(0), params, mode)] = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id in added and o.request_id not in first:
                first[o.request_id] = now - added[o.request_id]
            if o.request_id not in added:
                running_ids.add(o.request_id)
                if o.request_id in last_out:
                    gaps.append(now - last_out[o.request_id])
                last_out[o.request_id] = now
        step += 1
    gaps.sort()
    ttfts = sorted(first.values())
    return dict(mode=mode, running=len(running), arrivals=len(arrivals), every_steps=every,
                arrival_ttft_median_s=statistics.median(ttfts), arrival_ttft_max_s=ttfts[-1],
                running_gap_median_ms=1e3 * statistics.median(gaps),
                running_gap_p99_ms=1e3 * gaps[int(0.99 * (len(gaps) - 1))],
                running_gap_max_ms=1e3 * gaps[-1])


def median_run(run, reps: int) -> dict:
    """Each figure's median over `reps` runs of `run()`."""
    runs = [run() for _ in range(reps)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def floor_ms(weights_bytes: int, kv_per_token: int, tokens: list[float], bandwidth: float) -> float:
    return 1e3 * (weights_bytes + kv_per_token * sum(tokens)) / bandwidth


def main() -> None:
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="16384,32768", help="document tokens per request, comma-separated")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--query-tokens", type=int, default=512)
    ap.add_argument("--hf-batches", default="1,8", help="batches run with transformers (its KV and prefill "
                    "activations must fit beside the weights)")
    ap.add_argument("--static", default="16384x1",
                    help="CONTEXTxBATCH list run with transformers' static cache compiled by torch.compile "
                         "(each compiles anew: about a minute or two); '' for none")
    ap.add_argument("--kv-gib", type=float, default=80.0, help="the engine's KV pool")
    ap.add_argument("--reps", type=int, default=1, help="timed runs per configuration after the warm-up (median)")
    ap.add_argument("--quick", action="store_true", help="16K, batches 1 and 8, no compiled cache")
    args = ap.parse_args()
    if args.quick:
        args.contexts, args.batches, args.static = "16384", "1,8", ""
    marks = MARKS
    if args.smoke:
        args.contexts, args.batches, args.hf_batches, args.static = "512", "1,2", "1,2", ""
        args.doc_tokens, args.query_tokens, args.kv_gib, marks = 128, 32, 0.125, (1, 4, 8)
    elif not torch.cuda.is_available():
        raise SystemExit("bench_generate needs a CUDA GPU (or --smoke)")
    contexts = [int(x) for x in args.contexts.split(",") if x]
    batches = [int(x) for x in args.batches.split(",") if x]
    hf_batches = {int(x) for x in args.hf_batches.split(",") if x}
    static = {tuple(int(v) for v in x.split("x")) for x in args.static.split(",") if x}
    t_start = time.perf_counter()

    model = build_llama(args.smoke, smoke_dtype=torch.float32)
    config, device, dtype = model.config, model.device, model.dtype
    model.generation_config.eos_token_id = None       # every request generates all its tokens
    itemsize = torch.finfo(dtype).bits // 8
    embed = model.get_input_embeddings().weight
    weights_bytes = sum(p.numel() for p in model.parameters()) * itemsize - embed.numel() * itemsize
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * itemsize
    bandwidth = copy_bandwidth(args.smoke)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; weights read per step {weights_bytes / 1e9:.2f} GB; "
          f"KV {kv_per_token / 1024:.0f} KiB per token", flush=True)

    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, config.vocab_size, (n,), generator=gen).tolist()

    n_docs = max(contexts) // args.doc_tokens
    docs = {f"doc{i}": ids(args.doc_tokens) for i in range(n_docs)}
    queries = [ids(args.query_tokens) for _ in range(max(batches) + 8)]

    def requests(ctx: int, batch: int, first: int = 0) -> list[Request]:
        names = list(docs)[:ctx // args.doc_tokens]
        return [Request("", [(d, " ".join(map(str, docs[d]))) for d in names], " ".join(map(str, q)))
                for q in queries[first:first + batch]]

    tok = IdTokenizer(config.bos_token_id, None)

    def prompt_len(ctx: int) -> int:
        return 1 + (ctx // args.doc_tokens) * args.doc_tokens + args.query_tokens

    rows, skipped = [], []

    def add(ctx: int, batch: int, system: str, res: dict) -> None:
        n = prompt_len(ctx)
        mean_len = [n + (marks[1] + marks[2]) / 2] * batch
        fl = floor_ms(weights_bytes, kv_per_token, mean_len, bandwidth)
        row = dict(context=ctx, prompt_tokens=n, batch=batch, system=system, **res, floor_ms=fl,
                   tpot_over_floor=res["tpot_ms"] / fl, floor_tokens_per_s=batch / (fl / 1e3))
        rows.append(row)
        print(json.dumps(row), flush=True)

    # ---- transformers first (its caches are freed before the engine's pool is made)
    free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 1 << 62
    for ctx in contexts:
        for batch in sorted(hf_batches & set(batches)):
            n = prompt_len(ctx) + marks[-1]
            # KV, plus the prefill's MLP activations (two intermediate-wide tensors per token, bf16)
            need = batch * n * (kv_per_token + 2 * config.intermediate_size * itemsize)
            prompts = [[config.bos_token_id] + [t for d in list(docs)[:ctx // args.doc_tokens] for t in docs[d]] + q
                       for q in queries[:batch]]
            for system, is_static in (("hf-eager", False), ("hf-static-compiled", True)):
                if is_static and (ctx, batch) not in static:
                    continue
                if need > 0.8 * free:
                    skipped.append(dict(context=ctx, batch=batch, system=system, reason="memory"))
                    continue
                t = time.perf_counter()
                hf_run(model, prompts, marks, is_static)     # warm-up (a static cache compiles here)
                warm = time.perf_counter() - t
                res = median_run(lambda: hf_run(model, prompts, marks, is_static), args.reps)
                res["warmup_s"] = warm
                add(ctx, batch, system, res)
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    if hasattr(model, "_cache"):
        model._cache = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    # ---- the engine
    with tempfile.TemporaryDirectory() as tmp:
        vectors = config.num_hidden_layers * config.num_attention_heads
        bits = {d: anchor_bits(len(t), vectors, gen) for d, t in docs.items()}
        write_index(pathlib.Path(tmp) / "index", docs, bits, tile=TILE, config=config)
        index = SyntheticIndex.open(pathlib.Path(tmp) / "index", device=device)
        engine = SiftEngine(model, tok, index, kv_cache_bytes=int(args.kv_gib * 2**30))
        t = time.perf_counter()
        engine.warmup()
        capture_s = time.perf_counter() - t
        pool_pages = engine.kv_store.n_pages
        for ctx in sorted(contexts, reverse=True):   # compiles the kernels for each prompt shape (a batch's
            for mode in ("sift", "reuse"):           # requests prefill one by one) and stores every document
                engine_run(engine, requests(ctx, 1), mode, (1, 2, 4))
        for ctx in contexts:
            for batch in batches:
                for mode in ("sift", "reuse"):
                    reqs = requests(ctx, batch)
                    own = prompt_len(ctx) if mode == "sift" else args.query_tokens + 2 * engine.block
                    pages = batch * -(-(own + marks[-1]) // engine.block)
                    if pages > pool_pages:
                        skipped.append(dict(context=ctx, batch=batch, system=mode, reason="KV pool"))
                        continue
                    add(ctx, batch, mode, median_run(lambda: engine_run(engine, reqs, mode, marks), args.reps))
        cont = []
        n_run = 2 if args.smoke else 8
        for mode in ("reuse", "sift"):
            cont.append(continuous(engine, requests(contexts[0], n_run), requests(contexts[0], n_run, first=n_run),
                                   mode, every=2 if args.smoke else 16, n_tokens=marks[-1]))
            print(json.dumps(cont[-1]), flush=True)

    setup = dict(contexts=contexts, batches=batches, doc_tokens=args.doc_tokens, query_tokens=args.query_tokens,
                 marks=marks, tile=TILE, kv_gib=args.kv_gib, bandwidth_bytes_per_s=bandwidth,
                 weights_bytes_read=weights_bytes, kv_bytes_per_token=kv_per_token, capture_s=capture_s,
                 reps=args.reps, quick=args.quick, smoke=args.smoke)
    common.write_result("generate", dict(setup=setup, seconds=time.perf_counter() - t_start, rows=rows,
                                         continuous=cont, skipped=skipped), common.out_dir(args))
    first, mid, last = marks
    print(f"\n{'ctx':>6} {'batch':>5} {'system':<19} {'TTFT':>8} {f'+{mid}':>8} {f'+{last}':>8} {'TPOT':>8} "
          f"{'floor':>7} {'x floor':>7} {'tok/s':>7}")
    for r in rows:
        print(f"{r['context'] / 1024:>5g}K {r['batch']:>5} {r['system']:<19} {r['ttft_s'] * 1e3:>6.0f}ms "
              f"{r['latency_mid_s']:>7.2f}s {r['latency_last_s']:>7.2f}s {r['tpot_ms']:>6.2f}ms "
              f"{r['floor_ms']:>5.2f}ms {r['tpot_over_floor']:>7.2f} {r['tokens_per_s']:>7.0f}")
    for c in cont:
        print(f"continuous {c['mode']}: {c['running']} running + {c['arrivals']} arrivals every {c['every_steps']} "
              f"steps: arrival TTFT median {c['arrival_ttft_median_s'] * 1e3:.0f} ms, running gap median "
              f"{c['running_gap_median_ms']:.2f} ms / p99 {c['running_gap_p99_ms']:.2f} ms")
    for s in skipped:
        print(f"skipped: {s}")
    print(f"(floor = (weights read + every request's KV) / copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
          f"{time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    common.run_main(main)
