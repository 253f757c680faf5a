"""The step API of SiftEngine (add_request / step / abort / stream, continuous batching) on CPU.

With the real SmolLM2 weights, where answers are compared: generation through the step API equals `generate`
token for token in every mode (and `generate` equals transformers: tests/test_engine.py, test_kv_reuse.py); a
request admitted while others are mid-decode, in another mode, and one aborted midway change nothing for the
others, and the pool gets every page back; stop strings, stop token ids and max_tokens end a request as
SamplingParams says. With a tiny random Llama, where only the mechanics matter: seeded sampling, admission
waiting for pages, the one-step lag of outputs, and one-line refusals.
"""
import pytest

from sift.errors import SiftError
from sift.runtime import KVStore, Request, RequestOutput, SamplingParams, SiftEngine
from sift.quality.prompts import QUERY, SYSTEM

from .test_engine import _tiny, _tiny_requests, doc_ids, hotpot, real, tokenizer, write_index  # noqa: F401 (fixtures)

CHARS = 200
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def prompt(q: dict, order: list[int], prefix: str = SYSTEM) -> Request:
    return Request(prefix, [(q["paragraphs"][i][0], q["paragraphs"][i][1][:CHARS]) for i in order],
                   QUERY.format(question=q["question"]))


def run_all(engine: SiftEngine, cap: int = 400) -> dict[str, RequestOutput]:
    """Step until nothing is left -> the last output of every request."""
    last = {}
    for _ in range(cap):
        if not engine.has_unfinished():
            return last
        for out in engine.step():
            last[out.request_id] = out
    raise AssertionError(f"still unfinished after {cap} steps")


@pytest.fixture(scope="module")
def smol(real, tmp_path_factory):
    model, tokenizer, fp = real
    qs = hotpot(2)
    reqs = [prompt(qs[0], [0, 1]), prompt(qs[0], [1, 2], prefix="Passages:\n"), prompt(qs[1], [0, 1])]
    index = write_index(tmp_path_factory.mktemp("step") / "index", model, fp, doc_ids(tokenizer, reqs), tile=16,
                        prefix_ids=[tokenizer.bos_token_id])
    return model, tokenizer, index, reqs


def engine_of(smol, **kw) -> SiftEngine:
    model, tokenizer, index, _ = smol
    return SiftEngine(model, tokenizer, index, kv_store=KVStore(hbm_bytes=48 << 20), **kw)


@pytest.mark.parametrize("mode", ["sift", "dense", "reuse", "hybrid:first@0.5"])
def test_step_api_equals_generate(smol, mode):
    _, _, _, reqs = smol
    engine = engine_of(smol)
    expected = engine.generate(reqs[:2], max_new_tokens=GREEDY.max_tokens, mode=mode)
    ids = [engine.add_request(r, GREEDY, mode) for r in reqs[:2]]
    last = run_all(engine)
    for rid, tokens, text in zip(ids, expected.token_ids, expected.texts):
        out = last[rid]
        print(f"{mode} {rid}: {out.text!r} ({out.finish_reason})")
        assert out.finished and out.token_ids == tokens and out.text == text
        assert out.finish_reason == ("length" if len(tokens) == GREEDY.max_tokens and tokens[-1] not in
                                     engine.eos_ids else "stop")
    assert engine.kv_store.stats()["pinned"] == 0


def test_join_mid_decode_and_abort_midway(smol):
    """A (reuse) decodes alone for three steps; B (sift) and C (dense) join its decode batch; C is aborted after
    two more steps. A and B answer exactly as alone; C ends with "abort" and the tokens it had; every page of
    the requests returns to the pool (only the engine's own page stays held)."""
    _, _, _, reqs = smol
    engine = engine_of(smol)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    alone = {m: engine.generate([r], mode=m, params=params).token_ids[0]
             for r, m in ((reqs[0], "reuse"), (reqs[1], "sift"))}
    a = engine.add_request(reqs[0], params, "reuse")
    last = {}
    for _ in range(3):
        last.update({o.request_id: o for o in engine.step()})
    assert not last[a].finished and len(last[a].token_ids) == 3   # the prefill's token, then one per step (behind)
    b = engine.add_request(reqs[1], params, "sift")
    c = engine.add_request(reqs[2], params, "dense")
    rows = []
    for _ in range(2):
        last.update({o.request_id: o for o in engine.step()})
        rows.append(engine.runner.n_rows)
    assert rows == [3, 3]
    engine.abort(c)
    last.update(run_all(engine))
    assert last[a].token_ids == alone["reuse"] and last[b].token_ids == alone["sift"]
    assert last[c].finished and last[c].finish_reason == "abort" and 1 <= len(last[c].token_ids) < 10
    s = engine.kv_store.stats()
    page = engine.kv_store.geometry.page_bytes
    assert s["pinned"] == 0 and s["pages_scratch"] == 1
    assert s["pages_free"] == engine.kv_store.n_pages - 1 - s["hbm_bytes"] // page
    engine.abort(c)                               # a finished request: nothing to do
    with pytest.raises(SiftError, match="unknown request id 'nope'"):
        engine.abort("nope")


def test_stop_strings_stop_ids_and_length(smol):
    """The greedy answer, cut by each stop rule: a stop string (the text ends before it, never shown while
    streaming), a stop token id (the last id; not in the text) and max_tokens."""
    _, _, _, reqs = smol
    engine = engine_of(smol)
    full = engine.generate([reqs[0]], max_new_tokens=12, mode="dense")
    ids, text = full.token_ids[0], full.texts[0]
    assert len(ids) == 12, "the test needs an answer of 12 tokens"
    stop = text[6:9]
    assert text.find(stop) == 6 and stop.strip()
    outs = list(engine.stream(reqs[0], SamplingParams(max_tokens=12, temperature=0.0, stop=[stop, "zzzz"]),
                              mode="dense"))
    final = outs[-1]
    assert final.finished and final.finish_reason == "stop" and final.text == text[:6]
    assert final.token_ids == ids[:len(final.token_ids)] and len(final.token_ids) < 12
    assert all(stop not in o.text and final.text.startswith(o.text) for o in outs)

    k = next(i for i in range(2, 12) if ids[i] not in ids[:i])
    out = engine.generate([reqs[0]], mode="dense",
                          params=SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[ids[k]]))
    assert out.token_ids[0] == ids[:k + 1]
    assert out.texts[0] == engine.tokenizer.decode(ids[:k], skip_special_tokens=True)
    short = list(engine.stream(reqs[0], SamplingParams(max_tokens=3, temperature=0.0), mode="dense"))
    assert short[-1].token_ids == ids[:3] and short[-1].finish_reason == "length"
    assert [len(o.token_ids) for o in short] == [1, 2, 3]


# ------------------------------------------------------------------------------- tiny random model: mechanics


@pytest.fixture(scope="module")
def tiny(tokenizer, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny")
    return _tiny("llama", tmp), tokenizer


def test_seeded_sampling_is_reproducible_in_any_batch(tiny):
    model, tokenizer = tiny
    engine = SiftEngine(model, tokenizer, None, kv_cache_bytes=8 << 20)
    (a,), (b,) = _tiny_requests()
    seeded = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=5)
    alone = engine.generate([a], mode="dense", params=seeded).token_ids[0]
    again = engine.generate([a], mode="dense", params=seeded).token_ids[0]
    with_b = engine.generate([b, a], mode="dense", params=[SamplingParams(max_tokens=5, seed=9), seeded])
    other = engine.generate([a], mode="dense", params=SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95,
                                                                     seed=6)).token_ids[0]
    print(alone, other)
    assert alone == again == with_b.token_ids[1] and other != alone


def test_admission_waits_for_pages(tiny):
    """A pool that holds one request at a time: the second waits (queued) while the first decodes, starts when
    its pages return, and both answer as alone; a request that could never fit is refused when added."""
    model, tokenizer = tiny
    (a,), (b,) = _tiny_requests()
    probe = SiftEngine(model, tokenizer, None, kv_cache_bytes=8 << 20, block=16)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    alone = [probe.generate([r], mode="dense", params=params).token_ids[0] for r in (a, b)]
    # pages of a request: its segments' blocks and one generation page (5 tokens written)
    need = [sum(-(-len(ids) // 16) for _, ids in probe.tokenize(r)) + 1 for r in (a, b)]
    page = probe.kv_store.geometry.page_bytes
    # room for the larger one, one spare page and the engine's own page: never both at once
    engine = SiftEngine(model, tokenizer, None, kv_cache_bytes=(max(need) + 2) * page, block=16)
    ids = [engine.add_request(r, params, "dense") for r in (a, b)]
    engine.step()
    assert engine.runner.n_rows == 1 and len(engine.scheduler.waiting) == 1
    last = run_all(engine)
    assert [last[i].token_ids for i in ids] == alone
    with pytest.raises(SiftError, match=r"this batch needs \d+ KV pages"):
        engine.add_request(Request("Hi.", [("x", " ".join(["word"] * 600))], "?"), params, "dense")


def test_outputs_come_one_step_behind(tiny):
    """The first token comes back from the step that prefilled; each later token one step after the step that
    drew it; has_unfinished holds until the last output was returned."""
    model, tokenizer = tiny
    engine = SiftEngine(model, tokenizer, None, kv_cache_bytes=8 << 20)
    (a,), _ = _tiny_requests()
    rid = engine.add_request(a, SamplingParams(max_tokens=3, temperature=0.0), "dense")
    counts = []
    while engine.has_unfinished():
        counts.append([len(o.token_ids) for o in engine.step() if o.request_id == rid])
    assert counts == [[1], [2], [3]]


def test_bad_values_are_refused_in_one_line(tiny):
    model, tokenizer = tiny
    engine = SiftEngine(model, tokenizer, None, kv_cache_bytes=8 << 20)
    (a,), _ = _tiny_requests()
    cases = [
        (lambda: engine.add_request(a, dict(temperature=0.5), "dense"), "params must be a SamplingParams"),
        (lambda: engine.add_request(a, None, "fast"), "mode='fast'"),
        (lambda: engine.add_request(a, None, "sift"), "needs an index"),
        (lambda: engine.add_request(a, SamplingParams(stop_token_ids=[10 ** 6]), "dense"), "outside the model"),
        (lambda: engine.add_request("text", None, "dense"), "expected Request"),
        (lambda: engine.abort("req-unknown"), "unknown request id"),
        (lambda: engine.generate([a], max_new_tokens=0, mode="dense"), "max_new_tokens=0"),
        (lambda: engine.generate([a], mode="dense", params=[GREEDY, GREEDY]), "2 SamplingParams for 1"),
        (lambda: SiftEngine(model, tokenizer, None, kv_cache_bytes=-1), "kv_cache_bytes=-1"),
        (lambda: SiftEngine(model, tokenizer, None, kv_cache_bytes=1 << 20, kv_store=KVStore(1 << 20)), "not both"),
        (lambda: SiftEngine(model, tokenizer, None, cuda_graphs=True), "cuda_graphs=True needs"),
        (lambda: SiftEngine(model, tokenizer, None, max_running=65), "max_running=65"),
    ]
    for call, match in cases:
        with pytest.raises(SiftError, match=match) as e:
            call()
        assert "\n" not in str(e.value)
    rid = engine.add_request(a, GREEDY, "dense", request_id="mine")
    with pytest.raises(SiftError, match="already in use"):
        engine.add_request(a, GREEDY, "dense", request_id="mine")
    assert rid == "mine"
    run_all(engine)


def test_requests_from_other_threads_while_a_loop_steps(tiny):
    """A serving loop steps on one thread while others add and abort requests: every request ends, the added
    ones answer as alone, the aborted one says so, and the pool gets its pages back. Closing a stream early
    aborts its request."""
    import threading
    import time

    model, tokenizer = tiny
    engine = SiftEngine(model, tokenizer, None, kv_cache_bytes=8 << 20)
    (a,), (b,) = _tiny_requests()
    params = SamplingParams(max_tokens=6, temperature=0.0)
    alone = {r.prefix: engine.generate([r], mode="dense", params=params).token_ids[0] for r in (a, b)}
    ids, done = [], threading.Event()
    last = {}

    def loop():
        while not done.is_set() or engine.has_unfinished():
            last.update({o.request_id: o for o in engine.step()})

    stepper = threading.Thread(target=loop)
    stepper.start()
    try:
        for r in (a, b, a):
            ids.append(engine.add_request(r, params, "dense"))
        long = engine.add_request(b, SamplingParams(max_tokens=400, temperature=0.0), "dense")
        deadline = time.monotonic() + 120
        while long not in last and time.monotonic() < deadline:      # it has begun generating
            time.sleep(0.001)
        engine.abort(long)
    finally:
        done.set()
        stepper.join(timeout=120)
    assert not stepper.is_alive()
    assert [last[i].token_ids for i in ids] == [alone[a.prefix], alone[b.prefix], alone[a.prefix]]
    assert last[long].finish_reason == "abort" and len(last[long].token_ids) < 400
    stream = engine.stream(a, params, mode="dense")
    first = next(stream)
    stream.close()
    engine.step()                       # the abort is taken at the next step
    assert not first.finished and not engine.has_unfinished()
    s = engine.kv_store.stats()
    assert s["pinned"] == 0 and s["pages_scratch"] == 1
