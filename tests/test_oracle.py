"""The in-context oracle (quality/oracle.py): its attention masses against the real SmolLM2's full eager attention
matrices summed by hand with numpy, its choice against a hand-worked toy, and the engine running exactly the
pattern chosen (the blocks computed counted independently of the bit decoder)."""
import numpy as np
import pytest
import torch

from sift.errors import SiftError
from sift.kernels.bits import tril_to_square, unpack_msb
from sift.runtime import Request, SiftEngine
from sift.runtime.supplied_bits import generate_with_bits
from sift.reader import reader_ids
from sift.quality.oracle import (PromptMass, ReaderCache, batch_bits, batch_masses, parse_mode, prompt_mass, reader_bits,
                                 reader_mass, select)

from .helpers import model_rounding, smollm2, wiki_texts

TILE = 16


def _segments(tokenizer, n_docs=3, chars=160):
    prefix = tokenizer("Read the passages.\n", add_special_tokens=True).input_ids
    docs = [tokenizer(t[:chars], add_special_tokens=False).input_ids for t in wiki_texts(n_docs)]
    query = tokenizer("\nQuestion: which one is oldest?", add_special_tokens=False).input_ids
    return [("prefix", prefix)] + [("doc", d) for d in docs] + [("query", query)]


def test_prompt_mass_equals_eager_attention_sums():
    model, tokenizer = smollm2("eager")
    segments = _segments(tokenizer)
    got = prompt_mass(model, segments, TILE)
    ids = torch.tensor([[t for _, seg in segments for t in seg]])
    with torch.inference_mode():
        model.set_attn_implementation("eager")
        attentions = model(input_ids=ids, output_attentions=True).attentions
    bounds, pos = [], 0
    for kind, seg in segments:
        if kind == "doc":
            bounds.append((pos, pos + len(seg)))
        pos += len(seg)
    assert got.rows == sum(e - s for s, e in bounds)
    for layer in (0, 13, model.config.num_hidden_layers - 1):
        a = attentions[layer][0].double().numpy()                       # [H, N, N]
        # The oracle's exact attention and transformers' eager one round differently from the first layer on.
        rtol = model_rounding(model.config, depth=layer + 1)
        for m, (s, e) in enumerate(bounds):
            p = -(-(e - s) // TILE)
            own = np.zeros((a.shape[0], p, p))
            for q in range(s, e):
                for k in range(s, q + 1):
                    own[:, (q - s) // TILE, (k - s) // TILE] += a[:, q, k]
            np.testing.assert_allclose(got.own[m][layer].numpy(), own, rtol=rtol, atol=1e-9)
            read = np.zeros((a.shape[0], p))
            later_rows = [q for s2, e2 in bounds[m + 1:] for q in range(s2, e2)]
            for k in range(s, e):
                read[:, (k - s) // TILE] += a[:, later_rows, k].sum(axis=1)
            np.testing.assert_allclose(got.read[m][layer].numpy(), read, rtol=rtol, atol=1e-9)
        assert got.read[-1][layer].sum() == 0  # nothing reads the last document's pages


def test_select_hand_worked_toy():
    """Two documents of two tiles, one layer, one head, 8 document rows. Candidates (mass / block pairs):
    doc 0 LA (1, 0): 0.5 / 1; doc 1 LA (1, 0): 0.2 / 1; doc 0 CA page 0: 0.3 / 2 = 0.15, page 1: 0.05 / 2 = 0.025.
    Increasing mass per block pair: page 1 (0.05), page 0 (cumulative 0.35), doc 1 LA (0.55), doc 0 LA (1.05)."""
    own0 = torch.tensor([[[[2.0, 0.0], [0.5, 1.0]]]], dtype=torch.float64)
    own1 = torch.tensor([[[[2.0, 0.0], [0.2, 1.0]]]], dtype=torch.float64)
    read0 = torch.tensor([[[0.3, 0.05]]], dtype=torch.float64)
    read1 = torch.zeros(1, 1, 2, dtype=torch.float64)
    mass = PromptMass(own=[own0, own1], read=[read0, read1], rows=8, tile=16)

    def kept(coverage):
        m0, m1 = select(mass, coverage)
        return (m0.la[0, 0].tolist(), m0.ca[0, 0].tolist(), m1.la[0, 0].tolist(), m1.ca[0, 0].tolist())

    full = ([[True, False], [True, True]], [True, True], [[True, False], [True, True]], [True, True])
    assert kept(1.0) == full
    assert kept(1 - 0.04 / 8) == full                                         # budget 0.04 < 0.05
    assert kept(1 - 0.06 / 8) == (full[0], [True, False], full[2], full[3])   # page 1 dropped
    assert kept(1 - 0.5 / 8) == (full[0], [False, False], full[2], full[3])   # both pages (0.35); LA next at 0.55
    assert kept(1 - 0.6 / 8) == (full[0], [False, False], [[True, False], [False, True]], full[3])
    assert kept(0.5) == ([[True, False], [False, True]], [False, False], [[True, False], [False, True]], full[3])


def test_parse_mode():
    assert parse_mode("oracle@0.99") == ("oracle", 0.99) and parse_mode("oracle@1") == ("oracle", 1.0)
    assert parse_mode("reader@0.995") == ("reader", 0.995)
    assert parse_mode("sift") is None and parse_mode("hybrid:first@0.3") is None
    for bad in ("oracle", "oracle@0", "oracle@1.5", "oracle@x"):
        with pytest.raises(SiftError, match="oracle@C"):
            parse_mode(bad)
    with pytest.raises(SiftError, match="reader@C"):
        parse_mode("reader@2")


def _dense_pairs(nb):
    return nb * (nb + 1) // 2


def test_engine_computes_the_oracle_pattern():
    """At block = tile the engine computes one block pair per kept tile: the tile fraction it reports equals the
    dense causal count minus the dropped LA tiles and the dropped CA pages times the later documents' query
    blocks (counted here from the masks), and at coverage 1 the oracle is dense and answers like it."""
    model, tokenizer = smollm2()
    engine = SiftEngine(model, tokenizer, None, block=TILE, backend="torch")
    docs = [(f"d{i}", t[:300]) for i, t in enumerate(wiki_texts(3))]
    request = Request(prefix="Read the passages.\n", docs=docs, query="\nQuestion: which one is oldest?")
    segments = engine.tokenize(request)
    masses = batch_masses(engine, [request])
    dense = engine.generate([request], 6, mode="dense")
    full = generate_with_bits(engine, [request], 6, batch_bits(engine, [request], 1.0, masses))
    assert full.prefill.tile_fraction == 1.0 and full.token_ids == dense.token_ids

    coverage = 0.97
    masks = select(masses[0], coverage)
    sparse = generate_with_bits(engine, [request], 6, batch_bits(engine, [request], coverage, masses))
    blocks = [-(-len(ids) // TILE) for _, ids in segments]
    doc_blocks = [b for (kind, _), b in zip(segments, blocks) if kind == "doc"]
    n_layers, n_heads = masks[0].ca.shape[:2]
    dense_pairs = _dense_pairs(sum(blocks)) * n_layers * n_heads
    dropped = 0
    for m, mk in enumerate(masks):
        p = doc_blocks[m]
        dropped += int((~mk.la).sum()) - n_layers * n_heads * p * (p - 1) // 2   # upper triangles are False
        dropped += int((~mk.ca).sum()) * sum(doc_blocks[m + 1:])
    assert dropped > 0
    assert sparse.prefill.tile_fraction == pytest.approx(1 - dropped / dense_pairs, abs=1e-12)
    # the budget holds: per (layer, head) the dropped mass is at most 1 - coverage of the document rows'
    mass = masses[0]
    lost = sum(((~mk.la).double().to(own.device) * own.tril()).sum(dim=(-1, -2)) for mk, own in zip(masks, mass.own))
    lost = lost + sum(((~mk.ca).double().to(r.device) * r).sum(-1) for mk, r in zip(masks, mass.read))
    assert float(lost.max()) <= (1 - coverage) * mass.rows + 1e-9
    assert float(lost.max()) > 0.5 * (1 - coverage) * mass.rows  # and is used, not left idle


def test_supplied_bits_are_checked():
    model, tokenizer = smollm2()
    engine = SiftEngine(model, tokenizer, None, block=TILE, backend="torch")
    docs = [(f"d{i}", t[:120]) for i, t in enumerate(wiki_texts(2))]
    request = Request(prefix="Read.\n", docs=docs, query="\nWhich?")
    bits = batch_bits(engine, [request], 0.99)
    with pytest.raises(SiftError, match="2 documents, the batch has 4"):
        generate_with_bits(engine, [request, request], 2, bits)


def test_reader_bits_depend_on_the_document_only():
    """The reader criterion's bits of a document (quality/oracle.py `reader_bits`) are the oracle's choice on the
    prompt [profiling prefix, document, fixed reader], whatever request, place or neighbours the document has:
    what a builder could store. They keep the diagonal and drop some pages the reader reads little."""
    model, tokenizer = smollm2()
    engine = SiftEngine(model, tokenizer, None, block=TILE, backend="torch")
    texts = [t[:300] for t in wiki_texts(3)]
    reader = reader_ids(tokenizer, n_tokens=96)
    assert len(reader) == 96
    first = Request(prefix="Read.\n", docs=[("a", texts[0]), ("b", texts[1])], query="\nWhich?")
    second = Request(prefix="Other words.\n", docs=[("c", texts[2]), ("b", texts[1])], query="\nWhat?")
    cache = ReaderCache(reader=reader)
    bits = reader_bits(engine, [first, second], 0.98, cache)
    assert len(cache.masses) == 3                                  # b is profiled once
    b_ids = [ids for kind, ids in engine.tokenize(first) if kind == "doc"][1]
    expected = select(reader_mass(engine, b_ids, reader), 0.98)[0]
    n = len(b_ids)
    p = -(-n // TILE)
    la_nb, ca_nb = int(bits.bits.la_head_nbytes[1]), int(bits.bits.ca_head_nbytes[1])
    for d in (1, 3):                                               # b in the first and in the second request
        la0, ca0 = int(bits.bits.la_base[d]), int(bits.bits.ca_base[d])
        la = bits.bits.la_bytes[la0:la0 + la_nb * expected.ca.shape[0] * expected.ca.shape[1]]
        ca = bits.bits.ca_bytes[ca0:ca0 + ca_nb * expected.ca.shape[0] * expected.ca.shape[1]]
        la = tril_to_square(unpack_msb(la.view(*expected.ca.shape[:2], la_nb), p * (p + 1) // 2), p)
        ca = unpack_msb(ca.view(*expected.ca.shape[:2], ca_nb), p)
        assert torch.equal(la, expected.la) and torch.equal(ca, expected.ca)
    assert bool(expected.la.diagonal(dim1=-2, dim2=-1).all())
    assert 0 < int((~expected.ca).sum()) < expected.ca.numel()
