"""The reader criterion (`[profile] criterion = "reader"`, SPEC section 2): the Triton masses and the torch reference
against each other and against a float64 reference written from the definition, the index's bits against the
eval's `reader@C` oracle, the config, the calibrate sweep, and an index built with it serving through SiftEngine.

Bits of a greedy cut on float masses are exact functions of the masses; two computations of the masses that differ
by rounding give the same bits unless a mass sits within that rounding of a decision. The float64 reference
therefore also flags the cells near a decision (`_greedy`), with a tolerance derived from the dtype and the sums'
lengths; bits may differ only there, and on these inputs no cell is that close.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from sift.errors import SiftError
from sift.kernels import profile as pk
from sift.kernels.bits import tril_to_square, unpack_msb
from sift.kernels.packing import PackedDocs
from sift.kernels.profile_ref import profile_packed_ref, reader_masses_ref

from .helpers import DEVICE, SIGMAS, model_rounding, on_device, smollm2, wiki_texts

EPS32 = torch.finfo(torch.float32).eps
KC = pk.ProfileKernelConfig


# ------------------------------------------------------------------------------- the definition, in float64


def _definition_masses(q, k, docs: PackedDocs, scale: float, softcap: float | None = None):
    """Per document, from the full float64 softmax of its own sequence [prefix, document, reader]: tile masses
    [Hq, P, P] (its rows on its tiles, lower triangle) and page masses [Hq, P] (the reader rows on its pages)."""
    hq, hkv, t = q.shape[0], k.shape[0], docs.tile
    out = []
    for s, (n, p) in enumerate(zip(docs.lengths, docs.pages)):
        rows = docs.seq_rows(s)
        qs, ks = q[:, rows].double(), k[:, rows].double().repeat_interleave(hq // hkv, dim=0)
        scores = qs @ ks.transpose(1, 2) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        lp = scores.shape[-1]
        a = torch.softmax(scores.masked_fill(torch.ones(lp, lp, dtype=torch.bool).triu(1), float("-inf")), dim=-1)
        d0, d1 = docs.n_prefix, docs.n_prefix + n
        tiles, pages = torch.zeros(hq, p, p, dtype=torch.float64), torch.zeros(hq, p, dtype=torch.float64)
        for i in range(p):
            for j in range(i + 1):
                tiles[:, i, j] = a[:, d0 + i * t:min(d0 + (i + 1) * t, d1), d0 + j * t:min(d0 + (j + 1) * t, d1)].sum((1, 2))
        for j in range(p):
            pages[:, j] = a[:, d1:, d0 + j * t:min(d0 + (j + 1) * t, d1)].sum((1, 2))
        out.append((tiles, pages))
    return out


def _greedy(tiles, pages, *, n: int, n_reader: int, tile: int, coverage: float, sink: bool, rel: float):
    """The criterion for one (document, head), written from SPEC section 2 with Python loops: candidates (the
    off-diagonal tiles in bit order, column 0 only without the sink, then the pages; a page costs ceil(n_reader /
    tile) block pairs) dropped in increasing mass per block pair, ties in candidate order, while the dropped mass
    stays <= (1 - coverage) (n + n_reader). tiles [P, P], pages [P] float64.
    -> (la [P, P] bool, ca [P] bool, near [P, P] bool, near_ca [P] bool): near flags the cells whose bit a change
    of every mass by `rel` of itself could flip (a candidate whose mass per pair is that close to the other side
    of the cut, or both sides of a cut whose cumulative mass is that close to the budget)."""
    p = pages.shape[0]
    cost_ca = float(-(-n_reader // tile))
    cands = [(("la", i, j), float(tiles[i, j]), 1.0) for i in range(p) for j in range(i) if not (sink and j == 0)]
    cands += [(("ca", j), float(pages[j]), cost_ca) for j in range(p)]
    order = sorted(range(len(cands)), key=lambda c: (cands[c][1] / cands[c][2], c))
    budget = (1.0 - coverage) * (n + n_reader)
    total, dropped = 0.0, 0
    for c in order:
        if total + cands[c][1] > budget:
            break
        total += cands[c][1]
        dropped += 1
    la = torch.ones(p, p, dtype=torch.bool).tril()
    ca = torch.ones(p, dtype=torch.bool)
    near_la, near_ca = torch.zeros(p, p, dtype=torch.bool), torch.zeros(p, dtype=torch.bool)

    def mark(c, grid_la, grid_ca, value=True):
        key = cands[c][0]
        if key[0] == "la":
            grid_la[key[1], key[2]] = value
        else:
            grid_ca[key[1]] = value

    for c in order[:dropped]:
        mark(c, la, ca, False)
    ratio = [m / cost for _, m, cost in cands]
    if dropped < len(order):
        last, nxt = (order[dropped - 1] if dropped else None), order[dropped]
        slack = rel * total + rel * cands[nxt][1]
        if total + cands[nxt][1] - budget <= slack:   # the next candidate could fit the budget
            mark(nxt, near_la, near_ca)
        if last is not None and budget - total <= rel * total:   # the last one dropped could exceed it
            mark(last, near_la, near_ca)
        hi, lo = ratio[nxt], (ratio[last] if last is not None else -1.0)
        for c in order[:dropped]:   # dropped, but as light per pair as the lightest kept, within rounding
            if ratio[c] >= hi * (1 - 2 * rel):
                mark(c, near_la, near_ca)
        for c in order[dropped:]:   # kept, but as light per pair as the heaviest dropped, within rounding
            if ratio[c] <= lo * (1 + 2 * rel):
                mark(c, near_la, near_ca)
    return la, ca, near_la, near_ca


def _bits_of(la_out, ca_out, docs: PackedDocs):
    """Packed layer outputs -> per document (la [Hq, P, P], ca [Hq, P]) bool."""
    out = []
    for s, p in enumerate(docs.pages):
        la = tril_to_square(unpack_msb(la_out[:, docs.la_bytes(s)], p * (p + 1) // 2), p)
        out.append((la, unpack_msb(ca_out[:, docs.ca_bytes(s)], p)))
    return out


def _mass_rel(q, k, docs: PackedDocs, scale: float) -> float:
    """Relative rounding of an fp32 tile or page mass against the float64 definition. A score q.k * scale is a
    D-term dot product whose partial sums reach U = scale * max sum_i |q_i k_i|: it is off by ~eps32 sqrt(D) U,
    and by eps32 U more where it is scaled to log2 units; a probability exp(s - lse) carries the score's error
    twice (its own and, through the lse, its row's) plus the lse's own rounding over the row's keys (sqrt of the
    sequence length); a mass then sums up to the sequence's length squared of them in fp32."""
    hq, hkv, d = q.shape[0], k.shape[0], q.shape[-1]
    q64, k64 = q.double(), k.double().repeat_interleave(hq // hkv, dim=0)
    u = scale * float((q64.abs() @ k64.abs().transpose(1, 2)).max())
    seq = docs.n_prefix + max(docs.lengths) + docs.n_reader
    return SIGMAS * EPS32 * (2 * (math.sqrt(d) + 1) * u + math.sqrt(seq) + seq)


def _check_against_definition(masses, bits, defined, docs, *, coverage, sink, rel, what):
    """Masses within rel of the definition's; bits equal to the definition's greedy except at flagged cells.
    -> the number of flagged cells (printed)."""
    tile_mass, page_mass = masses
    t_off = p_off = near_cells = 0
    for s, ((tiles, pages), (la, ca)) in enumerate(zip(defined, bits)):
        p, n = docs.pages[s], docs.lengths[s]
        got_t = tile_mass[:, t_off:t_off + p * p].double().reshape(-1, p, p).tril()
        got_p = page_mass[:, p_off:p_off + p].double()
        err = max(float(((got_t - tiles).abs() / (tiles + 1e-30)).max()), float(((got_p - pages).abs() / (pages + 1e-30)).max()))
        print(f"{what}: document {s}: max relative mass error {err:.2e} (tolerance {rel:.2e})")
        assert err <= rel
        for h in range(la.shape[0]):
            want_la, want_ca, near_la, near_ca = _greedy(tiles[h], pages[h], n=n, n_reader=docs.n_reader,
                                                         tile=docs.tile, coverage=coverage, sink=sink, rel=rel)
            near_cells += int(near_la.sum() + near_ca.sum())
            assert torch.equal(la[h] & ~near_la, want_la & ~near_la), f"{what}: LA of document {s}, head {h}"
            assert torch.equal(ca[h] & ~near_ca, want_ca & ~near_ca), f"{what}: CA of document {s}, head {h}"
        t_off, p_off = t_off + p * p, p_off + p
    print(f"{what}: {near_cells} cells within rounding of a decision")
    return near_cells


# ------------------------------------------------------------------------ Triton, reference, definition


CASES = {  # lengths not multiples of the tile, GQA, a prefix or none, a reader not a multiple of the tile
    "gqa": dict(lengths=(37, 50, 16), n_prefix=1, n_reader=40, hq=4, hkv=2, sink=True, softcap=None),
    "mha-no-sink": dict(lengths=(23, 61), n_prefix=0, n_reader=33, hq=2, hkv=2, sink=False, softcap=None),
    "softcap": dict(lengths=(45,), n_prefix=2, n_reader=16, hq=2, hkv=1, sink=False, softcap=20.0),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_equals_reference_and_definition(case, dtype):
    c = CASES[case]
    tile, d, coverage = 16, 16, 0.9
    docs = PackedDocs(c["n_prefix"], c["lengths"], tile, c["n_reader"])
    g = torch.Generator().manual_seed(len(case))
    # Sharper than unit scores, so some heads concentrate and the cut has mass to choose from.
    q = (2.0 * torch.randn(c["hq"], docs.total, d, generator=g)).to(dtype)
    k = torch.randn(c["hkv"], docs.total, d, generator=g).to(dtype)
    scale = d ** -0.5
    args = dict(scale=scale, alpha=0.001, beta=0.01, gamma=0.1, softcap=c["softcap"], criterion="reader",
                coverage=coverage, force_sink_page=c["sink"])
    ref_la = torch.zeros(c["hq"], docs.la_total, dtype=torch.uint8)
    ref_ca = torch.zeros(c["hq"], docs.ca_total, dtype=torch.uint8)
    # The reference on the same values upcast (fp16 products are exact in the kernel's fp32 accumulator).
    profile_packed_ref(q.float(), k.float(), docs, la_out=ref_la, ca_out=ref_ca, **args)
    # Query blocks of two tiles against key blocks of one: a block reaches above the diagonal.
    plan = pk.plan_pack(docs, head_dim=d, dtype=dtype, device=DEVICE, configs=(KC(16, 16), KC(32, 16)))
    la, ca = on_device(torch.zeros_like(ref_la), torch.zeros_like(ref_ca))
    pk.profile_packed(*on_device(q, k), plan, la_out=la, ca_out=ca, **args)
    la, ca = la.cpu(), ca.cpu()
    assert torch.equal(la, ref_la) and torch.equal(ca, ref_ca)

    defined = _definition_masses(q, k, docs, scale, c["softcap"])
    rel = _mass_rel(q, k, docs, scale)
    kernel_masses = [m.cpu() for m in pk.reader_masses(*on_device(q, k), plan, scale=scale, softcap=c["softcap"])]
    ref_masses = reader_masses_ref(q.float(), k.float(), docs, scale=scale, softcap=c["softcap"])
    bits = _bits_of(la, ca, docs)
    near = _check_against_definition(kernel_masses, bits, defined, docs, coverage=coverage, sink=c["sink"], rel=rel,
                                     what="triton")
    near += _check_against_definition(ref_masses, bits, defined, docs, coverage=coverage, sink=c["sink"], rel=rel,
                                      what="reference")
    assert near == 0
    dropped = sum(int((~la_d).sum()) - la_d.shape[0] * p * (p - 1) // 2 + int((~ca_d).sum())
                  for (la_d, ca_d), p in zip(bits, docs.pages))
    assert dropped > 0  # the cut chose something


def test_dense_heads_and_coverage_one():
    """A dense head keeps every tile and page on both backends; coverage 1 drops only candidates of zero mass."""
    docs = PackedDocs(1, (40, 20), 16, 24)
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, docs.total, 16, generator=g), torch.randn(2, docs.total, 16, generator=g)
    outs = []
    for backend in ("ref", "triton"):
        la = torch.zeros(2, docs.la_total, dtype=torch.uint8)
        ca = torch.zeros(2, docs.ca_total, dtype=torch.uint8)
        args = dict(la_out=la, ca_out=ca, scale=0.25, alpha=0.5, beta=0.5, gamma=0.5, criterion="reader", coverage=0.5)
        if backend == "ref":
            profile_packed_ref(q, k, docs, dense_heads=(1,), **args)
        else:
            plan = pk.plan_pack(docs, head_dim=16, dtype=q.dtype, device=DEVICE, configs=(KC(16, 16), KC(16, 16)))
            la_d, ca_d = on_device(la, ca)
            pk.profile_packed(*on_device(q, k), plan, dense=pk.dense_flags((1,), 2, DEVICE),
                              **dict(args, la_out=la_d, ca_out=ca_d))
            la.copy_(la_d)
            ca.copy_(ca_d)
        outs.append((la, ca))
        for la_d, ca_d in _bits_of(la, ca, docs):
            p = ca_d.shape[-1]
            assert bool(la_d[1].eq(torch.ones(p, p, dtype=torch.bool).tril()).all()) and bool(ca_d[1].all())
            assert not bool(ca_d[0].all()) or not bool(la_d[0].eq(torch.ones(p, p, dtype=torch.bool).tril()).all())
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))
    la = torch.zeros(2, docs.la_total, dtype=torch.uint8)
    ca = torch.zeros(2, docs.ca_total, dtype=torch.uint8)
    profile_packed_ref(q, k, docs, la_out=la, ca_out=ca, scale=0.25, alpha=0.5, beta=0.5, gamma=0.5,
                       criterion="reader", coverage=1.0)
    assert bool(la.ne(0).any()) and all(bool(ca_d.all()) for _, ca_d in _bits_of(la, ca, docs))


def test_reader_criterion_needs_a_reader():
    q = torch.randn(2, 30, 16)
    la, ca = torch.zeros(2, 6, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="n_reader"):
        profile_packed_ref(q, q, PackedDocs(1, (29,), 16), la_out=la[:, :1], ca_out=ca, scale=0.25, alpha=0.1,
                           beta=0.1, gamma=0.1, criterion="reader")


# ------------------------------------------------------------------------------------------ config


def _config(tmp_path, text: str):
    from sift.pipeline.config import load_config

    path = tmp_path / "c.toml"
    path.write_text('model = "smollm2-135m-instruct"\n[profile]\n' + text)
    return load_config(path)


def test_config_validation_and_profile_key(tmp_path):
    import dataclasses
    import hashlib
    import json

    for text, words in [("criterion = \"reader\"\ncoverage = 1.5\n", ("profile.coverage", "(0, 1]", "0.997")),
                        ("criterion = \"reader\"\ncoverage = 0\n", ("profile.coverage",)),
                        ("criterion = \"readers\"\n", ("profile.criterion", "threshold, reader")),
                        ("criterion = \"reader\"\nla_criterion = \"mass\"\n", ("remove la_criterion",)),
                        ("criterion = \"reader\"\nreader = \"  \"\n", ("profile.reader", "shipped reader"))]:
        with pytest.raises(SiftError) as e:
            _config(tmp_path, text)
        message = str(e.value)
        assert "\n" not in message and all(w in message for w in words), message
    # A threshold config's key is the one it had before the reader criterion's keys existed.
    cfg = _config(tmp_path, "tile = 16\n")
    old = {k: v for k, v in dataclasses.asdict(cfg.profile).items()
           if k not in ("criterion", "coverage", "reader", "la_criterion", "la_coverage", "ca_full_layers",
                        "ca_full_heads")}
    payload = {"profile": json.loads(json.dumps(old)), "model": "fp", "format_version": 3}
    assert cfg.profile_key("fp", 3) == hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    assert cfg.profile_key("fp", 3) == _config(tmp_path, "tile = 16\ncoverage = 0.5\n").profile_key("fp", 3)
    # A reader config's key follows its coverage and reader tokens, not the thresholds it does not read.
    reader = _config(tmp_path, "tile = 16\ncriterion = \"reader\"\n")
    key = reader.profile_key("fp", 3, (1, 2, 3))
    assert key != cfg.profile_key("fp", 3)
    assert key == _config(tmp_path, "tile = 16\ncriterion = \"reader\"\nalpha = 0.5\n").profile_key("fp", 3, (1, 2, 3))
    assert key != reader.profile_key("fp", 3, (1, 2, 4))
    assert key != _config(tmp_path, "tile = 16\ncriterion = \"reader\"\ncoverage = 0.99\n").profile_key("fp", 3, (1, 2, 3))


def test_calibrate_settings_and_sweep(tmp_path):
    """`sift-calibrate --setting "criterion=reader,coverage=C"`: the setting, its TOML as the builder reads it,
    and a sweep over two coverages on a tiny set, each index built by the profiler from the setting's TOML (with
    a short reader, to keep the test small): the lower coverage computes fewer tiles."""
    from sift.model import DEFAULT_MODEL, fingerprint, resolve_model_dir
    from sift.pipeline.config import load_config
    from sift.pipeline.profiler import Profiler
    from sift.quality.calibrate import Setting, calibrate_items, parse_setting
    from sift.quality.qa import QAItem

    from .test_engine import write_index
    from .test_eval import DOCS, QUESTIONS

    s = parse_setting("tile=16,criterion=reader,coverage=0.99")
    assert (s.criterion, s.coverage, s.la_criterion) == ("reader", 0.99, "threshold") and s.label == "t16-reader0.99"
    for bad in ("criterion=reader,coverage=2", "criterion=readers"):
        with pytest.raises(SiftError):
            parse_setting(bad)
    (tmp_path / "s.toml").write_text(s.toml(DEFAULT_MODEL))
    profile = load_config(tmp_path / "s.toml").profile
    assert (profile.criterion, profile.coverage, profile.tile) == ("reader", 0.99, 16)

    model, tokenizer = smollm2()
    fp = fingerprint(resolve_model_dir(DEFAULT_MODEL))
    built = []

    def build(setting, corpus, index, model_name):
        import dataclasses

        index.parent.mkdir(parents=True, exist_ok=True)
        (index.parent / f"{index.name}.toml").write_text(setting.toml(model_name))
        cfg = load_config(index.parent / f"{index.name}.toml").profile
        cfg = dataclasses.replace(cfg, reader="\n\nThe passages above were read with care; this text follows them.")
        rows = [json.loads(line) for line in (corpus / "docs.jsonl").read_text().splitlines()]
        ids = {r["id"]: tokenizer(r["text"], add_special_tokens=False).input_ids for r in rows}
        profiler = Profiler(model, tokenizer, cfg, "torch")
        bits = {d: (b.la, b.ca) for d, b in zip(ids, profiler.profile_batch(list(ids.values())))}
        model.set_attn_implementation("sdpa")
        write_index(index, model, fp, ids, tile=16, bits=bits, prefix_ids=profiler.prefix_ids)
        built.append(setting.label)

    items = [QAItem(q["id"], q["question"], (q["answers"][0],), tuple((d, DOCS[d]) for d in q["docs"]))
             for q in QUESTIONS if len(q["docs"]) > 1][:1]
    settings = [parse_setting("tile=16,criterion=reader,coverage=0.5"), Setting(tile=16, criterion="reader",
                                                                                coverage=1.0)]
    result = calibrate_items(items, tmp_path / "cal", name="toy.jsonl", settings=settings, held_in=len(items),
                             target=None, model=DEFAULT_MODEL, device="cpu", max_new_tokens=1, floor=False,
                             build=build)
    assert built == ["t16-reader0.5", "t16-reader1"]
    low, full = result["points"]
    assert low["setting"]["criterion"] == "reader" and low["tile_fraction"] < full["tile_fraction"]


# ------------------------------------------------------------------- the builder against the eval's oracle


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_index_bits_equal_the_oracle_reader_bits_and_serve(tmp_path, ray_session):
    """`sift-build` with criterion = "reader" (fp32 SmolLM2, torch backend) stores, for every document, the bits
    `sift-eval --modes reader@C` chooses with the same reader (quality/oracle.py `reader_bits`, its own exact
    forward), except where an oracle mass sits within the two forwards' rounding of a decision (none here); the
    manifest records the reader; the engine serves the index. The reader is a configured one of ~150 tokens (the
    shipped one has 1024: the same code path at seven times the cost); the shipped one is the oracle's default."""
    from sift.format import IndexReader
    from sift.pipeline.config import ProfileConfig, load_config
    from sift.pipeline.job import run_build
    from sift.pipeline.profiler import profiling_reader_ids
    from sift.quality.oracle import ReaderCache, reader_bits
    from sift.reader import reader_digest, reader_ids
    from sift.runtime import Request, SiftEngine
    from sift.runtime.store import SiftIndex

    coverage = 0.99
    texts = {f"d{i}.txt": t[:200] for i, t in enumerate(wiki_texts(2, step=17))}
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, text in texts.items():
        (corpus / name).write_text(text)
    reader_text = ("\n\n" + "\n\n".join(wiki_texts(3, step=29)[1:]))[:700]  # other leads than the documents
    (tmp_path / "c.toml").write_text(
        'model = "smollm2-135m-instruct"\n[profile]\ntile = 16\ncriterion = "reader"\n'
        f'coverage = {coverage}\nforce_sink_page = false\nreader = {json.dumps(reader_text)}\n'
        '[build]\nbackend = "torch"\n')
    run_build(corpus, tmp_path / "index", load_config(tmp_path / "c.toml"), echo=lambda *_: None)

    model, tokenizer = smollm2()
    assert reader_ids(tokenizer) == profiling_reader_ids(tokenizer, ProfileConfig(criterion="reader"))
    assert len(reader_ids(tokenizer)) == 1024
    reader = reader_ids(tokenizer, reader_text)
    manifest = IndexReader.open(tmp_path / "index").manifest
    assert manifest.profile["criterion"] == "reader" and manifest.profile["reader_tokens"] == len(reader) > 100
    assert manifest.profile["reader_sha256"] == reader_digest(reader)
    rows = {r["doc_id"]: r for r in IndexReader.open(tmp_path / "index").table().to_pylist()}

    engine = SiftEngine(model, tokenizer, SiftIndex.open(tmp_path / "index", device="cpu"), block=16,
                        backend="torch")
    request = Request(prefix="Read the passages.\n", docs=list(texts.items()), query="\nWhich is older?")
    cache = ReaderCache(reader=reader)
    oracle = reader_bits(engine, [request], coverage, cache).bits
    cfg = model.config
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    # The two forwards (the builder's profiling attention, the oracle's exact attention) round differently
    # through the model's layers: model_rounding of each mass.
    rel = model_rounding(cfg)
    near = differ = 0
    for d, (doc_id, ids) in enumerate(zip(texts, [i for kind, i in engine.tokenize(request) if kind == "doc"])):
        p = -(-len(ids) // 16)
        la_nb, ca_nb = int(oracle.la_head_nbytes[d]), int(oracle.ca_head_nbytes[d])
        la0, ca0 = int(oracle.la_base[d]), int(oracle.ca_base[d])
        want_la = oracle.la_bytes[la0:la0 + layers * heads * la_nb].numpy().tobytes()
        want_ca = oracle.ca_bytes[ca0:ca0 + layers * heads * ca_nb].numpy().tobytes()
        got_la = tril_to_square(unpack_msb(torch.frombuffer(bytearray(rows[doc_id]["la_bits"]), dtype=torch.uint8)
                                           .view(layers, heads, la_nb), p * (p + 1) // 2), p)
        got_ca = unpack_msb(torch.frombuffer(bytearray(rows[doc_id]["ca_bits"]), dtype=torch.uint8)
                            .view(layers, heads, ca_nb), p)
        mass = cache.masses[tuple(ids)]
        for layer in range(layers):
            for h in range(heads):
                _, _, near_la, near_ca = _greedy(mass.own[0][layer, h].cpu(), mass.read[0][layer, h].cpu(), n=len(ids),
                                                 n_reader=len(reader), tile=16, coverage=coverage, sink=False, rel=rel)
                near += int(near_la.sum() + near_ca.sum())
        differ += int(rows[doc_id]["la_bits"] != want_la) + int(rows[doc_id]["ca_bits"] != want_ca)
        assert bool(got_la.diagonal(dim1=-2, dim2=-1).all()) and 0 < int((~got_ca).sum()) < got_ca.numel()
    print(f"index against oracle: {differ} differing bit vectors, {near} cells within rounding of a decision")
    assert near == 0 and differ == 0

    sparse = engine.generate([request], 2, mode="sift")
    assert 0 < sparse.prefill.tile_fraction < 1 and len(sparse.token_ids[0]) == 2
