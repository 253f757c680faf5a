"""sift-serve in one process (runtime/server/, `--replicas 0`): the official `openai` client over real HTTP on
127.0.0.1 against the app and an EngineWorker driving a SiftEngine with the real SmolLM2 weights.

Expected values never come from the server: greedy texts from `SiftEngine.generate` on the prompt written out
here from the ChatML definition SmolLM2's template follows (a second engine, run before the server starts), dense
mode from transformers' `generate` on the same token ids, error bodies from OpenAI's documented shape.
"""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from sift.model import DEFAULT_MODEL, fingerprint, resolve_model_dir
from sift.runtime import KVStore, Request, SamplingParams, SiftEngine
from sift.runtime.server import EngineWorker, LocalBackend, build_app
from sift.runtime.server.protocol import ServerDefaults
from sift.runtime.server.render import ChatRenderer
from sift.runtime.server.routing import ReplicaView, rank

from .helpers import smollm2
from .test_engine import hotpot, write_index

CHARS = 260          # paragraphs cut to ~50-60 tokens: short prompts, fast on CPU
SYSTEM = "You are a helpful assistant. Answer the question using the passages. Reply with a short answer only."
MODEL = "smollm2-test"
MAX_TOKENS = 8
REQUEST_S = 300.0       # the test server's request timeout and its clients'


def chatml(system: str, docs: list[tuple[str, str]], question: str) -> Request:
    """The chat prompt of SPEC section 7 for SmolLM2, written from the ChatML format its template produces."""
    prefix = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"
    query = ("\n\n" if docs else "") + f"{question}<|im_end|>\n<|im_start|>assistant\n"
    return Request(prefix, docs, query)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Questions:
    """Three HotpotQA questions, each with three of its paragraphs (cut to CHARS), as chat and completion prompts."""

    def __init__(self):
        self.rows = hotpot(3)
        self.docs = [[(t, x[:CHARS]) for t, x in q["paragraphs"][:3]] for q in self.rows]
        self.questions = [q["question"] for q in self.rows]

    def documents(self, i: int) -> list[dict]:
        return [{"id": d, "text": t} for d, t in self.docs[i]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The in-process server over an all-ones index of the questions' paragraphs, and the references computed
    before it starts: greedy texts of each chat prompt and each completion prompt from a second engine."""
    model, tokenizer = smollm2()
    qs = Questions()
    ids = {d: tokenizer(t, add_special_tokens=False).input_ids for docs in qs.docs for d, t in docs}
    fp = fingerprint(resolve_model_dir(DEFAULT_MODEL))
    index = write_index(tmp_path_factory.mktemp("serve") / "index", model, fp, ids, tile=16,
                        prefix_ids=[tokenizer.bos_token_id])
    ref = SiftEngine(model, tokenizer, index, kv_store=KVStore(hbm_bytes=256 << 20))
    completion = Request("Answer from the passages.\n", qs.docs[0], f"\nQuestion: {qs.questions[0]}\nAnswer:")
    prompts = [chatml(SYSTEM, qs.docs[i], qs.questions[i]) for i in range(3)] + [completion]
    refs = ref.generate(prompts, max_new_tokens=MAX_TOKENS, mode="sift")
    chat_refs = [(refs.texts[i], refs.token_ids[i]) for i in range(3)]
    completion_ref = (refs.texts[3], refs.token_ids[3])
    del ref

    store = KVStore(hbm_bytes=256 << 20)
    engine = SiftEngine(model, tokenizer, index, kv_store=store)
    idle_scratch = store.stats()["pages_scratch"]     # pages the engine itself holds (its idle decode rows)
    worker = EngineWorker(engine, mode="sift", max_queue=64)
    # The server's request timeout bounds a hung request, not a slow machine: a CPU runs a batch of these
    # prompts at a few seconds per request.
    app = build_app(LocalBackend(worker), model=MODEL, defaults=ServerDefaults(mode="sift", timeout_s=REQUEST_S),
                    renderer=ChatRenderer(tokenizer))
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    s = dict(url=f"http://127.0.0.1:{port}", worker=worker, engine=engine, store=store, idle_scratch=idle_scratch,
             model=model,
             tokenizer=tokenizer, qs=qs, chat_refs=chat_refs, completion=completion, completion_ref=completion_ref)
    try:
        yield s
    finally:
        uv.should_exit = True
        thread.join(timeout=30)
        worker.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_S)


def chat_args(server, i: int, **kw) -> dict:
    qs = server["qs"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": qs.questions[i]}]
    args = dict(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"documents": qs.documents(i)})
    args.update(kw)
    return args


def assert_nothing_held(server) -> None:
    """Every request finished: no request waiting or running, no store entry pinned, no page held for a request
    (the store's scratch pages back to what the idle engine holds)."""
    worker, store = server["worker"], server["store"]
    deadline = time.monotonic() + 10
    while worker.load() != (0, 0) or server["engine"].has_unfinished():   # an abort lands at the next step
        assert time.monotonic() < deadline, f"requests still in the worker: {worker.load()}"
        time.sleep(0.05)
    s = store.stats()
    assert s["pinned"] == 0, s
    assert s["pages_scratch"] == server["idle_scratch"], s
    page = store.geometry.page_bytes
    assert s["pages_free"] * page + s["hbm_bytes"] + s["pages_scratch"] * page == s["hbm_capacity"], s


# ------------------------------------------------------------------------------------------------ the API


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server["url"] + "/health").json() == {"status": "ok"}


def test_chat_greedy_equals_engine_generate(server, client):
    text, ids = server["chat_refs"][0]
    out = client.chat.completions.create(**chat_args(server, 0))
    print(f"chat: {out.choices[0].message.content!r}")
    assert out.choices[0].message.content == text
    assert out.choices[0].message.role == "assistant"
    eos = ids[-1] in server["engine"].eos_ids
    assert out.choices[0].finish_reason == ("stop" if eos else "length")
    n_prompt = len(server["engine"].prompt_ids(chatml(SYSTEM, server["qs"].docs[0], server["qs"].questions[0])))
    assert out.usage.prompt_tokens == n_prompt
    assert out.usage.completion_tokens == len(ids)
    assert out.usage.total_tokens == n_prompt + len(ids)


def test_chat_stream_equals_plain(server, client):
    ref_text, ref_ids = server["chat_refs"][1]
    stream = client.chat.completions.create(**chat_args(server, 1, stream=True,
                                                        stream_options={"include_usage": True}))
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref_text
    assert chunks[0].choices[0].delta.role == "assistant"
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(reasons) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref_ids)


def test_completions_plain_and_stream(server, client):
    req, (ref_text, ref_ids) = server["completion"], server["completion_ref"]
    args = dict(model=MODEL, prompt=req.query, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"prefix": req.prefix, "documents": [{"id": d, "text": t} for d, t in req.docs]})
    out = client.completions.create(**args)
    assert out.choices[0].text == ref_text
    assert out.usage.completion_tokens == len(ref_ids)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True) if c.choices)
    assert streamed == ref_text


def test_dense_mode_equals_transformers_generate(server, client):
    """sift_mode=dense: the greedy answer equals transformers' generate on the rendered prompt's token ids
    (prefix with the tokenizer's special tokens, documents and query without: SPEC section 4)."""
    qs, tok, model = server["qs"], server["tokenizer"], server["model"]
    req = chatml(SYSTEM, qs.docs[2], qs.questions[2])
    ids = tok(req.prefix, add_special_tokens=True).input_ids
    for _, text in req.docs:
        ids += tok(text, add_special_tokens=False).input_ids
    ids += tok(req.query, add_special_tokens=False).input_ids
    with torch.inference_mode():
        gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, do_sample=False)
    expected = tok.decode(gen[0, len(ids):], skip_special_tokens=True)
    out = client.chat.completions.create(**chat_args(server, 2, extra_body={"documents": qs.documents(2),
                                                                            "sift_mode": "dense"}))
    print(f"dense: {out.choices[0].message.content!r} | transformers: {expected!r}")
    assert out.choices[0].message.content == expected


def test_stop_string_ends_the_answer(server, client):
    """A stop string cuts the text before it and finishes with "stop" (OpenAI's semantics)."""
    full = server["chat_refs"][0][0]
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]
    out = client.chat.completions.create(**chat_args(server, 0, stop=[stop]))
    assert out.choices[0].message.content == full[:full.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(server, client):
    args = chat_args(server, 0, temperature=1.0, top_p=0.95, max_tokens=6)
    a, b, c, d = (client.chat.completions.create(**args, seed=s).choices[0].message.content
                  for s in (1234, 1234, 7, 99))
    assert a == b
    assert len({a, c, d}) > 1, "three seeds drew one answer: sampling ignores the seed"


# -------------------------------------------------------------------------------------------- bad input


def _bad(server, path: str, body, status: int = 400):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server["url"] + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def _chat_body(server, **kw) -> dict:
    qs = server["qs"]
    body = dict(model=MODEL, messages=[{"role": "user", "content": qs.questions[0]}], max_tokens=4,
                documents=qs.documents(0))
    body.update(kw)
    return body


@pytest.mark.parametrize("case, param, code", [
    ("malformed json", None, "invalid_json"),
    ("not an object", None, "invalid_json"),
    ("no messages", "messages", "missing_field"),
    ("document without text", "documents[1].text", "missing_field"),
    ("unknown document", "documents", "document_not_found"),
    ("stale document", "documents", "stale_document"),
    ("prompt longer than the context", "messages", "context_length_exceeded"),
    ("negative temperature", "temperature", "invalid_value"),
    ("top_p of 0", "top_p", "invalid_value"),
    ("max_tokens of 0", "max_tokens", "invalid_value"),
    ("temperature as a string", "temperature", "invalid_value"),
    ("five stop strings", "stop", "invalid_value"),
    ("n of 2", "n", "unsupported_field"),
    ("unknown mode", "sift_mode", "invalid_value"),
    ("last message from the assistant", "messages[1].role", "invalid_value"),
])
def test_bad_chat_input_is_a_400_naming_it(server, case, param, code):
    qs = server["qs"]
    docs = qs.documents(0)
    body = {
        "malformed json": b'{"model": "smollm2-test", "messages": [',
        "not an object": b'["a list"]',
        "no messages": {k: v for k, v in _chat_body(server).items() if k != "messages"},
        "document without text": _chat_body(server, documents=[docs[0], {"id": docs[1]["id"]}]),
        "unknown document": _chat_body(server, documents=[{"id": "no such passage", "text": "Never indexed."}]),
        "stale document": _chat_body(server, documents=[{"id": docs[0]["id"], "text": docs[0]["text"] + " Edited."}]),
        "prompt longer than the context": _chat_body(server, messages=[{"role": "user", "content": "word " * 9000}]),
        "negative temperature": _chat_body(server, temperature=-0.5),
        "top_p of 0": _chat_body(server, top_p=0),
        "max_tokens of 0": _chat_body(server, max_tokens=0),
        "temperature as a string": _chat_body(server, temperature="hot"),
        "five stop strings": _chat_body(server, stop=["a", "b", "c", "d", "e"]),
        "n of 2": _chat_body(server, n=2),
        "unknown mode": _chat_body(server, sift_mode="fast"),
        "last message from the assistant": _chat_body(server, messages=[{"role": "user", "content": "Hi"},
                                                                          {"role": "assistant", "content": "Hello"}]),
    }[case]
    err = _bad(server, "/v1/chat/completions", body)
    print(f"{case}: {err}")
    assert err["type"] == "invalid_request_error"
    assert (err["param"], err["code"]) == (param, code)
    if case in ("unknown document", "stale document"):
        assert ("no such passage" if case == "unknown document" else docs[0]["id"]) in err["message"]


def test_bad_completion_input_and_unknown_model(server):
    err = _bad(server, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3]})
    assert err["param"] == "prompt"
    err = _bad(server, "/v1/completions", {"model": "gpt-4", "prompt": "Hi"}, status=404)
    assert (err["param"], err["code"]) == ("model", "model_not_found")


def test_bad_input_leaves_the_server_serving(server, client):
    """After every refusal above, requests are served and nothing is held."""
    assert client.chat.completions.create(**chat_args(server, 0)).choices[0].message.content == \
        server["chat_refs"][0][0]
    assert_nothing_held(server)


# ---------------------------------------------------------------------------------------------- under load


def test_concurrent_streams_with_disconnects(server):
    """8 streaming clients at once, 2 of which hang up after their second chunk: the 6 others get exactly the
    greedy answers, the 2 are aborted (their pages freed), and nothing stays held."""
    refs = [text for text, _ in server["chat_refs"]]
    aborted_before = server["worker"].snapshot()["aborted"]
    client = openai.AsyncOpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_S)

    async def one(k: int):
        i = k % 3
        stream = await client.chat.completions.create(**chat_args(server, i, stream=True, max_tokens=MAX_TOKENS))
        text, n = "", 0
        async for chunk in stream:
            text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
            n += 1
            if k % 4 == 3 and n == 2:
                await stream.close()
                return None
        return i, text

    async def run():
        return await asyncio.wait_for(asyncio.gather(*(one(k) for k in range(8))), timeout=2 * REQUEST_S)

    results = asyncio.run(run())
    done = [r for r in results if r is not None]
    assert len(done) == 6
    for i, text in done:
        assert text == refs[i]
    assert_nothing_held(server)
    assert server["worker"].snapshot()["aborted"] - aborted_before == 2


@pytest.mark.parametrize("stream", [False, True])
def test_client_leaving_while_its_request_runs_aborts_it(server, stream):
    """A client that hangs up while its request is in the engine (a plain request: before its answer; a stream:
    as soon as the worker holds it, before or just after its first chunk) has it aborted, not run to its end, and
    its pages freed."""
    worker = server["worker"]
    before = worker.snapshot()
    body = json.dumps(_chat_body(server, max_tokens=200, temperature=0, stream=stream)).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", int(server["url"].rsplit(":", 1)[1]))) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 30
        while worker.load() == (0, 0):
            assert time.monotonic() < deadline, "the request never reached the worker"
            time.sleep(0.005)
    assert_nothing_held(server)
    after = worker.snapshot()
    assert after["aborted"] == before["aborted"] + 1, (before, after)
    assert after["finished"] == before["finished"], (before, after)


def test_overload_is_a_503_with_retry_after(server):
    """Past --max-queue waiting requests, a request is refused at once with 503 and Retry-After."""
    worker = server["worker"]
    worker.max_queue = 1
    try:
        async def run():
            async with httpx.AsyncClient(timeout=REQUEST_S) as http:
                body = _chat_body(server, max_tokens=2)
                return await asyncio.gather(*(http.post(server["url"] + "/v1/chat/completions", json=body)
                                              for _ in range(8)))

        responses = asyncio.run(run())
    finally:
        worker.max_queue = 64
    codes = sorted(r.status_code for r in responses)
    print(f"status codes: {codes}")
    assert 200 in codes and 503 in codes and set(codes) == {200, 503}
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "overloaded"
    assert_nothing_held(server)


def test_request_past_the_timeout_is_a_504(server):
    """A request still running at the server's timeout is aborted and answered 504 (the same worker behind an
    app whose timeout is 1 ms, called in process)."""
    app = build_app(LocalBackend(server["worker"]), model=MODEL, renderer=ChatRenderer(server["tokenizer"]),
                    defaults=ServerDefaults(mode="sift", timeout_s=0.001))
    timed_out = server["worker"].snapshot()["timed_out"]

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sift") as http:
            return await http.post("/v1/chat/completions", json=_chat_body(server), timeout=60)

    r = asyncio.run(run())
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "timeout"
    assert server["worker"].snapshot()["timed_out"] == timed_out + 1
    assert_nothing_held(server)


def test_metrics_parse_with_prometheus_client(server, client):
    client.chat.completions.create(**chat_args(server, 0))
    _bad(server, "/v1/chat/completions", _chat_body(server, documents=[{"id": "no such passage", "text": "x"}]))
    text = httpx.get(server["url"] + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    ttft = {s.name: s.value for s in families["sift_time_to_first_token_seconds"].samples
            if s.labels.get("mode") == "sift"}
    assert ttft["sift_time_to_first_token_seconds_count"] >= 1
    assert ttft["sift_time_to_first_token_seconds_sum"] > 0
    assert "sift_time_per_output_token_seconds" in families
    assert [s.value for s in families["sift_queue_depth"].samples] == [0.0]
    assert [s.value for s in families["sift_running_requests"].samples] == [0.0]
    hits = {s.labels["tier"]: s.value for s in families["sift_kv_store_hits"].samples}
    assert set(hits) == {"hbm", "dram"}
    assert {s.labels["direction"] for s in families["sift_kv_store_bytes_moved"].samples} == {"h2d", "d2h"}
    assert "sift_kv_store_misses" in families
    fractions = {s.name: s.value for s in families["sift_tile_fraction"].samples if s.labels.get("mode") == "sift"}
    assert fractions["sift_tile_fraction_count"] >= 1
    # all-ones bits: every tile computed
    assert fractions["sift_tile_fraction_sum"] == pytest.approx(fractions["sift_tile_fraction_count"])
    outcomes = {(s.labels["endpoint"], s.labels["outcome"]) for s in families["sift_requests"].samples
                if s.name == "sift_requests_total" and s.value > 0}
    assert ("chat", "document_not_found") in outcomes


# ------------------------------------------------------------------------------------ pieces, no server


def test_chat_rendering_splits_the_template_at_the_user_message():
    _, tokenizer = smollm2()
    renderer = ChatRenderer(tokenizer)
    docs = [("a", "First passage."), ("b", "Second passage.")]
    got = renderer.request([("system", "Be brief."), ("user", "Who?")], docs)
    assert got == chatml("Be brief.", docs, "Who?")
    # earlier turns stay in the prefix; without documents the query is the template's own rendering
    turns = [("system", "S"), ("user", "Q1"), ("assistant", "A1"), ("user", "Q2")]
    got = renderer.request(turns, [])
    assert got.prefix == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n"
                          "A1<|im_end|>\n<|im_start|>user\n")
    assert got.prefix + got.query == tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in turns], tokenize=False, add_generation_prompt=True)


def test_rank_prefers_warm_replicas_within_the_load_bound():
    views = [ReplicaView("a", hits=0, load=1, held=0), ReplicaView("b", hits=3, load=1, held=9),
             ReplicaView("c", hits=3, load=0, held=20)]
    assert rank(views) == ["c", "b", "a"]             # most hits, then least load
    # cold everywhere and equal load: the replica holding least
    assert rank([ReplicaView("a", 0, 0, 5), ReplicaView("b", 0, 0, 1)])[0] == "b"
    # a warm replica more than `headroom` requests above the mean load (this request counted) comes last
    views = [ReplicaView("a", hits=8, load=3, held=10), ReplicaView("b", hits=0, load=1, held=10)]
    assert rank(views, headroom=1) == ["b", "a"]      # mean (3 + 1 + 1) / 2 = 2.5: a would be at 4 > 3.5
    assert rank(views, headroom=2) == ["a", "b"]      # 4 <= 4.5
    # at light load a warm replica takes a second request while its peer idles
    assert rank([ReplicaView("a", 8, 1, 10), ReplicaView("b", 0, 0, 10)]) == ["a", "b"]


def test_sampling_params_reach_the_engine(server):
    """The body's sampling fields become the engine's SamplingParams (OpenAI's defaults where absent)."""
    from sift.runtime.server.protocol import parse_completion

    parsed = parse_completion({"model": MODEL, "prompt": "Q", "temperature": 0.5, "top_p": 0.8, "seed": 7,
                               "stop": "\n", "max_tokens": 9, "top_k": 20}, ServerDefaults(mode="sift"))
    assert parsed.call.params == SamplingParams(max_tokens=9, temperature=0.5, top_p=0.8, top_k=20, seed=7,
                                                stop=("\n",))
    parsed = parse_completion({"model": MODEL, "prompt": "Q"}, ServerDefaults(mode="reuse"))
    assert parsed.call.params == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0)
    assert parsed.call.mode == "reuse"


# ------------------------------------------------------------------------------------------ the command


def _sift_serve(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([str(Path(sys.executable).with_name("sift-serve")), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def test_sift_serve_in_one_process_starts_serves_and_stops(server, tmp_path):
    """`sift-serve INDEX --replicas 0`: serves the index's model, and SIGTERM stops it with exit code 0."""
    index = str(server["engine"].index.path)
    port = free_port()
    proc = _sift_serve(index, "--replicas", "0", "--port", str(port), "--kv-hbm-gib", "0.0625")
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "sift-serve --replicas 0 did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        name = client.models.list().data[0].id
        assert name == server["engine"].index.model_name
        out = client.completions.create(model=name, prompt="The capital of France is", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    log = proc.stdout.read()
    assert rc == 0, log
    assert "sift-serve: stopped" in log


def test_sift_serve_refuses_a_missing_index_with_exit_code_2(tmp_path):
    proc = _sift_serve(str(tmp_path / "no-index"), "--replicas", "0")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and "no-index" in lines[-1] and "Traceback" not in out, out
