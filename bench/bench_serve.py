"""sift-serve under load on one GPU: Poisson arrivals at increasing rates over HTTP, modes dense, sift and reuse of
one server, and plain transformers `generate` behind the same HTTP app, in the same run.

Model and corpus: the 8B Llama shape of bench/bench_ttft.py with random bf16 weights made on the GPU; 1,000
documents of 2,048 random token ids, bits from bench_ttft's anchor generator in a temporary index (tile 128);
token ids travel as text (bench/common.py `IdTokenizer`). Each request: 16 distinct documents drawn by Zipf
popularity (alpha 1.0, bench/bench_trace.py's sampler), a 512-token query of its own, 64-256 output tokens
(uniform), greedy, eos off, streamed from `POST /v1/completions` (`documents` and `sift_mode` in the body).

The server runs in a child process (one engine, `sift-serve --replicas 0`'s app: an EngineWorker driving the
step API; its KV store `--kv-hbm-gib` in HBM and `--kv-dram-gib` pinned DRAM), the load generator in this one.
The transformers peer is the same FastAPI app over a worker that runs `model.generate` (SDPA, DynamicCache) on
one request at a time, FIFO, streaming its tokens: how a model is served without a batching engine. The peer and
the engine share the model's weights, so the systems run one after another.

Per system, rates rise until the system saturates (fewer than half its requests within the SLO, or a p50 TTFT
over 10 s); each rate's arrivals last `--window-s` (at least `--min-requests` requests), then the requests still
running get `--drain-s` before they are cancelled (the client disconnects; they count as missed). Reported per
rate: throughput (completed requests / s and output tokens / s), p50 / p99 TTFT and TPOT (per request:
(last token - first token) / (tokens - 1)), goodput (requests / s within the SLO: TTFT <= 1 s and TPOT <= 50 ms)
and the KV store's hits. Then, per system: the highest rate at which at least 90% of requests meet the SLO, the
idle TTFT (one request at a time) and p99 TTFT against it below saturation; and the HTTP layer's share of TTFT:
the client's TTFT minus the engine's own (add_request to its first token, header `x-sift-engine-ttft`) of the
same requests, at 1 request / s in reuse mode. The load generator is a minimal HTTP/1.1 client (`Client`: asyncio
streams, kept-alive connections, each request's JSON encoded before its clock starts), so a client's TTFT holds
the server and the loopback, not an HTTP library's own work (bench/serve_hops.py times each hop).

Checks (exit status 1 after writing the result if one fails): at every rate, each answered request got all its
tokens and its whole prompt (usage), no request failed other than by a 503, and once the rate is over the engine
holds nothing (no request, no pinned store entry, no page beyond the idle engine's).

Writes bench/results/serve.json and serve.png; prints a table last.

    python bench/bench_serve.py                   # H200: ~8 minutes
    python bench/bench_serve.py --smoke           # tiny random Llama on CPU: checks the script runs
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import pathlib
import statistics
import tempfile
import threading
import time

import common  # bench/common.py (the script's folder is on sys.path)

common.smoke_env()  # before any kernel module imports triton

import numpy as np  # noqa: E402
import torch  # noqa: E402

SLO_TTFT_S, SLO_TPOT_S = 1.0, 0.050
SYSTEMS = ("reuse", "sift", "dense", "transformers")
RATES = {"reuse": (0.5, 1, 2, 4, 6, 8), "sift": (0.25, 0.5, 1, 2), "dense": (0.125, 0.25, 0.5),
         "transformers": (0.1,)}
PROBE_TOKENS = 16       # output tokens of the warm-up and idle-TTFT requests
SMOKE_RATES = {"reuse": (1, 2), "sift": (1,), "dense": (1,), "transformers": (0.5,)}


# ------------------------------------------------------------------------------------------ the workload


def shape(args) -> dict:
    if args.smoke:
        return dict(documents=24, doc_tokens=64, per_request=4, query_tokens=16, out_min=4, out_max=8)
    return dict(documents=args.documents, doc_tokens=args.doc_tokens, per_request=args.per_request,
                query_tokens=args.query_tokens, out_min=args.out_min, out_max=args.out_max)


def corpus(sh: dict, vocab: int) -> list[list[int]]:
    """The documents' token ids (the same in the server and the client: one seeded generator)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (sh["doc_tokens"],), generator=gen).tolist() for _ in range(sh["documents"])]


def text(ids) -> str:
    return " ".join(map(str, ids))


# ------------------------------------------------------------------------------------- the server (child)


class GenerateWorker:
    """The transformers peer: `model.generate` on one request at a time (FIFO), its tokens streamed as the
    app's chunks. Same interface as EngineWorker (generate, snapshot, alive)."""

    def __init__(self, model, tokenizer, max_queue: int):
        import queue

        self.model, self.tokenizer, self.max_queue = model, tokenizer, max_queue
        self.jobs: queue.Queue = queue.Queue()
        self.waiting = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def snapshot(self) -> dict:
        return dict(replica="transformers", waiting=self.waiting, running=0)

    async def generate(self, call):
        from sift.runtime.server.errors import Overloaded
        from sift.runtime.server.protocol import Chunk

        if self.waiting >= self.max_queue:
            raise Overloaded(self.waiting, 1)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        self.waiting += 1
        self.jobs.put((call, loop, q, cancel, time.perf_counter()))
        n = 0
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                ids, n_prompt, ttft, done = item
                n += len(ids)
                yield Chunk(text=text(ids), token_ids=tuple(ids), finished=done,
                            finish_reason="length" if done else None, prompt_tokens=n_prompt, completion_tokens=n,
                            replica="transformers", engine_ttft_s=ttft)
                if done:
                    return
        finally:
            cancel.set()

    def _run(self) -> None:
        from transformers import StoppingCriteria, StoppingCriteriaList

        while True:
            call, loop, q, cancel, t0 = self.jobs.get()
            self.waiting -= 1
            if cancel.is_set():
                continue
            r = call.request
            ids = self.tokenizer(r.prefix).input_ids + [t for _, d in r.docs for t in self.tokenizer(
                d, add_special_tokens=False).input_ids] + self.tokenizer(r.query, add_special_tokens=False).input_ids
            worker = self

            class Stream:
                def __init__(self):
                    self.calls, self.first = -1, None

                def put(self, value):
                    self.calls += 1
                    if self.calls:      # the first call is the prompt
                        now = time.perf_counter()
                        first = None
                        if self.first is None:
                            self.first = first = now - t0
                        done = self.calls >= call.params.max_tokens
                        loop.call_soon_threadsafe(q.put_nowait, (value.view(-1).tolist(), len(ids), first, done))

                def end(self):
                    pass

            class Cancelled(StoppingCriteria):
                def __call__(self, input_ids, scores, **kwargs):
                    return cancel.is_set()

            try:
                with torch.inference_mode():
                    x = torch.tensor([ids], device=worker.model.device)
                    n = call.params.max_tokens
                    worker.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                          do_sample=False, streamer=Stream(), pad_token_id=0,
                                          stopping_criteria=StoppingCriteriaList([Cancelled()]))
            except Exception as e:  # noqa: BLE001 - the request fails, the peer goes on
                loop.call_soon_threadsafe(q.put_nowait, e)


def serve(args, port: int, ready, extend=None) -> None:
    """Child process: model, corpus index, engine, the app (engine at /, transformers peer at /hf), uvicorn.
    extend(app, worker): called on the engine's app before it serves (bench/serve_hops.py adds a route)."""
    import uvicorn

    from bench_ttft import TILE, SyntheticIndex, anchor_bits, build_llama, write_index
    from common import IdTokenizer
    from sift.runtime import KVStore, SiftEngine
    from sift.runtime.server import EngineWorker, LocalBackend, build_app
    from sift.runtime.server.config import tune_process
    from sift.runtime.server.protocol import ServerDefaults

    tune_process()
    try:
        sh = shape(args)
        model = build_llama(args.smoke, smoke_dtype=torch.float32)
        config, device = model.config, model.device
        model.generation_config.eos_token_id = None      # every request generates all its tokens
        docs = corpus(sh, config.vocab_size)
        vectors = config.num_hidden_layers * config.num_attention_heads
        gen = torch.Generator().manual_seed(1)
        names = {f"doc{i}": d for i, d in enumerate(docs)}
        bits = {n: anchor_bits(len(d), vectors, gen) for n, d in names.items()}
        tmp = pathlib.Path(tempfile.mkdtemp())
        write_index(tmp / "index", names, bits, tile=TILE, config=config)
        index = SyntheticIndex.open(tmp / "index", device=device)
        tokenizer = IdTokenizer(config.bos_token_id, config.eos_token_id)
        hbm = (64 << 20) if args.smoke else int(args.kv_hbm_gib * 2**30)
        dram = 0 if args.smoke else int(args.kv_dram_gib * 2**30)
        engine = SiftEngine(model, tokenizer, index, kv_store=KVStore(hbm_bytes=hbm, dram_bytes=dram))
        engine.warmup()
        defaults = ServerDefaults(mode="sift", timeout_s=600.0)
        worker = EngineWorker(engine, mode="sift", max_queue=args.max_queue)
        peer = GenerateWorker(model, tokenizer, args.max_queue)
        app = build_app(LocalBackend(worker), model="bench", defaults=defaults)
        hf = build_app(LocalBackend(peer), model="bench", defaults=defaults)
        if extend is not None:
            extend(app, worker)
        # The engine's app is the one uvicorn serves, as `sift-serve --replicas 0` serves it; the peer is mounted
        # on it (its routes come first, so the engine's requests meet no extra layer).
        app.mount("/hf", hf)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                               access_log=False))
        ready.put("ready")
        server.run()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which stops
        ready.put(f"error: {type(e).__name__}: {e}")
        raise


# ----------------------------------------------------------------------------------- the load (parent)


class Workload:
    def __init__(self, args, vocab: int):
        from bench_trace import zipf_requests

        self.sh = sh = shape(args)
        self.docs = [text(d) for d in corpus(sh, vocab)]
        rng = np.random.default_rng(2)
        self.picks = zipf_requests(sh["documents"], 4096, sh["per_request"], args.alpha, rng)
        self.rng = rng
        self.vocab = vocab
        self.next = 0

    def body(self, mode: str, max_tokens: int | None = None) -> dict:
        sh = self.sh
        picks = self.picks[self.next % len(self.picks)]
        self.next += 1
        query = text(self.rng.integers(3, self.vocab, sh["query_tokens"]).tolist())
        if max_tokens is None:
            max_tokens = int(self.rng.integers(sh["out_min"], sh["out_max"] + 1))
        return dict(model="bench", prompt=query, max_tokens=max_tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True},
                    documents=[{"id": f"doc{d}", "text": self.docs[d]} for d in picks], sift_mode=mode)


class Client:
    """The load generator's HTTP/1.1 client: asyncio streams over kept-alive connections to one URL. A request's
    bytes are encoded before its clock starts and its chunked event stream is read as it arrives, so a measured
    TTFT holds the server's time and the loopback's, not a client library's (aiohttp's request and response
    machinery and its JSON encoding add most of a millisecond per request: bench/serve_hops.py)."""

    IDLE_S = 2.0        # a connection idle longer is not reused (the server closes idle ones after 5 s)

    def __init__(self, url: str):
        import urllib.parse

        u = urllib.parse.urlsplit(url)
        self.host, self.port, self.path = u.hostname, u.port, u.path
        self.idle: list[tuple[float, asyncio.StreamReader, asyncio.StreamWriter]] = []

    def encode(self, body: dict) -> bytes:
        data = json.dumps(body).encode()
        return (f"POST {self.path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(data)}\r\n\r\n").encode() + data

    async def connect(self):
        while self.idle:
            since, reader, writer = self.idle.pop()
            if time.perf_counter() - since < self.IDLE_S and not reader.at_eof():
                return reader, writer
            writer.close()
        return await asyncio.open_connection(self.host, self.port)

    def release(self, reader, writer) -> None:
        self.idle.append((time.perf_counter(), reader, writer))

    def close(self) -> None:
        for _, _, writer in self.idle:
            writer.close()
        self.idle = []


async def _response_head(reader) -> tuple[int, dict[str, str]]:
    lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return int(lines[0].split(" ", 2)[1]), headers


async def _chunks(reader):
    """The payloads of a chunked response body, as they arrive."""
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return
        yield data[:-2]


async def one_request(client: Client, body: dict, out: list) -> None:
    """One streamed completion -> out.append(record) with client-side timings (its clock starts once the request
    is encoded)."""
    request = client.encode(body)
    t0 = time.perf_counter()
    rec = dict(t_send=t0, status=None, ttft=None, tokens=0, prompt_tokens=None, t_last=None, engine_ttft=None,
               app_ttft=None, max_tokens=body["max_tokens"])
    out.append(rec)
    reader, writer = await client.connect()
    whole = False           # the response was read to its end: the connection can serve the next request
    try:
        writer.write(request)
        status, headers = await _response_head(reader)
        rec["status"] = status
        for key in ("engine_ttft", "app_ttft"):
            value = headers.get("x-sift-" + key.replace("_", "-"))
            if value:
                rec[key] = float(value)
        if headers.get("transfer-encoding") != "chunked":
            await reader.readexactly(int(headers.get("content-length", 0)))
            whole = True
            return
        pending = b""
        async for data in _chunks(reader):
            pending += data
            *events, pending = pending.split(b"\n\n")
            for line in events:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(line[6:])
                if event.get("error"):
                    rec["status"] = event["error"].get("code")
                    return
                if event.get("usage"):
                    rec["tokens"] = event["usage"]["completion_tokens"]
                    rec["prompt_tokens"] = event["usage"]["prompt_tokens"]
                elif event["choices"] and event["choices"][0]["text"]:
                    now = time.perf_counter()
                    if rec["ttft"] is None:
                        rec["ttft"] = now - t0
                    rec["t_last"] = now
        whole = True
    finally:
        if whole:
            client.release(reader, writer)
        else:
            writer.close()      # a request cancelled or cut short: the server sees its client leave


async def run_point(url: str, work: Workload, mode: str, rate: float, window_s: float, min_requests: int,
                    drain_s: float, seed: int) -> list[dict]:
    """Poisson arrivals at `rate` for window_s (at least min_requests), then drain_s for the stragglers."""
    rng = np.random.default_rng(seed)
    records: list[dict] = []
    tasks = []
    client = Client(url)
    try:
        start = time.perf_counter()
        t = 0.0
        n = 0
        while t < window_s or n < min_requests:
            t += rng.exponential(1.0 / rate)
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(client, work.body(mode), records)))
            n += 1
        done, pending = await asyncio.wait(tasks, timeout=drain_s)
        for task in pending:
            task.cancel()           # the client disconnects: the server aborts the request
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            if task.exception() is not None:
                print(f"request failed: {task.exception()!r}", flush=True)
    finally:
        client.close()
    return records


def pct(values, q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return float(np.percentile(values, q))


def summarise(system: str, rate: float, records: list[dict], arrival_s: float, kv: dict) -> dict:
    ok = [r for r in records if r["status"] == 200 and r["ttft"] is not None and r["tokens"] >= r["max_tokens"]]
    tpots = [(r["t_last"] - r["t_send"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    good = [r for r in ok if r["ttft"] <= SLO_TTFT_S and
            (r["tokens"] <= 1 or (r["t_last"] - r["t_send"] - r["ttft"]) / (r["tokens"] - 1) <= SLO_TPOT_S)]
    return dict(system=system, rate=rate, sent=len(records), completed=len(ok),
                refused=sum(r["status"] == 503 for r in records), arrival_s=arrival_s,
                throughput_rps=len(ok) / arrival_s, output_tokens_per_s=sum(r["tokens"] for r in ok) / arrival_s,
                ttft_p50_s=pct([r["ttft"] for r in ok], 50), ttft_p99_s=pct([r["ttft"] for r in ok], 99),
                tpot_p50_s=pct(tpots, 50), tpot_p99_s=pct(tpots, 99),
                goodput_rps=len(good) / arrival_s, slo_share=len(good) / max(1, len(records)), kv=kv)


def scrape(base: str) -> dict:
    """The engine replica's figures from /metrics: the KV store's hits and misses (counters), its pinned entries
    and free / scratch pages, the requests waiting and running (gauges)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    names = {"sift_kv_store_hits": "hits", "sift_kv_store_misses": "misses", "sift_kv_store_pages": "pages",
             "sift_kv_store_pinned_entries": "pinned", "sift_queue_depth": "waiting",
             "sift_running_requests": "running"}
    out = {}
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        for fam in text_string_to_metric_families(r.read().decode()):
            for s in fam.samples if fam.name in names else ():
                if s.name.endswith("_created"):
                    continue
                label = s.labels.get("tier") or s.labels.get("state")
                key = names[fam.name] + (f"_{label}" if label else "")
                out[key] = out.get(key, 0) + s.value
    return out


def settled(base: str, idle: dict, timeout_s: float = 30.0) -> dict:
    """The engine's figures once the requests of a rate have left it (the cancelled ones end at its next step),
    or as they are after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = scrape(base)
        done = now.get("waiting") == now.get("running") == 0 and now.get("pages_scratch") == idle.get("pages_scratch")
        if done or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def check_point(checks, name: str, records: list[dict], prompt_tokens: int, after: dict, idle: dict) -> None:
    """Gates of one rate: every request answered (200 with all its tokens and its whole prompt, 503, or cancelled
    by the client after the drain), and once it is over the engine holds nothing: no request, no pinned store
    entry, its scratch pages back to the idle engine's."""
    answered = [r for r in records if r["status"] == 200 and r["tokens"]]
    checks.true(f"{name}/answers_whole", all(r["tokens"] == r["max_tokens"] and r["prompt_tokens"] == prompt_tokens
                                             for r in answered),
                f"{len(answered)} answered; token counts and prompt lengths as sent")
    bad = [r["status"] for r in records if r["status"] not in (200, 503, None)]
    checks.true(f"{name}/no_errors", not bad, f"statuses {sorted(set(map(str, bad)))}" if bad else "")
    checks.true(f"{name}/nothing_held", after.get("pinned", 0) == 0 and after.get("waiting", 0) == 0 and
                after.get("running", 0) == 0 and after.get("pages_scratch") == idle.get("pages_scratch"),
                f"pinned {after.get('pinned')}, waiting {after.get('waiting')}, running {after.get('running')}, "
                f"scratch pages {after.get('pages_scratch')} (idle {idle.get('pages_scratch')})")


async def idle_ttft(url: str, work: Workload, mode: str, n: int) -> list[dict]:
    """n requests one after another (nothing else running), PROBE_TOKENS tokens each."""
    records: list[dict] = []
    client = Client(url)
    try:
        for _ in range(n):
            await one_request(client, work.body(mode, PROBE_TOKENS), records)
    finally:
        client.close()
    return records


def http_overhead(records: list[dict]) -> dict:
    """The HTTP layer's share of TTFT, per request: the client's TTFT minus the engine's own; split into the
    app's part (request received -> first chunk, minus the engine's) and the rest (the connection, uvicorn,
    the event stream, the client)."""
    recs = [r for r in records if r["status"] == 200 and None not in (r["ttft"], r["engine_ttft"], r["app_ttft"])]
    if not recs:
        return {}
    total = [r["ttft"] - r["engine_ttft"] for r in recs]
    app = [r["app_ttft"] - r["engine_ttft"] for r in recs]
    wire = [r["ttft"] - r["app_ttft"] for r in recs]
    return dict(requests=len(recs), median_ms=1e3 * statistics.median(total), p90_ms=1e3 * pct(total, 90),
                app_median_ms=1e3 * statistics.median(app), wire_median_ms=1e3 * statistics.median(wire),
                client_ttft_median_ms=1e3 * statistics.median(r["ttft"] for r in recs),
                engine_ttft_median_ms=1e3 * statistics.median(r["engine_ttft"] for r in recs))


def wait_ready(ready, proc, base: str, timeout_s: float) -> None:
    """Until the child reports its app built and then answers GET /health (uvicorn binds the port only once
    `server.run()` starts, after the report)."""
    import queue
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            msg = ready.get(timeout=1.0)
        except queue.Empty:
            if not proc.is_alive():
                raise SystemExit("the server process died while starting")
            continue
        if msg != "ready":
            raise SystemExit(f"the server failed to start: {msg}")
        break
    while time.monotonic() < deadline:
        if not proc.is_alive():
            raise SystemExit("the server process died while starting")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.2)
    raise SystemExit("the server did not start in time")


def plot(rows: list[dict], path: pathlib.Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4))
    axes = fig.subplots(1, 3)
    for system in SYSTEMS:
        pts = [r for r in rows if r["system"] == system]
        if not pts:
            continue
        x = [r["rate"] for r in pts]
        axes[0].plot(x, [r["throughput_rps"] for r in pts], "o-", label=system)
        axes[1].plot(x, [r["ttft_p99_s"] if r["ttft_p99_s"] is not None else np.nan for r in pts], "o-", label=system)
        axes[2].plot(x, [r["goodput_rps"] for r in pts], "o-", label=system)
    axes[1].axhline(SLO_TTFT_S, color="k", lw=1, ls=":")
    for ax, title in zip(axes, ("throughput (completed req/s)", "p99 TTFT (s)", "goodput (req/s within SLO)")):
        ax.set(xscale="log", xlabel="arrival rate (req/s)", title=title)
        ax.legend(fontsize=7)
    axes[1].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--documents", type=int, default=1000)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--per-request", type=int, default=16)
    ap.add_argument("--query-tokens", type=int, default=512)
    ap.add_argument("--out-min", type=int, default=64)
    ap.add_argument("--out-max", type=int, default=256)
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--kv-hbm-gib", type=float, default=64.0)
    ap.add_argument("--kv-dram-gib", type=float, default=32.0)
    ap.add_argument("--max-queue", type=int, default=256)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--window-s", type=float, default=12.0, help="arrival window per rate")
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--drain-s", type=float, default=15.0)
    ap.add_argument("--idle-requests", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=420.0, help="no new rate starts after this many seconds")
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args()
    rates = SMOKE_RATES if args.smoke else RATES
    if args.smoke:
        args.window_s, args.drain_s, args.idle_requests, args.min_requests = 3.0, 60.0, 1, 2
    elif not torch.cuda.is_available():
        raise SystemExit("bench_serve needs a CUDA GPU (or --smoke)")
    systems = [s for s in args.systems.split(",") if s]
    from bench_ttft import llama_config

    vocab = llama_config(args.smoke).vocab_size
    t_start = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    proc = ctx.Process(target=serve, args=(args, args.port, ready), daemon=True)
    proc.start()
    rows, idle, overhead = [], {}, {}
    checks = common.Checks()
    try:
        base = f"http://127.0.0.1:{args.port}"
        wait_ready(ready, proc, base, 900)
        print(f"server ready after {time.perf_counter() - t_start:.0f}s", flush=True)
        work = Workload(args, vocab)
        sh = shape(args)
        prompt_tokens = 1 + sh["per_request"] * sh["doc_tokens"] + sh["query_tokens"]    # BOS, documents, query
        engine_idle = scrape(base)
        for system in systems:
            url = (base + "/hf" if system == "transformers" else base) + "/v1/completions"
            mode = "dense" if system == "transformers" else system
            warm = asyncio.run(idle_ttft(url, work, mode, 1))       # compilation, allocator
            if not checks.true(f"{system}/warm_up_answered", warm[0]["status"] == 200, f"status {warm[0]['status']}"):
                continue
            recs = asyncio.run(idle_ttft(url, work, mode, args.idle_requests))
            idle[system] = pct([r["ttft"] for r in recs], 50)
            for i, rate in enumerate(rates[system]):
                if time.perf_counter() - t_start > args.budget_s:
                    print(f"budget reached: {system} stops before rate {rate}", flush=True)
                    break
                kv0 = scrape(base)
                recs = asyncio.run(run_point(url, work, mode, rate, args.window_s, args.min_requests, args.drain_s,
                                             seed=100 + i))
                kv1 = settled(base, engine_idle)
                check_point(checks, f"{system}/{rate:g}", recs, prompt_tokens, kv1, engine_idle)
                arrival = max(r["t_send"] for r in recs) - min(r["t_send"] for r in recs) + 1.0 / rate
                counters = {k: kv1.get(k, 0) - kv0.get(k, 0) for k in kv1 if k.startswith(("hits", "misses"))}
                row = summarise(system, rate, recs, arrival, counters)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if system == "reuse" and rate == 1:
                    overhead = http_overhead(recs)
                if row["slo_share"] < 0.5 or (row["ttft_p50_s"] or 0) > 10:
                    break               # saturated: higher rates only queue
    finally:
        proc.terminate()
        proc.join(30)
    summary = {}
    for system in systems:
        pts = [r for r in rows if r["system"] == system]
        within = [r["rate"] for r in pts if r["slo_share"] >= 0.9]
        below = [r for r in pts if r["slo_share"] >= 0.9]
        summary[system] = dict(
            sustained_rate=max(within) if within else 0.0, idle_ttft_s=idle.get(system),
            p99_ttft_over_idle_below_saturation=max((r["ttft_p99_s"] / idle[system] for r in below
                                                     if r["ttft_p99_s"] and idle.get(system)), default=None))
    if "reuse" in summary and "dense" in summary:
        d = summary["dense"]["sustained_rate"]
        summary["reuse_over_dense_sustained"] = summary["reuse"]["sustained_rate"] / d if d else None
    result = dict(setup=dict(shape(args), alpha=args.alpha, kv_hbm_gib=args.kv_hbm_gib,
                             kv_dram_gib=args.kv_dram_gib, window_s=args.window_s, drain_s=args.drain_s,
                             slo_ttft_s=SLO_TTFT_S, slo_tpot_s=SLO_TPOT_S, smoke=args.smoke, args=vars(args) | {
                                 "out": str(args.out)}),
                  rows=rows, idle_ttft_s=idle, http_overhead=overhead, summary=summary,
                  seconds=time.perf_counter() - t_start, checks=checks.to_json(), ok=checks.ok)
    out = common.out_dir(args)
    common.write_result("serve", result, out)
    plot(rows, out / "serve.png")
    print_table(rows, summary, overhead)
    raise SystemExit(checks.exit_status())


def print_table(rows: list[dict], summary: dict, overhead: dict) -> None:
    def ms(x):
        return f"{x * 1e3:8.0f}" if x is not None else "       -"

    print(f"\n{'system':<13} {'rate':>6} {'done':>5} {'req/s':>6} {'tok/s':>7} {'TTFT50':>8} {'TTFT99':>8} "
          f"{'TPOT50':>8} {'TPOT99':>8} {'good/s':>6} {'in SLO':>6}")
    for r in rows:
        print(f"{r['system']:<13} {r['rate']:>6g} {r['completed']:>5} {r['throughput_rps']:>6.2f} "
              f"{r['output_tokens_per_s']:>7.0f} {ms(r['ttft_p50_s'])} {ms(r['ttft_p99_s'])} {ms(r['tpot_p50_s'])} "
              f"{ms(r['tpot_p99_s'])} {r['goodput_rps']:>6.2f} {r['slo_share']:>6.0%}")
    print("(times in ms; SLO: TTFT <= 1 s and TPOT <= 50 ms)")
    for system, s in summary.items():
        if isinstance(s, dict):
            print(f"{system}: sustained {s['sustained_rate']:g} req/s within SLO; idle TTFT "
                  f"{ms(s['idle_ttft_s']).strip()} ms; p99 TTFT / idle below saturation: "
                  f"{s['p99_ttft_over_idle_below_saturation']}")
    if summary.get("reuse_over_dense_sustained") is not None:
        print(f"reuse / dense sustained rate: {summary['reuse_over_dense_sustained']:.1f}x")
    if overhead:
        print(f"HTTP layer at 1 req/s (reuse): client TTFT - engine TTFT = {overhead['median_ms']:.2f} ms median "
              f"({overhead['app_median_ms']:.2f} in the app, {overhead['wire_median_ms']:.2f} on the wire), "
              f"{overhead['p90_ms']:.2f} ms p90, over {overhead['requests']} requests")


if __name__ == "__main__":
    common.run_main(main)
