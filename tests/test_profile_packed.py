"""Packed profiling: many documents in one pass (`sift.kernels.packing.PackedDocs`), each document's bits equal to
those of profiling it alone, for the Triton kernels (on tests/helpers.py DEVICE: the GPU, or the interpreter without
one) and the torch reference.

The kernels cut every document into the blocks they would cut it into alone and never read across a document
boundary, so equality is exact (torch.equal), not up to rounding. The attention forward of a pack
(`attention_packed`) is compared with a dense per-sequence softmax written here.
"""
from __future__ import annotations

import math

import pytest
import torch

from sift.errors import SiftError
from sift.format import ca_nbytes, la_nbytes
from sift.kernels import profile as pk
from sift.kernels.packing import PackedDocs
from sift.kernels.profile_ref import profile_layer_ref, profile_packed_ref

from .helpers import DEVICE, on_device

# Mixed lengths: a 1-token document, lengths that are not multiples of the tile or the blocks, whole tiles, and
# one document as long as the rest together (the budget-sized one a pack may hold alone).
LENGTHS = (1, 23, 16, 5, 45)
SMALL = pk.ProfileKernelConfig(16, 16)  # interpreter-sized blocks (tile 16)


def _pack(n_prefix, lengths, hq=4, hkv=2, d=32, dtype=torch.float32, seed=0):
    docs = PackedDocs(n_prefix, lengths, 16)
    g = torch.Generator().manual_seed(seed)
    # Views of [T, H, D], as a transformers forward hands them over; N(0, 1.5^2) makes rows peaked.
    q = (torch.randn(docs.total, hq, d, generator=g) * 1.5).to(dtype).transpose(0, 1)
    k = (torch.randn(docs.total, hkv, d, generator=g) * 1.5).to(dtype).transpose(0, 1)
    v = torch.randn(docs.total, hkv, d, generator=g).to(dtype).transpose(0, 1)
    return docs, q, k, v


ARGS = dict(scale=32 ** -0.5, alpha=0.02, beta=0.05, gamma=0.2)


def test_layout_offsets_follow_the_lengths():
    docs = PackedDocs(2, (1, 40, 16), 16)
    assert docs.starts == (0, 3, 45) and docs.total == 63 and docs.cu_seqlens == (0, 3, 45, 63)
    assert docs.max_seqlen == 42 and docs.pages == (1, 3, 1)
    # LA: ceil(P(P+1)/2 / 8) bytes per head; CA: ceil(P / 8).
    assert docs.la_nbytes == (1, 1, 1) and docs.ca_nbytes == (1, 1, 1)
    long = PackedDocs(0, (300, 7), 16)  # P = 19: 190 bits, 24 bytes
    assert long.la_nbytes == (24, 1) and long.la_offsets == (0, 24) and long.la_total == 25
    assert long.ca_nbytes == (3, 1) and long.ca_offsets == (0, 3) and long.ca_total == 4
    assert docs.seq_rows(1) == slice(3, 45) and docs.doc_rows(1) == slice(5, 45)
    with pytest.raises(ValueError, match="at least one token"):
        PackedDocs(1, (3, 0), 16)
    with pytest.raises(ValueError, match="tile"):
        PackedDocs(1, (3,), 24)


def _kernel_alone(q, k, docs, s, *, dense_heads=()):
    rows = docs.seq_rows(s)
    bits, _ = pk.profile_layer(q[:, rows], k[:, rows], n_prefix=docs.n_prefix, tile=docs.tile,
                               dense_heads=dense_heads, configs=(SMALL, SMALL), **ARGS)
    return bits


@pytest.mark.parametrize("n_prefix", [0, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_pack_equals_each_document_alone(n_prefix, dtype):
    docs, q, k, v = _pack(n_prefix, LENGTHS, dtype=dtype)
    q, k, v = on_device(q, k, v)   # .to keeps the [T, H, D] views' strides
    plan = pk.plan_pack(docs, head_dim=32, dtype=dtype, device=DEVICE, configs=(SMALL, SMALL), fwd_config=SMALL)
    dense = pk.dense_flags((1,), 4, DEVICE)
    la = torch.full((4, docs.la_total), 0xAA, dtype=torch.uint8, device=DEVICE)  # every byte must be written
    ca = torch.full((4, docs.ca_total), 0xAA, dtype=torch.uint8, device=DEVICE)
    pk.profile_packed(q, k, plan, la_out=la, ca_out=ca, dense=dense, **ARGS)
    for s in range(len(docs)):
        alone = _kernel_alone(q, k, docs, s, dense_heads=(1,))
        assert torch.equal(la[:, docs.la_bytes(s)], alone.la), s
        assert torch.equal(ca[:, docs.ca_bytes(s)], alone.ca), s
    assert la[1].eq(0).sum() < la[1].numel()  # the dense head's bits are set

    # With the pack's own forward giving the lse (what the profiler runs where no SDPA backend returns one), the
    # bits are those of the first pass: the same rows, the same keys, the same blocks.
    _, lse2 = pk.attention_packed(q, k, v, plan, scale=ARGS["scale"])
    la2, ca2 = torch.zeros_like(la), torch.zeros_like(ca)
    pk.profile_packed(q, k, plan, la_out=la2, ca_out=ca2, dense=dense, lse2=lse2, **ARGS)
    assert torch.equal(la2, la) and torch.equal(ca2, ca)


def _dense_attention(q, k, v, docs, scale):
    """Per sequence: fp32 softmax of the causal scores over its own keys -> out [T, Hq, D], lse [Hq, T] (natural)."""
    g = q.shape[0] // k.shape[0]
    out = torch.empty(docs.total, q.shape[0], v.shape[-1])
    lse = torch.empty(q.shape[0], docs.total)
    for s in range(len(docs)):
        r = docs.seq_rows(s)
        qs, ks, vs = q[:, r].float(), k[:, r].float().repeat_interleave(g, 0), v[:, r].float().repeat_interleave(g, 0)
        n = qs.shape[1]
        scores = (qs @ ks.transpose(1, 2) * scale).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(),
                                                              float("-inf"))
        out[r] = (torch.softmax(scores, -1) @ vs).transpose(0, 1)
        lse[:, r] = torch.logsumexp(scores, -1)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_forward_of_a_pack_attends_within_each_sequence(dtype):
    docs, q, k, v = _pack(1, LENGTHS, dtype=dtype, seed=3)
    plan = pk.plan_pack(docs, head_dim=32, dtype=dtype, device=DEVICE, configs=(SMALL, SMALL), fwd_config=SMALL)
    out, lse2 = (x.cpu() for x in pk.attention_packed(*on_device(q, k, v), plan, scale=ARGS["scale"]))
    ref_out, ref_lse = _dense_attention(q, k, v, docs, ARGS["scale"])
    assert out.shape == (docs.total, 4, 32) and out.dtype == dtype
    out_err = (out.float() - ref_out).abs().max().item()
    lse_err = (lse2 / math.log2(math.e) - ref_lse).abs().max().item()
    print(f"\n{dtype}: output max abs err {out_err:.3g}, lse max abs err {lse_err:.3g}")
    # The lse is accumulated in fp32 either way: a few ulps of |lse| (< 10 here). The output is rounded once to
    # the dtype, and in fp16 the probabilities are rounded to fp16 before P V (as flash attention does): 2^-10
    # relative on each term, a few of them for |v| ~ 1 over at most 47 keys.
    assert lse_err <= 1e-5
    assert out_err <= (1e-5 if dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize("criterion", ["threshold", "mass"])
def test_reference_pack_equals_each_document_alone(criterion):
    docs, q, k, v = _pack(2, LENGTHS + (64,), hq=6, hkv=3, seed=1)
    la = torch.zeros(6, docs.la_total, dtype=torch.uint8)
    ca = torch.zeros(6, docs.ca_total, dtype=torch.uint8)
    out = profile_packed_ref(q, k, docs, la_out=la, ca_out=ca, v=v, dense_heads=(4,), criterion=criterion,
                             coverage=0.9, **ARGS)
    for s in range(len(docs)):
        rows = docs.seq_rows(s)
        bits, o = profile_layer_ref(q[:, rows], k[:, rows], v=v[:, rows], n_prefix=2, tile=16, dense_heads=(4,),
                                    criterion=criterion, coverage=0.9, **ARGS)
        assert torch.equal(la[:, docs.la_bytes(s)], bits.la) and torch.equal(ca[:, docs.ca_bytes(s)], bits.ca)
        assert torch.equal(out[:, rows], o)
        assert bits.la.shape[1] == la_nbytes(docs.lengths[s], 16) and bits.ca.shape[1] == ca_nbytes(docs.lengths[s], 16)


def test_pack_buffers_are_checked():
    docs, q, k, _ = _pack(1, (3, 4))
    la = torch.zeros(4, docs.la_total, dtype=torch.uint8)
    with pytest.raises(ValueError, match="ca_out must be a uint8"):
        profile_packed_ref(q, k, docs, la_out=la, ca_out=torch.zeros(4, 5, dtype=torch.uint8), **ARGS)
    with pytest.raises(ValueError, match="pack's T="):
        profile_packed_ref(q[:, :5], k[:, :5], docs, la_out=la, ca_out=la, **ARGS)


def test_pack_documents_fills_the_budget_in_order():
    from sift.pipeline.profiler import pack_documents

    # budget 10, prefix 1: each document costs its length + 1 rows
    assert pack_documents([3, 4, 2, 9, 1, 20, 1], 1, 10) == [[0, 1], [2], [3], [4], [5], [6]]
    assert pack_documents([1] * 5, 0, 2) == [[0, 1], [2, 3], [4]]
    assert pack_documents([], 1, 10) == []


def _flipped_bits(a: bytes, b: bytes) -> int:
    import numpy as np

    return int((np.unpackbits(np.frombuffer(a, np.uint8)) != np.unpackbits(np.frombuffer(b, np.uint8))).sum())


@pytest.mark.parametrize("prefix_text", [None, ""])  # the tokenizer's BOS, and no prefix at all
def test_profiler_packs_give_each_document_its_own_bits(prefix_text):
    """Real SmolLM2 weights and text (fp32, CPU, torch backend): a batch packed into forwards of at most 96 rows
    gives every document the bits, the densities and the error of profiling it alone."""
    from .helpers import smollm2

    model, tok = smollm2()
    previous = model.config._attn_implementation  # the model is shared: give it back as it came
    try:
        flips = _packed_against_alone(model, tok, prefix_text)
    finally:
        model.set_attn_implementation(previous)
    # Each document's forward is its own: positions restart, nothing attends across documents. What differs is
    # only the row count of the linear layers' GEMMs, which some CPU BLAS kernels round differently (~1e-7
    # relative); a bit moves only where a statistic lies that close to its threshold, which a few thousand
    # real cells almost never do.
    print(f"\n{flips} bits differ between the packed batch and each document alone")
    assert flips <= 2


def _packed_against_alone(model, tok, prefix_text) -> int:
    from sift.pipeline.config import ProfileConfig
    from sift.pipeline.profiler import Profiler, pack_documents

    from .helpers import wiki_texts

    profiler = Profiler(model, tok, ProfileConfig(tile=16, prefix_text=prefix_text), "torch", batch_tokens=96)
    n_prefix = len(profiler.prefix_ids)
    assert n_prefix == (1 if prefix_text is None else 0)
    ids = [tok(t, add_special_tokens=False).input_ids for t in wiki_texts(4, step=19)]
    docs = [ids[0][:30], [ids[1][0]], [], ids[2][:96 - n_prefix], ids[3][:17], ids[0][:120], ids[1][:33]]
    packs = pack_documents([len(d) for d in docs if d], n_prefix, 96)
    assert len(packs) < len(docs) - 1 and max(len(p) for p in packs) >= 2  # several documents share forwards
    batch = profiler.profile_batch(docs)
    flips = 0
    for d, got in zip(docs, batch):
        if not d:
            assert isinstance(got, SiftError) and "empty" in str(got)
            continue
        alone = profiler.profile(d)
        assert len(got.la) == len(alone.la) and len(got.ca) == len(alone.ca)
        flips += _flipped_bits(got.la, alone.la) + _flipped_bits(got.ca, alone.ca)
        assert got.la_density == pytest.approx(alone.la_density, abs=1e-3)
    return flips



@pytest.mark.parametrize("normalize,sink,dense", [("causal", True, ()), ("key_index", False, (0, 2))])
def test_finish_packed_equals_finish_bits_per_document(normalize, sink, dense):
    """The pack's one finish against `finish_bits` document by document, on statistics placed on and one ulp either
    side of the thresholds (alpha 0.001, gamma 1/4 exactly representable), mixed lengths and tiles of 16."""
    from sift.kernels.profile_ref import finish_bits, finish_packed

    docs = PackedDocs(1, (1, 16, 17, 300, 5), 16)
    hq, alpha, gamma = 3, 0.001, 0.25
    g = torch.Generator().manual_seed(7)
    a32 = torch.tensor(alpha, dtype=torch.float32)
    around = torch.stack([a32, torch.nextafter(a32, torch.tensor(0.0)), torch.nextafter(a32, torch.tensor(1.0))])
    maxima, counts = [], []
    for n, p in zip(docs.lengths, docs.pages):
        tm = torch.rand(hq, p, p, generator=g) * 0.002
        pick = torch.rand(hq, p, p, generator=g) < 0.3
        tm[pick] = around[torch.randint(0, 3, (int(pick.sum()),), generator=g)]
        maxima.append(tm.masked_fill(torch.ones(p, p, dtype=torch.bool).triu(1), 7.0))  # never read
        keys = torch.arange(n)
        denom = (n - keys) if normalize == "causal" else (keys + 1)
        c = (denom.float() * gamma).floor().long() + torch.randint(-1, 2, (hq, n), generator=g)
        counts.append(c.clamp(0).minimum(denom))
    la = torch.full((hq, docs.la_total), 0xAA, dtype=torch.uint8)
    ca = torch.full((hq, docs.ca_total), 0xAA, dtype=torch.uint8)
    finish_packed(torch.cat([m.reshape(hq, -1) for m in maxima], 1), torch.cat(counts, 1), docs, la_out=la,
                  ca_out=ca, alpha=alpha, gamma=gamma, ca_normalize=normalize, force_sink_page=sink, dense_heads=dense)
    for s, (n, tm, c) in enumerate(zip(docs.lengths, maxima, counts)):
        ref = finish_bits(tm, c, n, tile=16, alpha=alpha, gamma=gamma, ca_normalize=normalize,
                          force_sink_page=sink, dense_heads=dense)
        assert torch.equal(la[:, docs.la_bytes(s)], ref.la) and torch.equal(ca[:, docs.ca_bytes(s)], ref.ca), s


def test_warm_up_runs_the_profiling_kernels_on_the_models_layout(monkeypatch):
    """`warm_up` (what a GPU actor runs while its weights load) launches the first pass, the statistics pass and
    the bits kernel of the "triton" backend (here in the interpreter) on q / k / v laid out as the real model's
    forward hands them to the attention function, changes no random state, and does nothing for "torch"."""
    from sift.pipeline import profiler as prof
    from sift.pipeline.config import ProfileConfig

    from .helpers import smollm2

    model, tok = smollm2()
    real = []
    reference = prof.profile_packed_ref

    def record_real(q, k, docs, **kw):
        real.append((q.stride(), k.stride(), kw["v"].stride()))
        return reference(q, k, docs, **kw)

    monkeypatch.setattr(prof, "profile_packed_ref", record_real)
    previous = model.config._attn_implementation
    try:
        prof.Profiler(model, tok, ProfileConfig(tile=16), "torch").profile_batch([list(range(100, 140)), [7] * 9])
    finally:
        model.set_attn_implementation(previous)
    launched = {"attention": [], "stats": 0, "bits": 0}
    for name, key in (("_launch_stats", "stats"), ("_launch_bits", "bits")):
        def counted(*args, _fn=getattr(pk, name), _key=key, **kw):
            launched[_key] += 1
            return _fn(*args, **kw)
        monkeypatch.setattr(pk, name, counted)
    attention = pk.attention_packed

    def record_warm(q, k, v, plan, **kw):
        launched["attention"].append((q.stride(), k.stride(), v.stride(), plan.docs))
        return attention(q, k, v, plan, **kw)

    monkeypatch.setattr(pk, "attention_packed", record_warm)
    rng = torch.get_rng_state()
    prof.warm_up(model.config, tok, ProfileConfig(tile=16), "torch", device="cpu", dtype=torch.float32)
    assert launched == {"attention": [], "stats": 0, "bits": 0}
    prof.warm_up(model.config, tok, ProfileConfig(tile=16), "triton", device="cpu", dtype=torch.float32)
    assert torch.equal(torch.get_rng_state(), rng)
    # A pack of several documents and a pack of one, each through every kernel of the layer.
    assert [len(docs) for *_, docs in launched["attention"]] == [2, 1]
    assert launched["stats"] == launched["bits"] == 2
    n_heads, n_kv = model.config.num_attention_heads, model.config.num_key_value_heads
    d = model.config.hidden_size // n_heads
    # [H, T, D] views of [T, H, D]: the strides do not depend on T, so they equal a real forward's.
    assert real[0] == ((d, n_heads * d, 1), (d, n_kv * d, 1), (d, n_kv * d, 1))
    assert all(tuple(strides) == real[0] for *strides, _ in launched["attention"])


@pytest.mark.parametrize("n_fixed", [0, 1, 5, 16])
@pytest.mark.parametrize("tile", [16, 32, 64, 128])
def test_warm_up_pack_has_the_common_kernel_variants(n_fixed, tile):
    """The warm-up pack's row count, tiles per head and LA / CA bytes per head are not multiples of 16 (nor 1):
    the divisibility a real pack's integer kernel arguments have in 15 cases out of 16, and Triton compiles a
    kernel variant per divisibility."""
    from sift.format import n_pages
    from sift.pipeline.profiler import _warm_lengths

    lengths = _warm_lengths(n_fixed, tile)
    docs = PackedDocs(n_fixed, lengths, tile)
    pages = [n_pages(n, tile) for n in lengths]
    assert len(lengths) == 2 and docs.total == sum(lengths) + 2 * n_fixed
    for value in (docs.total, sum(p * p for p in pages), docs.la_total, docs.ca_total):
        assert value % 16 and value != 1, (lengths, value)


def test_actor_warm_up_failure_is_logged_not_raised(tmp_path, caplog):
    """The actor's warm-up thread: a warm-up that fails (here, no model at the path) logs one line and lets the
    actor continue (a real shard meets the same error and reports it per document)."""
    from sift.pipeline.config import load_config_dict
    from sift.pipeline.job import _WarmUp

    cfg = load_config_dict({"build": {"backend": "triton"}})
    with caplog.at_level("WARNING", logger="sift.build"):
        seconds = _WarmUp(str(tmp_path / "no-model"), cfg, "triton", "cpu").join()
    assert seconds >= 0
    assert any("warm-up failed" in r.getMessage() for r in caplog.records)
