"""Where the HTTP layer's share of TTFT goes: one streamed completion timed at every hop from the client's send to
the client's first server-sent event, on bench_serve's server (same model, corpus and app, in a child process).

The child's hops are timestamped by wrappers installed in the child only (the served code is unchanged):
uvicorn's protocol (bytes received, body complete, the response's header and first body writes), the app
(request parsing, the first chunk seen), the worker (the admission thread, the hand-back to the event loop) and
the engine's `step`. `time.perf_counter` is CLOCK_MONOTONIC on Linux, one clock for both processes. The probe
client is a blocking socket with the request's bytes encoded before the clock starts, so the client's own costs
(JSON encoding, an event loop, an HTTP client library) stay out of the hops; the same requests are then sent by
bench_serve's client (asyncio streams, the body encoded before the clock starts) and by aiohttp (`json=body`), to
show what a load generator adds on its own.

Two states of the server: idle (the probe alone) and busy (`--busy` streams decoding throughout, as at 1 request
/ s on the GPU where each request runs for seconds): the loop thread then holds the GIL between its GPU waits,
and every hop of the event loop competes with it.

    python bench/serve_hops.py --smoke        # tiny random Llama on CPU (~1 minute)
    python bench/serve_hops.py                # H200, the 8B shape of bench_serve (~3 minutes)
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import socket
import statistics
import time

import common  # bench/common.py (the script's folder is on sys.path)

common.smoke_env()  # before any kernel module imports triton

import numpy as np  # noqa: E402

import bench_serve  # noqa: E402

TRACE: list[tuple[str, float, object]] = []     # (hop, perf_counter, key), appended from any thread of the child

# (name, from, to): the hops reported, in the order a request meets them. "c_*" are the client's timestamps.
HOPS = [
    ("client send -> server first bytes", "c_send", "recv"),
    ("body received (httptools)", "recv", "body_done"),
    ("ASGI task, routing, request.body()", "body_done", "parse_start"),
    ("parse + validate (pydantic), Call", "parse_start", "parse_end"),
    ("-> worker.generate (t_add)", "parse_end", "t_add"),
    ("hop to the admission thread", "t_add", "admit_start"),
    ("add_request (tokenise, validate)", "admit_start", "admit_end"),
    ("loop thread: -> the prefill's step", "admit_end", "step_start"),
    ("engine step (prefill)", "step_start", "step_end"),
    ("step end -> first chunk handed back", "step_end", "put_first"),
    ("call_soon_threadsafe -> event loop", "put_first", "loop_got"),
    ("queue -> generator -> app", "loop_got", "app_first"),
    ("app -> response headers written", "app_first", "headers_write"),
    ("headers -> first event written", "headers_write", "body_written"),
    ("headers written -> client has them", "headers_write", "c_head"),
    ("first event -> client has it", "body_written", "c_data"),
]


def _mark(name: str, key=None, t: float | None = None) -> None:
    TRACE.append((name, time.perf_counter() if t is None else t, key))


def install_tracer() -> None:
    """Wrap the hops' functions in this (the server's) process."""
    from uvicorn.protocols.http import httptools_impl as h

    from sift.runtime.engine import SiftEngine
    from sift.runtime.server import app as app_mod
    from sift.runtime.server import worker as worker_mod
    from sift.runtime.server.protocol import Chunk

    proto, cycle = h.HttpToolsProtocol, h.RequestResponseCycle
    received, completed, send = proto.data_received, proto.on_message_complete, cycle.send

    def data_received(self, data):
        _mark("recv", self.client and self.client[1])
        received(self, data)

    def on_message_complete(self):
        _mark("body_done", self.client and self.client[1])
        completed(self)

    async def traced_send(self, message):
        port, first_body = self.scope["client"][1], False
        if message["type"] == "http.response.start":
            _mark("headers_write", port)
        elif not getattr(self, "_hops_body", False):
            self._hops_body = first_body = True
        await send(self, message)
        if first_body:
            _mark("body_written", port)

    proto.data_received, proto.on_message_complete, cycle.send = data_received, on_message_complete, traced_send

    parse = app_mod.parse_completion

    def parse_completion(body, defaults):
        _mark("parse_start")
        parsed = parse(body, defaults)
        _mark("parse_end", parsed.call.id)
        return parsed

    app_mod.parse_completion = parse_completion
    saw = app_mod._Timing.saw

    def traced_saw(self, chunk):
        if self.first is None and chunk.token_ids:
            _mark("app_first")
        saw(self, chunk)

    app_mod._Timing.saw = traced_saw
    add, put = worker_mod.EngineWorker._add, worker_mod._Stream.put

    def traced_add(self, call, stream):
        stream.hops_id = call.id
        _mark("t_add", call.id, stream.t_add)
        _mark("admit_start", call.id)
        add(self, call, stream)
        _mark("admit_end", call.id)

    def traced_put(self, item):
        if not (isinstance(item, Chunk) and item.engine_ttft_s is not None):
            return put(self, item)
        rid = getattr(self, "hops_id", None)
        _mark("put_first", rid)
        queue = self.queue

        def got():
            _mark("loop_got", rid)
            queue.put_nowait(item)
        try:
            self.loop.call_soon_threadsafe(got)
        except RuntimeError:
            pass

    worker_mod.EngineWorker._add, worker_mod._Stream.put = traced_add, traced_put
    step = SiftEngine.step

    def traced_step(self):
        _mark("step_start")
        out = step(self)
        _mark("step_end", len(out))
        return out

    SiftEngine.step = traced_step


def _debug_route(app, worker) -> None:
    @app.get("/debug/hops")
    def hops():
        out = list(TRACE)
        TRACE.clear()
        return out


def serve_traced(args, port: int, ready) -> None:
    install_tracer()
    bench_serve.serve(args, port, ready, extend=_debug_route)


# ----------------------------------------------------------------------------------------------- the client


def _raw_probe(sock: socket.socket, body: bytes) -> dict:
    """One streamed completion over a kept-alive socket -> the client's timestamps and the server's headers."""
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    request = head + body
    buf, t_head, t_data = b"", None, None
    t_send = time.perf_counter()
    sock.sendall(request)
    while not buf.endswith(b"\r\n0\r\n\r\n"):
        data = sock.recv(1 << 16)
        now = time.perf_counter()
        if not data:
            raise ConnectionError("the server closed the connection")
        buf += data
        if t_head is None and b"\r\n\r\n" in buf:
            t_head = now
        if t_data is None and b'data: {' in buf:
            t_data = now
    headers = dict(line.split(": ", 1) for line in buf.split(b"\r\n\r\n", 1)[0].decode().split("\r\n")[1:])
    status = int(buf.split(b" ", 2)[1])
    first = buf[buf.index(b"data: {") + 6:]
    rid = json.loads(first[:first.index(b"\n\n")])["id"]
    return dict(status=status, id=rid, c_send=t_send, c_head=t_head, c_data=t_data,
                engine_ttft=float(headers.get("x-sift-engine-ttft", "nan")),
                app_ttft=float(headers.get("x-sift-app-ttft", "nan")))


def _trace(base: str) -> list:
    import urllib.request

    with urllib.request.urlopen(base + "/debug/hops", timeout=30) as r:
        return json.loads(r.read())


def hops_of(probe: dict, trace: list, port: int) -> dict:
    """The probe's timestamp at each hop, from the child's trace of its window: uvicorn's by the probe's
    connection, the worker's by its request id; parsing starts at the last parse before its own, the app sees the
    first chunk at the first such mark after its own hand-over, and its step is the last one that ended before
    that hand-over (busy streams start requests and run steps in the same window)."""
    t: dict[str, float] = {k: probe[k] for k in ("c_send", "c_head", "c_data")}
    window = [(n, w, k) for n, w, k in trace if probe["c_send"] <= w <= probe["c_data"]]
    for name, when, key in window:
        if key == (port if name in ("recv", "body_done", "headers_write", "body_written") else probe["id"]):
            t.setdefault(name, when)
    if "parse_end" in t:
        starts = [w for n, w, _ in window if n == "parse_start" and w <= t["parse_end"]]
        if starts:
            t["parse_start"] = starts[-1]
    if "loop_got" in t:
        firsts = [w for n, w, _ in window if n == "app_first" and w >= t["loop_got"]]
        if firsts:
            t["app_first"] = firsts[0]
    if "put_first" in t:
        steps = [(n, w) for n, w, _ in trace if n.startswith("step")]
        ends = [i for i, (n, w) in enumerate(steps) if n == "step_end" and w <= t["put_first"]]
        if ends and ends[-1] > 0 and steps[ends[-1] - 1][0] == "step_start":
            t["step_start"], t["step_end"] = steps[ends[-1] - 1][1], steps[ends[-1]][1]
    return t


def _busy_load(url: str, args, vocab: int, streams: int, stop) -> None:
    """Child process: `streams` streamed completions running at all times until `stop` is set."""
    work = bench_serve.Workload(args, vocab)
    long = 64 if args.smoke else 512

    async def stream(client):
        while not stop.is_set():
            await bench_serve.one_request(client, work.body("reuse", long), [])

    async def main():
        client = bench_serve.Client(url)
        try:
            await asyncio.gather(*(stream(client) for _ in range(streams)))
        finally:
            client.close()

    asyncio.run(main())


async def _client_probes(url: str, bodies: list[dict], gap_s: float) -> list[dict]:
    """The probes sent by bench_serve's client."""
    records: list[dict] = []
    client = bench_serve.Client(url)
    try:
        for body in bodies:
            await bench_serve.one_request(client, body, records)
            await asyncio.sleep(gap_s)
    finally:
        client.close()
    return records


async def _aiohttp_probes(url: str, bodies: list[dict], gap_s: float) -> list[dict]:
    """The probes sent by aiohttp (`json=body`, its clock started before the call), in bench_serve's records."""
    import aiohttp

    records: list[dict] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        for body in bodies:
            t0 = time.perf_counter()
            rec = dict(status=None, ttft=None, engine_ttft=None, app_ttft=None)
            records.append(rec)
            async with session.post(url, json=body) as resp:
                rec["status"] = resp.status
                rec["engine_ttft"] = float(resp.headers["x-sift-engine-ttft"])
                rec["app_ttft"] = float(resp.headers["x-sift-app-ttft"])
                async for line in resp.content:
                    if rec["ttft"] is None and line.startswith(b"data: {"):
                        rec["ttft"] = time.perf_counter() - t0
            await asyncio.sleep(gap_s)
    return records


def measure(base: str, port: int, work, args, state: str) -> dict:
    rng = np.random.default_rng(3)
    bodies = [work.body("reuse", args.probe_tokens) for _ in range(args.probes)]
    per_hop: dict[str, list[float]] = {name: [] for name, _, _ in HOPS}
    raw_overhead, app_part, wire_part = [], [], []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        my_port = sock.getsockname()[1]
        _trace(base)                                        # empty the trace
        for body in bodies:
            probe = _raw_probe(sock, json.dumps(body).encode())
            assert probe["status"] == 200, probe
            t = hops_of(probe, _trace(base), my_port)
            for name, a, b in HOPS:
                if a in t and b in t:
                    per_hop[name].append(t[b] - t[a])
            raw_overhead.append(probe["c_data"] - probe["c_send"] - probe["engine_ttft"])
            app_part.append(probe["app_ttft"] - probe["engine_ttft"])
            wire_part.append(probe["c_data"] - probe["c_send"] - probe["app_ttft"])
            time.sleep(args.gap_s * rng.uniform(0.5, 1.5))
    url = base + "/v1/completions"
    ours = bench_serve.http_overhead(asyncio.run(_client_probes(url, bodies, args.gap_s)))
    aio = bench_serve.http_overhead(asyncio.run(_aiohttp_probes(url, bodies, args.gap_s)))
    encode = []
    for body in bodies:
        t0 = time.perf_counter()
        json.dumps(body)
        encode.append(time.perf_counter() - t0)
    ms = lambda v: 1e3 * statistics.median(v) if v else None  # noqa: E731
    return dict(state=state, probes=len(bodies), hops_ms={k: ms(v) for k, v in per_hop.items()},
                raw_client=dict(median_ms=ms(raw_overhead), p90_ms=1e3 * bench_serve.pct(raw_overhead, 90),
                                app_median_ms=ms(app_part), wire_median_ms=ms(wire_part)),
                bench_serve_client=ours, aiohttp_client=aio, client_json_encode_ms=ms(encode))


def main() -> None:
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--probes", type=int, default=20)
    ap.add_argument("--gap-s", type=float, default=0.2, help="mean pause between probes")
    ap.add_argument("--busy", type=int, default=3, help="streams decoding throughout the busy state")
    ap.add_argument("--probe-tokens", type=int, default=bench_serve.PROBE_TOKENS, help="output tokens per probe")
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--kv-hbm-gib", type=float, default=64.0)
    ap.add_argument("--kv-dram-gib", type=float, default=32.0)
    ap.add_argument("--max-queue", type=int, default=256)
    args = ap.parse_args()
    # the workload of bench_serve (its defaults)
    for k, v in dict(documents=1000, doc_tokens=2048, per_request=16, query_tokens=512, out_min=64, out_max=256,
                     alpha=1.0).items():
        setattr(args, k, v)
    from bench_ttft import llama_config

    vocab = llama_config(args.smoke).vocab_size
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    proc = ctx.Process(target=serve_traced, args=(args, args.port, ready), daemon=True)
    proc.start()
    base = f"http://127.0.0.1:{args.port}"
    results = []
    try:
        bench_serve.wait_ready(ready, proc, base, 900)
        work = bench_serve.Workload(args, vocab)
        asyncio.run(bench_serve.idle_ttft(base + "/v1/completions", work, "reuse", 3))    # warm-up
        results.append(measure(base, args.port, work, args, "idle"))
        if args.busy:
            stop = ctx.Event()
            load = ctx.Process(target=_busy_load, args=(base + "/v1/completions", args, vocab, args.busy, stop),
                               daemon=True)
            load.start()
            time.sleep(2.0)
            try:
                results.append(measure(base, args.port, work, args, f"busy ({args.busy} streams)"))
            finally:
                stop.set()
                load.join(60)
                if load.is_alive():
                    load.terminate()
    finally:
        proc.terminate()
        proc.join(30)
    common.write_result("serve_hops", dict(setup=dict(probes=args.probes, gap_s=args.gap_s, busy=args.busy,
                                                      smoke=args.smoke), results=results), common.out_dir(args))
    print_table(results)


def print_table(results: list[dict]) -> None:
    def f(x):
        return f"{x:8.3f}" if x is not None else "       -"

    print(f"\n{'hop (median ms)':<40}" + "".join(f"{r['state'][:14]:>16}" for r in results))
    for name, _, _ in HOPS:
        print(f"{name:<40}" + "".join(f"{f(r['hops_ms'][name]):>16}" for r in results))
    rows = [("raw client: TTFT - engine TTFT", lambda r: r["raw_client"]["median_ms"]),
            ("  in the app", lambda r: r["raw_client"]["app_median_ms"]),
            ("  on the wire", lambda r: r["raw_client"]["wire_median_ms"]),
            ("bench_serve client: TTFT - engine TTFT", lambda r: r["bench_serve_client"].get("median_ms")),
            ("  in the app", lambda r: r["bench_serve_client"].get("app_median_ms")),
            ("  on the wire", lambda r: r["bench_serve_client"].get("wire_median_ms")),
            ("aiohttp client: TTFT - engine TTFT", lambda r: r["aiohttp_client"].get("median_ms")),
            ("  in the app", lambda r: r["aiohttp_client"].get("app_median_ms")),
            ("  on the wire", lambda r: r["aiohttp_client"].get("wire_median_ms")),
            ("client's json.dumps of the body", lambda r: r["client_json_encode_ms"])]
    for name, get in rows:
        print(f"{name:<40}" + "".join(f"{f(get(r)):>16}" for r in results))


if __name__ == "__main__":
    common.run_main(main)
