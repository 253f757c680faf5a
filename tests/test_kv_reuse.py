"""Modes "reuse" and "hybrid" of SiftEngine with a KVStore, on CPU with the real SmolLM2 weights.

The expected values come from plain transformers, never from the engine: "reuse" must equal a forward of the
query over a `DynamicCache` assembled by hand from each document's KV computed on its own after the profiling
prefix (then moved to its offset in the request by RoPE's rotation, with transformers' own rotary embedding),
and greedy generation must continue that cache the way transformers does. "hybrid" recomputing every block
must equal the plain forward of the unsegmented prompt.

Two calls that run the same operations in the same order (a hit reads the very bytes the miss stored, and the
query's forward has the same shapes) must give bitwise equal logits: `torch.equal`. Two calls whose forwards have
other shapes (documents computed inside the request's forward or in forwards of their own, another batch, the
plain transformers forward) round differently, in a pattern that depends on the CPU's BLAS: they are compared
within `helpers.model_logit_tol`, derived from fp32's epsilon, the model's depth and width and the logits' scale.
"""
import math
from fractions import Fraction

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from sift.errors import SiftError
from sift.runtime import KVStore, Request, SiftEngine, SiftIndex
from sift.quality.prompts import QUERY, SYSTEM

from .helpers import DEVICE, assert_within, model_logit_tol, model_on_device
from .test_engine import doc_ids, hotpot, plain_last_logits, real, write_index  # noqa: F401 (fixture)

CHARS = 260   # paragraphs cut to ~50-60 tokens: a few blocks of 16 each, fast on CPU


def requests_of(q: dict, order: list[int], prefix: str = SYSTEM) -> Request:
    docs = [(q["paragraphs"][i][0], q["paragraphs"][i][1][:CHARS]) for i in order]
    return Request(prefix, docs, QUERY.format(question=q["question"]))


@pytest.fixture(scope="module")
def setup(real, tmp_path_factory):
    model, tokenizer, fp = real
    q = hotpot(1)[0]
    reqs = [requests_of(q, [0, 1, 2]), requests_of(q, [2, 0, 3], prefix="Passages:\n"), requests_of(q, [3, 1])]
    bos = [tokenizer.bos_token_id]
    index = write_index(tmp_path_factory.mktemp("reuse") / "index", model, fp, doc_ids(tokenizer, reqs), tile=16,
                        prefix_ids=bos)
    return model, tokenizer, index, reqs


def engine_with(setup, hbm_pages: int = 64, dram_pages: int = 64, **kw):
    model, tokenizer, index, _ = setup
    cfg = model.config   # a page: K and V of one 16-token block (the index tile), every layer, fp32
    page = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * index.tile * index.head_dim * 4
    store = KVStore(hbm_bytes=hbm_pages * page, dram_bytes=dram_pages * page)
    return SiftEngine(model, tokenizer, index, kv_store=store, **kw), store


# ------------------------------------------------------------------------------ the independent reference


def rotate(model, k: torch.Tensor, delta: int) -> torch.Tensor:
    """Keys [1, H, n, D] moved by `delta` positions with transformers' rotary embedding."""
    cos, sin = model.model.rotary_emb(k, torch.full((1, k.shape[2]), delta))
    return apply_rotary_pos_emb(k, k, cos, sin)[0]


@torch.inference_mode()
def reference_reuse(model, engine: SiftEngine, request: Request, new_tokens: int = 0):
    """Last-position logits (and greedy continuation) of `request` in reuse semantics, with plain transformers."""
    segs = engine.tokenize(request)
    pfx = engine.prefix_ids
    out = model(input_ids=torch.tensor([segs[0][1]]), use_cache=True)
    layers = [([lay.keys], [lay.values]) for lay in out.past_key_values.layers]
    pos = len(segs[0][1])
    for kind, ids in segs[1:-1]:
        doc = model(input_ids=torch.tensor([pfx + ids]), use_cache=True).past_key_values.layers
        for (ks, vs), lay in zip(layers, doc):
            ks.append(rotate(model, lay.keys[:, :, len(pfx):], pos - len(pfx)))
            vs.append(lay.values[:, :, len(pfx):])
        pos += len(ids)
    cache = DynamicCache(ddp_cache_data=[(torch.cat(ks, 2), torch.cat(vs, 2)) for ks, vs in layers])
    query = segs[-1][1]
    out = model(input_ids=torch.tensor([query]), position_ids=torch.arange(pos, pos + len(query))[None],
                past_key_values=cache, use_cache=True)
    logits = out.logits[0, -1].float()
    tokens, pos = [], pos + len(query)
    token = int(logits.argmax())
    for _ in range(new_tokens):
        tokens.append(token)
        if token in engine.eos_ids or len(tokens) == new_tokens:
            break
        out = model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[pos]]), past_key_values=cache,
                    use_cache=True)
        token, pos = int(out.logits[0, -1].argmax()), pos + 1
    return logits, tokens


# ------------------------------------------------------------------------------------------------ tests


def test_reuse_equals_transformers_over_an_assembled_cache(setup):
    """Cold store, one batch of three requests sharing documents at different offsets (reordered, another
    prefix): logits equal the hand-assembled reference; each shared document is one entry."""
    model, _, _, reqs = setup
    engine, store = engine_with(setup)
    res = engine.prefill(reqs, mode="reuse")
    for i, r in enumerate(reqs):
        ref, _ = reference_reuse(model, engine, r)
        assert_within(res.logits[i], ref, model_logit_tol(model.config, ref), f"request {i} vs transformers")
        assert res.logits[i].argmax() == ref.argmax()
    distinct = {d for r in reqs for d, _ in r.docs}
    s = store.stats()
    assert s["entries_hbm"] == len(distinct) == s["misses"] == res.store["computed"]
    assert res.mode == "reuse" and 0.0 < res.tile_fraction < 1.0 and res.recomputed_fraction == 0.0


def test_warm_equals_cold_from_hbm_and_from_dram(setup):
    """A hit never changes an answer: cold, HBM-warm and DRAM-warm prefills give the same logits, and a
    document promoted into pages another document held reads its own bytes. The warm calls read the same bytes
    with the same operations: bitwise equal logits. The cold call computes its documents inside the query's own
    forward, whose matrices have other shapes, so it equals them within rounding (`model_logit_tol`): on some
    CPUs' BLAS the other shapes round alike, on others not."""
    model, _, _, reqs = setup
    # 26 pages: one request at a time (reqs[0] needs 25 while its documents are missing, 22 once stored; the
    # engine holds one page for its decode batch)
    engine, store = engine_with(setup, hbm_pages=26, dram_pages=200, on_unknown="dense")
    cold = engine.prefill([reqs[0]], mode="reuse")
    warm = engine.prefill([reqs[0]], mode="reuse")
    assert warm.store == dict(hbm=3, dram=0, computed=0, computed_blocks=0)
    assert_within(warm.logits, cold.logits, model_logit_tol(model.config, cold.logits), "warm vs cold")
    other = requests_of(hotpot(1)[0], [4, 5, 6])   # three other documents: reqs[0]'s are evicted to DRAM
    engine.prefill([other], mode="reuse")
    again = engine.prefill([reqs[0]], mode="reuse")
    assert again.store["dram"] == 3, (again.store, store.stats())
    assert torch.equal(again.logits, warm.logits)
    assert store.stats()["pinned"] == 0


@pytest.mark.parametrize("policy", ["first", "deviation"])
def test_cold_hybrid_equals_warm(setup, policy):
    """Missing documents run inside the request's forward ("first") or in a forward of their own first
    ("deviation" reads their stored keys to choose blocks): either way the call's logits equal the warm call's,
    and so do the entries it stored. "first" computes the documents in the request's own forward, whose matrices
    have other shapes than the warm call's: equal within rounding (`model_logit_tol`), not bitwise."""
    model, _, _, reqs = setup
    engine, store = engine_with(setup, hbm_pages=64)
    cold = engine.prefill([reqs[0]], mode=f"hybrid:{policy}")
    assert cold.store["computed"] == 3 and cold.recomputed_fraction > 0.0
    warm = engine.prefill([reqs[0]], mode=f"hybrid:{policy}")
    assert warm.store["computed"] == 0
    assert_within(warm.logits, cold.logits, model_logit_tol(model.config, cold.logits),
                  f"hybrid:{policy} warm vs cold")
    assert store.stats()["pinned"] == 0


def test_one_document_at_two_offsets_equals_each_request_alone(setup):
    model, _, _, reqs = setup
    engine, store = engine_with(setup)
    batch = engine.prefill(reqs[:2], mode="reuse")
    for i in range(2):
        alone = engine.prefill([reqs[i]], mode="reuse")
        assert_within(batch.logits[i], alone.logits[0], model_logit_tol(model.config, alone.logits[0]),
                      f"request {i} in a batch vs alone")


def test_reuse_generation_equals_transformers(setup):
    model, _, _, reqs = setup
    engine, store = engine_with(setup)
    out = engine.generate(reqs[:2], max_new_tokens=6, mode="reuse")
    for r, ids in zip(reqs[:2], out.token_ids):
        _, expected = reference_reuse(model, engine, r, new_tokens=6)
        assert ids == expected
    assert store.stats()["pinned"] == 0


def test_hybrid_recomputing_everything_equals_the_plain_forward(setup):
    """All-ones bits and every block recomputed: the request is computed in full context, as a plain forward."""
    model, _, _, reqs = setup
    engine, _ = engine_with(setup, hbm_pages=128, hybrid_fraction=1.0)
    engine.prefill(reqs[:2], mode="reuse")   # warm
    res = engine.prefill(reqs[:2], mode="hybrid:deviation")  # at this budget every policy picks every block
    assert res.recomputed_fraction == pytest.approx(1.0)
    for i, r in enumerate(reqs[:2]):
        ref = plain_last_logits(model, engine.prompt_ids(r))
        assert_within(res.logits[i], ref, model_logit_tol(model.config, ref), f"request {i} vs the plain forward")


def test_answers_ignore_what_padding_slots_hold(setup):
    """A document's last page has padding slots that keep whatever an earlier user of the page wrote there (pages
    are recycled: scratch pages of earlier calls, generated tokens). Attention must mask them and the deviation
    policy compare real slots only, so no answer depends on the pool's history. Padding slots are never read, so
    both engines run the same operations in the same order: bitwise equal logits."""
    _, _, _, reqs = setup
    modes = ("reuse", "hybrid:deviation", "hybrid:first")
    clean, _ = engine_with(setup, hbm_pages=128, hybrid_fraction=0.2)
    clean.prefill(reqs[:1], mode="reuse")
    expected = {m: clean.prefill(reqs[:1], mode=m) for m in modes}
    expected_ids = clean.generate(reqs[:1], max_new_tokens=3, mode="reuse").token_ids
    dirty, store = engine_with(setup, hbm_pages=128, hybrid_fraction=0.2)
    dirty.prefill(reqs[:1], mode="reuse")
    blk = dirty.block
    slots = torch.arange(store.k_pool.shape[1]).view(-1, blk)
    padding = (slots % blk >= store.page_valid[:, None]).flatten()
    assert 0 < int(padding.view(-1, blk)[store.page_valid > 0].sum())  # some entry ends inside a page
    store.k_pool[:, padding] = 1e3                                        # what a recycled page may hold
    store.v_pool[:, padding] = -1e3
    for m in modes:
        got = dirty.prefill(reqs[:1], mode=m)
        assert got.recomputed_fraction == expected[m].recomputed_fraction, m
        assert torch.equal(got.logits, expected[m].logits), m
    assert dirty.generate(reqs[:1], max_new_tokens=3, mode="reuse").token_ids == expected_ids


def recomputed_share(tokenizer, reqs, fraction: float, block: int) -> tuple[float, float, float]:
    """From the budget's definition (ceil(fraction x a document's blocks), at least one, at most all, per
    document of every request): the share of the documents' tokens that policy "first" recomputes, and the least
    and most any choice of that many blocks can (the last block of a document may be short)."""
    first = lo = hi = total = 0
    for req in reqs:
        for _, text in req.docs:
            n = len(tokenizer(text, add_special_tokens=False).input_ids)
            blocks = -(-n // block)
            k = min(blocks, max(1, math.ceil(Fraction(str(fraction)) * blocks)))   # exact arithmetic
            last = n - block * (blocks - 1)
            first += min(k * block, n)
            lo += block * (k - 1) + last
            hi += min(k * block, n)
            total += n
    return first / total, lo / total, hi / total


def test_hybrid_policies_choose_within_budget(setup):
    """Each policy recomputes a share of the blocks within the call's budget; "hybrid:none" recomputes nothing
    and equals "reuse" within rounding (its forward runs a recompute pass with an empty set: other shapes)."""
    model, tokenizer, index, reqs = setup
    engine, _ = engine_with(setup, hbm_pages=128, hybrid_fraction=0.2)
    none = engine.prefill(reqs, mode="hybrid:none")
    reused = engine.prefill(reqs, mode="reuse")
    assert_within(none.logits, reused.logits, model_logit_tol(model.config, reused.logits), "hybrid:none vs reuse")
    first, lo, hi = recomputed_share(tokenizer, reqs, 0.2, engine.block)
    assert engine.prefill(reqs, mode="hybrid:first").recomputed_fraction == pytest.approx(first, abs=1e-12)
    for policy in ("bits", "deviation"):
        res = engine.prefill(reqs, mode=f"hybrid:{policy}")
        assert lo - 1e-12 <= res.recomputed_fraction <= hi + 1e-12, (policy, res.recomputed_fraction, lo, hi)
    assert engine.prefill(reqs, mode="hybrid").mode == "hybrid"
    # A call's own budget: "@1" recomputes every block of every document, "@0.6" more than the engine's 0.2.
    assert engine.prefill(reqs, mode="hybrid:first@1").recomputed_fraction == 1.0
    share = engine.prefill(reqs, mode="hybrid:first@0.6").recomputed_fraction
    assert engine.prefill(reqs, mode="hybrid:first").recomputed_fraction < share < 1.0


def test_budget_too_small_and_bad_modes_are_refused(setup):
    model, tokenizer, index, reqs = setup
    engine, store = engine_with(setup, hbm_pages=6)
    with pytest.raises(SiftError, match=r"this batch needs \d+ KV pages .* raise KVStore\(hbm_bytes=\.\.\.\)"):
        engine.prefill(reqs, mode="reuse")
    assert store.stats()["misses"] == 0 and store.stats()["pinned"] == 0
    for bad in ("hybrid:magic", "hybrid:first@1.5", "hybrid:first@", "reuse@0.5"):
        with pytest.raises(SiftError, match="hybrid:<policy>"):
            engine.prefill(reqs, mode=bad)
    title, text = reqs[0].docs[0]
    stale = Request(SYSTEM, [(title, text + " Edited.")], "Why?")
    with pytest.raises(SiftError, match="stale index"):
        engine.prefill([stale], mode="reuse")


def test_triton_backend_reuse_equals_torch_backend(tmp_path):
    """The GPU path of the reuse modes (q_blocks prefill over pages gathered from the token-major pool, decode
    reading the pool in place with per-entry offsets; on DEVICE, Triton interpreted on CPU) on a tiny random
    Llama: same logits and greedy tokens as the torch backend on the CPU, one request holding a document the other
    holds elsewhere. Both at block 16 (the CPU's default; a GPU engine's is 128): the same blocks reused."""
    from .test_engine import _tiny, fingerprint
    from transformers import AutoTokenizer
    from sift.model import DEFAULT_MODEL, resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(DEFAULT_MODEL))
    model = _tiny("llama", tmp_path)
    a = ("a", "Lilu is a spirit. In Akkadian texts the lilu were wind demons of the night.")
    b = ("b", "Gallu is a demon of the underworld, one of the seven who drag souls below.")
    reqs = [Request("Hi.", [a, b], "Lilu?"), Request("", [b, a], "Gallu, and who else?")]
    index = write_index(tmp_path / "index", model, fingerprint(tmp_path / "model"), doc_ids(tokenizer, reqs),
                        tile=16, prefix_ids=[tokenizer.bos_token_id])
    out = {}
    runs = {"triton": (model_on_device(model), SiftIndex.open(tmp_path / "index", device=DEVICE)),
            "torch": (model, index)}
    for backend, (on_model, on_index) in runs.items():
        store = KVStore(hbm_bytes=8 << 20)
        engine = SiftEngine(on_model, tokenizer, on_index, backend=backend, kv_store=store, hybrid_fraction=0.5,
                            block=16)
        out[backend] = [engine.generate(reqs, max_new_tokens=3, mode=m) for m in ("reuse", "hybrid:bits")]
    for g, c in zip(out["triton"], out["torch"]):
        assert g.prefill.backend == "triton"
        assert_within(g.prefill.logits, c.prefill.logits, model_logit_tol(model.config, c.prefill.logits),
                      f"{g.prefill.mode}: triton vs torch backend")
        assert g.token_ids == c.token_ids
