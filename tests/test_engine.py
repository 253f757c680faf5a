"""SiftEngine on CPU (runtime/engine.py): SPEC section 4's dense-equivalence gate on real HotpotQA prompts with
the real SmolLM2 weights, position-free reuse of one stored document under reordering, real SIFT bits vs dense,
the stale / unknown document contract, and tiny random Llama / Qwen2 / Qwen3 / Mistral models.

Indexes are written with the pipeline's own shard and manifest writers (no Ray): all-ones bits for the gate,
bits from `Profiler` for the sparse comparison. Expected values come from plain transformers (SDPA forward of
the unsegmented prompt, `model.generate`), never from the engine.
"""
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from sift.errors import SiftError
from sift.format import n_pages
from sift.kernels.bits import pack_msb
from sift.kernels.block_indices import block_indices_ref, dense_block_indices, pack_doc_bits
from sift.kernels.layout import build_layout
from sift.kernels.sparse_attention import sparse_attention_ref
from sift import format as fmt
from sift.pipeline import index as idx
from sift.model import DEFAULT_MODEL, fingerprint, resolve_model_dir
from sift.format import content_hash
from sift.runtime import Request, SiftEngine, SiftIndex
from sift.quality.prompts import QUERY, SYSTEM, load_questions
from sift.kernels.sparse_attention import sparse_attention_sdpa

from .helpers import (DEVICE, assert_within, model_logit_tol, model_on_device, rounding_tol, run_in_threads,
                      smollm2)



def hotpot(n: int) -> list[dict]:
    return load_questions(n)


def request(q: dict, *, reverse: bool = False, prefix: str = SYSTEM, chars: int | None = None) -> Request:
    """The demo's chat-formatted HotpotQA prompt (so that SmolLM2-Instruct answers rather than stops)."""
    docs = [(title, text[:chars] if chars else text) for title, text in q["paragraphs"]]
    return Request(prefix, docs[::-1] if reverse else docs, QUERY.format(question=q["question"]))


def ones_bits(n_tokens: int, tile: int, vectors: int) -> tuple[bytes, bytes]:
    p = n_pages(n_tokens, tile)
    la = pack_msb(torch.ones(vectors, p * (p + 1) // 2, dtype=torch.bool))
    ca = pack_msb(torch.ones(vectors, p, dtype=torch.bool))
    return la.numpy().tobytes(), ca.numpy().tobytes()


def write_index(root: Path, model, fp: str, docs: dict[str, list[int]], *, tile: int, bits=None,
                prefix_ids: list[int] = (), sensitivity: dict[str, float] | None = None) -> SiftIndex:
    """A committed one-shard index of `docs` (doc_id -> token ids) for `model`; bits: doc_id -> (la, ca)
    bytes, all ones when None; prefix_ids: the profiling prefix it records; sensitivity: doc_id -> the optional
    `context_sensitivity` column (absent when None)."""
    cfg = model.config
    vectors = cfg.num_hidden_layers * cfg.num_attention_heads
    rows = []
    for doc_id, ids in docs.items():
        la, ca = bits[doc_id] if bits else ones_bits(len(ids), tile, vectors)
        rows.append(dict(doc_id=doc_id, content_hash=content_hash(ids), n_tokens=len(ids), la_bits=la, ca_bits=ca,
                         source="test", la_density=[0.0] * cfg.num_hidden_layers,
                         ca_density=[0.0] * cfg.num_hidden_layers))
        if sensitivity is not None:
            rows[-1]["context_sensitivity"] = sensitivity[doc_id]
    schema = fmt.DOCS_SCHEMA
    if sensitivity is not None:
        schema = schema.append(pa.field("context_sensitivity", pa.float32()))
    idx.prepare_dir(root)
    info = idx.write_table(root, pa.Table.from_pylist(rows, schema=schema), kind="part",
                           profile_key="test", backend="torch")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    manifest = {
        "format": fmt.FORMAT, "format_version": fmt.FORMAT_VERSION, "generation": 1, "created_at": idx.now_iso(),
        "model": {"name": str(model.name_or_path), "fingerprint": fp, "model_type": cfg.model_type,
                  "n_layers": cfg.num_hidden_layers, "n_heads": cfg.num_attention_heads,
                  "n_kv_heads": cfg.num_key_value_heads, "head_dim": head_dim, "rope": {},
                  "max_position_embeddings": cfg.max_position_embeddings},
        "profile": {"tile": tile, "alpha": 0.001, "beta": 0.01, "gamma": 0.1, "ca_normalize": "causal",
                    "force_sink_page": True, "dense_heads": [], "prefix_text": None, "dtype": "float32",
                    "prefix_token_ids": list(prefix_ids), "profile_key": "test"},
        "shards": [info.to_dict()], "errors": None, "documents": len(rows),
    }
    idx.commit_manifest(root, fmt.Manifest.from_dict(manifest))
    return SiftIndex.open(root, device="cpu")


def doc_ids(tokenizer, requests) -> dict[str, list[int]]:
    return {d: tokenizer(t, add_special_tokens=False).input_ids for r in requests for d, t in r.docs}


@torch.inference_mode()
def plain_last_logits(model, ids: list[int]) -> torch.Tensor:
    assert model.config._attn_implementation == "sdpa"
    return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


@torch.inference_mode()
def plain_generate(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


# ------------------------------------------------------------------------------- real SmolLM2, all-ones gate


@pytest.fixture(scope="module")
def real():
    model, tokenizer = smollm2()
    return model, tokenizer, fingerprint(resolve_model_dir(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def gate(real, tmp_path_factory):
    """Two HotpotQA questions (system prompt + 10 paragraphs + question) and the first one again with its
    paragraphs reversed and another prefix, over one all-ones index of their paragraphs (tile 16)."""
    model, tokenizer, fp = real
    qs = hotpot(2)
    reqs = [request(qs[0]), request(qs[1]), request(qs[0], reverse=True, prefix="Passages:\n")]
    index = write_index(tmp_path_factory.mktemp("ones") / "index", model, fp, doc_ids(tokenizer, reqs), tile=16)
    engine = SiftEngine(model, tokenizer, index)
    plain = [plain_last_logits(model, engine.prompt_ids(r)) for r in reqs]
    return engine, reqs, plain


@pytest.mark.parametrize("mode", ["sift", "dense"])
def test_all_ones_prefill_equals_plain_forward(gate, mode):
    """SPEC section 4: with every bit 1 (or in dense mode) the logits match the plain forward of the unsegmented
    prompt; the third request reuses the same stored bits at other offsets (reordered, other prefix)."""
    engine, reqs, plain = gate
    res = engine.prefill(reqs, mode=mode)
    assert res.backend == "torch" and res.block == 16 and res.logits.shape == (3, engine.model.config.vocab_size)
    assert res.logits.dtype == torch.float32
    for i, ref in enumerate(plain):
        assert_within(res.logits[i], ref, model_logit_tol(engine.model.config, ref),
                      f"{mode} request {i} ({res.n_tokens[i]} tokens)")
        assert res.logits[i].argmax() == ref.argmax()
    assert res.tile_fraction == pytest.approx(1.0)
    assert set(res.stages) == {"fetch", "decode", "attention", "store", "rest", "total"}
    assert res.ttft_s == (res.stages["total"],) * 3
    print(f"{mode}: TTFT {res.stages['total']:.2f}s, stages {res.stages}")


def test_all_ones_generation_equals_model_generate(gate):
    """Greedy generation over the position-free cache equals transformers' generate on the unsegmented prompt."""
    engine, reqs, _ = gate
    batch = [reqs[0], reqs[2]]
    out = engine.generate(batch, max_new_tokens=8, mode="sift")
    for r, ids, text in zip(batch, out.token_ids, out.texts):
        expected = plain_generate(engine.model, engine.prompt_ids(r), 8)
        print(f"sift: {text!r} | transformers: {engine.tokenizer.decode(expected, skip_special_tokens=True)!r}")
        assert ids == expected


def test_stale_and_unknown_documents_are_refused(gate):
    engine, reqs, _ = gate
    title, text = reqs[0].docs[3]
    stale = Request(SYSTEM, [(title, text + " Edited.")], "Why?")
    with pytest.raises(SiftError, match=rf"stale index: document '{title}'.*rebuild the index"):
        engine.prefill([stale])
    unknown = Request(SYSTEM, [("no such passage", "Some text that was never indexed.")], "Why?")
    with pytest.raises(SiftError, match="'no such passage' is not in index.*on_unknown='dense'"):
        engine.prefill([unknown])
    engine.prefill([stale], mode="dense")  # dense mode needs no bits


# ---------------------------------------------------------------------------- real SmolLM2, real SIFT bits


def test_real_bits_sparse_vs_dense(real, tmp_path):
    """Profile the paragraphs of two questions (tile 16), then compare sift with dense: fraction of tiles
    computed and greedy agreement (the first token must agree; the rest is printed)."""
    from sift.pipeline.config import ProfileConfig
    from sift.pipeline.profiler import Profiler

    model, tokenizer, fp = real
    qs = hotpot(4)[2:4]
    reqs = [request(q) for q in qs]
    docs = doc_ids(tokenizer, reqs)
    previous = model.config._attn_implementation
    try:
        profiler = Profiler(model, tokenizer, ProfileConfig(tile=16), "torch")
        bits = {}
        for d, ids in docs.items():
            b = profiler.profile(ids)
            bits[d] = (b.la, b.ca)
    finally:
        model.set_attn_implementation(previous)
    index = write_index(tmp_path / "index", model, fp, docs, tile=16, bits=bits)
    engine = SiftEngine(model, tokenizer, index)
    sparse = engine.generate(reqs, max_new_tokens=8, mode="sift")
    dense = engine.generate(reqs, max_new_tokens=8, mode="dense")
    frac = sparse.prefill.tile_fraction
    print(f"tile fraction computed: {frac:.3f}; TTFT sift {sparse.prefill.stages['total']:.2f}s "
          f"dense {dense.prefill.stages['total']:.2f}s")
    assert 0.0 < frac < 1.0
    for q, s, d in zip(qs, sparse.token_ids, dense.token_ids):
        agree = next((i for i, (a, b) in enumerate(zip(s, d)) if a != b), min(len(s), len(d)))
        print(f"Q: {q['question']} (gold {q['answer']!r})\n  sift : {tokenizer.decode(s)!r}\n"
              f"  dense: {tokenizer.decode(d)!r}\n  agree on the first {agree} tokens")
        assert s[0] == d[0]


# ----------------------------------------------------------------------------------- tiny random families


def _tiny(family: str, tmp: Path, **overrides):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[family]
    kwargs = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                  rope_theta=10000.0, tie_word_embeddings=True)
    if family == "mistral":
        kwargs["sliding_window"] = 4096
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**kwargs), attn_implementation="sdpa")
    model.save_pretrained(tmp / "model")
    # Reloaded so that name_or_path is the folder the index's fingerprint describes.
    return AutoModelForCausalLM.from_pretrained(tmp / "model", attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(DEFAULT_MODEL))


def _tiny_requests():
    q = hotpot(1)[0]
    return [request(q, chars=160)], [request(q, chars=160, reverse=True, prefix="")]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_tiny_family_all_ones_equals_plain(family, tokenizer, tmp_path):
    model = _tiny(family, tmp_path)
    (a,), (b,) = _tiny_requests()
    index = write_index(tmp_path / "index", model, fingerprint(tmp_path / "model"), doc_ids(tokenizer, [a, b]),
                        tile=16)
    engine = SiftEngine(model, tokenizer, index, block=32)
    for mode in ("sift", "dense"):
        res = engine.prefill([a, b], mode=mode)
        for i, r in enumerate((a, b)):
            ref = plain_last_logits(model, engine.prompt_ids(r))
            assert_within(res.logits[i], ref, model_logit_tol(model.config, ref), f"{family} {mode} request {i}")
    out = engine.generate([a, b], max_new_tokens=5)
    for r, ids in zip((a, b), out.token_ids):
        assert ids == plain_generate(model, engine.prompt_ids(r), 5)


def test_unknown_document_dense_fallback(tokenizer, tmp_path):
    model = _tiny("llama", tmp_path)
    (a,), _ = _tiny_requests()
    known = dict(list(doc_ids(tokenizer, [a]).items())[:-3])  # the last 3 paragraphs are not indexed
    index = write_index(tmp_path / "index", model, fingerprint(tmp_path / "model"), known, tile=16)
    with pytest.raises(SiftError, match="not in index"):
        SiftEngine(model, tokenizer, index).prefill([a])
    res = SiftEngine(model, tokenizer, index, on_unknown="dense").prefill([a])
    ref = plain_last_logits(model, SiftEngine(model, tokenizer, index).prompt_ids(a))
    assert_within(res.logits[0], ref, model_logit_tol(model.config, ref), "dense fallback vs the plain forward")
    assert index.stats()["dense"] == 3


def test_reference_backend_equals_torch_backend(tokenizer, tmp_path):
    """The kernels' ref twins (backend="reference") and the SDPA CPU path (backend="torch") give the same logits,
    with sparse bits (random, half the tiles) so that the pattern matters."""
    model = _tiny("qwen3", tmp_path)
    q = hotpot(1)[0]
    r = Request("Hi.", [(t, x[:90]) for t, x in q["paragraphs"][:3]], "Why?")
    docs = doc_ids(tokenizer, [r])
    gen = torch.Generator().manual_seed(1)
    bits = {}
    for d, ids in docs.items():
        p = n_pages(len(ids), 16)
        bits[d] = (pack_msb(torch.rand(8, p * (p + 1) // 2, generator=gen) < 0.5).numpy().tobytes(),
                   pack_msb(torch.rand(8, p, generator=gen) < 0.5).numpy().tobytes())
    index = write_index(tmp_path / "index", model, fingerprint(tmp_path / "model"), docs, tile=16, bits=bits)
    fast = SiftEngine(model, tokenizer, index, backend="torch").prefill([r])
    slow = SiftEngine(model, tokenizer, index, backend="reference").prefill([r])
    assert slow.backend == "reference" and 0 < fast.tile_fraction < 1
    assert fast.tile_fraction == slow.tile_fraction
    assert_within(fast.logits, slow.logits, model_logit_tol(model.config, slow.logits), "torch vs reference backend")


@pytest.mark.parametrize("hq,hkv,block", [(4, 2, 16), (6, 1, 32), (3, 3, 16)])
def test_sparse_attention_sdpa_equals_ref(hq, hkv, block):
    """The engine's vectorised CPU attention equals `sparse_attention_ref` on a random two-request layout with
    lengths off the block grid, random bits and RoPE."""
    gen = torch.Generator().manual_seed(hq * 7 + block)
    reqs = [[("prefix", 5), ("doc", 37), ("doc", 16), ("query", 9)], [("doc", 50), ("doc", 3), ("query", 20)]]
    lay = build_layout(reqs, block)
    n_tok = [n for r in reqs for kind, n in r if kind == "doc"]
    tile = 16
    las, cas = [], []
    for n in n_tok:
        p = n_pages(n, tile)
        las.append(pack_msb(torch.rand(hq, p * (p + 1) // 2, generator=gen) < 0.4).numpy().tobytes())
        cas.append(pack_msb(torch.rand(hq, p, generator=gen) < 0.4).numpy().tobytes())
    bits = pack_doc_bits(las, cas, n_tok, tile=tile, n_layers=1, n_heads=hq)
    la_ptr, ca_ptr = bits.layer_ptrs(0)
    indptr, indices = block_indices_ref(lay, bits.la_bytes, la_ptr, bits.ca_bytes, ca_ptr, tile)
    d = 64
    q = lay.scatter(torch.randn(hq, lay.n_tokens, d, generator=gen), dim=1)
    k = lay.scatter(torch.randn(hkv, lay.n_tokens, d, generator=gen), dim=1)
    v = lay.scatter(torch.randn(hkv, lay.n_tokens, d, generator=gen), dim=1)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    ref = sparse_attention_ref(q, k, v, indptr, indices, lay.block_valid, lay.block_offset, inv_freq,
                               scale=d ** -0.5, block=block)
    # Two fp32 computations of one layer: scores over head_dim, then softmax and P @ V over a request's keys.
    tol = rounding_tol(torch.float32, scale=v.abs().max().item(), reduction=max(d, lay.n_tokens), depth=2)
    out = sparse_attention_sdpa(q, k, v, indptr, indices, lay, inv_freq, scale=d ** -0.5)
    assert_within(out, ref, tol, "sparse")
    indptr, indices = dense_block_indices(lay, hq)
    ref = sparse_attention_ref(q, k, v, indptr, indices, lay.block_valid, lay.block_offset, inv_freq,
                               scale=d ** -0.5, block=block)
    out = sparse_attention_sdpa(q, k, v, indptr, indices, lay, inv_freq, scale=d ** -0.5, causal=True)
    assert_within(out, ref, tol, "dense")


# ------------------------------------------------------------------------------------------------ refusals


def test_refusals(tokenizer, tmp_path):
    model = _tiny("mistral", tmp_path, sliding_window=64)
    (a,), _ = _tiny_requests()
    index = write_index(tmp_path / "index", model, fingerprint(tmp_path / "model"), doc_ids(tokenizer, [a]),
                        tile=32)
    engine = SiftEngine(model, tokenizer, index, block=32)
    with pytest.raises(SiftError, match="sliding window"):
        engine.prefill([a])
    with pytest.raises(SiftError, match="smaller than the index tile 32"):
        SiftEngine(model, tokenizer, index, block=16)
    with pytest.raises(SiftError, match="mode="):
        engine.prefill([a], mode="fast")
    model.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(SiftError, match="rope_type='dynamic' is unsupported"):
        SiftEngine(model, tokenizer, index)


def test_triton_backend_equals_torch_backend(tokenizer, tmp_path):
    """The GPU path (Triton block_indices, sparse_attention, decode_attention; on DEVICE, interpreted on CPU) on a
    short prompt with sparse random bits: same logits and greedy tokens as the torch backend on the CPU. Both at
    block 16 (the CPU's default; a GPU engine's is 128), so that both compute the same tiles."""
    model = _tiny("llama", tmp_path)
    r = Request("Hi.", [("a", "Lilu is a spirit. In Akkadian texts the lilu were wind demons of the night."),
                        ("b", "Gallu is a demon of the underworld, one of the seven who drag souls below.")], "Lilu?")
    docs = doc_ids(tokenizer, [r])
    gen = torch.Generator().manual_seed(2)
    bits = {}
    for d, ids in docs.items():
        p = n_pages(len(ids), 16)
        assert p >= 2
        bits[d] = (pack_msb(torch.rand(8, p * (p + 1) // 2, generator=gen) < 0.5).numpy().tobytes(),
                   pack_msb(torch.rand(8, p, generator=gen) < 0.5).numpy().tobytes())
    index = write_index(tmp_path / "index", model, fingerprint(tmp_path / "model"), docs, tile=16, bits=bits)
    gpu = SiftEngine(model_on_device(model), tokenizer, SiftIndex.open(tmp_path / "index", device=DEVICE),
                     backend="triton", block=16).generate([r], max_new_tokens=3)
    cpu = SiftEngine(model, tokenizer, index, backend="torch", block=16).generate([r], max_new_tokens=3)
    assert gpu.prefill.backend == "triton"
    assert_within(gpu.prefill.logits, cpu.prefill.logits, model_logit_tol(model.config, cpu.prefill.logits),
                  f"triton vs torch backend, tiles {gpu.prefill.tile_fraction:.2f}")
    assert gpu.prefill.tile_fraction == cpu.prefill.tile_fraction
    assert gpu.token_ids == cpu.token_ids


def test_empty_request_and_context_length_are_refused(tokenizer, tmp_path):
    """A request with no tokens and a prompt (plus the tokens to generate) beyond the model's declared context
    are refused with the project's error before any work."""
    model = _tiny("llama", tmp_path, max_position_embeddings=256)
    engine = SiftEngine(model, tokenizer, None)
    with pytest.raises(SiftError, match="request 0 has no tokens"):
        engine.prefill([Request("", [], "")], mode="dense")
    long_query = " ".join(["word"] * 300)
    with pytest.raises(SiftError, match=r"more than the model's context of 256 \(max_position_embeddings\)"):
        engine.prefill([Request("Hi.", [], long_query)], mode="dense")
    fits = Request("Hi.", [], " ".join(["word"] * 200))
    n = len(engine.prompt_ids(fits))
    assert n + 8 <= 256 < n + 64
    engine.generate([fits], max_new_tokens=8, mode="dense")
    with pytest.raises(SiftError, match="lower max_new_tokens"):
        engine.generate([fits], max_new_tokens=64, mode="dense")
    with pytest.raises(SiftError, match="max_new_tokens"):
        engine.generate([fits], max_new_tokens=0, mode="dense")


def test_concurrent_calls_equal_serial_calls(tokenizer, tmp_path):
    """Serving code calls one engine from many threads: every call returns what it returns alone, and the
    model's own attention implementation is restored afterwards."""
    model = _tiny("llama", tmp_path)
    (a,), (b,) = _tiny_requests()
    index = write_index(tmp_path / "index", model, fingerprint(tmp_path / "model"), doc_ids(tokenizer, [a, b]),
                        tile=16)
    engine = SiftEngine(model, tokenizer, index)
    reqs = [a, b]
    serial = {(i, mode): engine.prefill([reqs[i]], mode=mode).logits for i in range(2) for mode in ("sift", "dense")}
    results = []

    def worker(k: int) -> None:
        for j in range(3):
            i, mode = (k + j) % 2, ("sift", "dense")[(k * 3 + j) % 2]
            results.append(((i, mode), engine.prefill([reqs[i]], mode=mode).logits))

    run_in_threads(worker, 4)
    assert len(results) == 12
    for key, logits in results:
        assert torch.equal(logits, serial[key]), key
    assert model.config._attn_implementation == "sdpa"
