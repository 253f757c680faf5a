"""SiftIndex (runtime/store.py) on CPU: tiny real indexes written with the pipeline's own shard and manifest
writers (no Ray, no model), random bits of the SPEC sizes, lengths that are not multiples of the tile."""
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest
import torch

from sift.errors import SiftError
from sift.format import ca_nbytes, la_nbytes, n_pages
from sift.kernels.bits import pack_msb
from sift.kernels.block_indices import DocBits
from sift import format as fmt
from sift.pipeline import index as idx
from sift.model import fingerprint
from sift.format import content_hash
from sift.runtime.store import DocEntry, SiftIndex

from .helpers import run_in_threads

TILE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 16, 3, 4, 2, 8
FP = "ab" * 32
LENGTHS = {"a": 37, "b": 100, "c": 16, "d": 1, "e": 250, "f": 63}


def _random_bits(n_tokens: int, gen: torch.Generator) -> tuple[bytes, bytes]:
    """One document's la_bits / ca_bits: LAYERS x HEADS random vectors, trailing bits 0."""
    p = n_pages(n_tokens, TILE)
    la = pack_msb(torch.rand(LAYERS * HEADS, p * (p + 1) // 2, generator=gen) < 0.5)
    ca = pack_msb(torch.rand(LAYERS * HEADS, p, generator=gen) < 0.5)
    return la.numpy().tobytes(), ca.numpy().tobytes()


def make_index(root: Path, lengths: dict[str, int] = LENGTHS, *, shards: int = 2, fp: str = FP,
               seed: int = 0, profile: dict | None = None) -> dict[str, dict]:
    """Write a committed index of `lengths` (doc_id -> n_tokens) over `shards` shards, its manifest's profile
    updated with `profile`; -> the rows written."""
    gen = torch.Generator().manual_seed(seed)
    rows = {}
    for doc_id, n in lengths.items():
        la, ca = _random_bits(n, gen)
        rows[doc_id] = dict(doc_id=doc_id, content_hash=content_hash(list(range(n))), n_tokens=n, la_bits=la,
                            ca_bits=ca, source=f"{doc_id}.txt", la_density=[0.5] * LAYERS, ca_density=[0.5] * LAYERS)
    idx.prepare_dir(root)
    ids = list(rows)
    infos = []
    for s in range(shards):
        part = [rows[d] for d in ids[s::shards]]
        table = pa.Table.from_pylist(part, schema=fmt.DOCS_SCHEMA)
        infos.append(idx.write_table(root, table, kind="part", profile_key="k", backend="torch"))
    manifest = {
        "format": fmt.FORMAT, "format_version": fmt.FORMAT_VERSION, "generation": 1, "created_at": idx.now_iso(),
        "model": {"name": "stub-model", "fingerprint": fp, "model_type": "llama", "n_layers": LAYERS,
                  "n_heads": HEADS, "n_kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                  "rope": {"rope_type": "default", "rope_theta": 10000.0}, "max_position_embeddings": 2048},
        "profile": {"tile": TILE, "alpha": 0.001, "beta": 0.01, "gamma": 0.1, "ca_normalize": "causal",
                    "force_sink_page": True, "dense_heads": [], "prefix_text": None, "dtype": "float32",
                    "prefix_token_ids": [1], "profile_key": "k", **(profile or {})},
        "shards": [i.to_dict() for i in infos], "errors": None, "documents": len(rows),
    }
    idx.commit_manifest(root, fmt.Manifest.from_dict(manifest))
    return rows


@pytest.fixture
def built(tmp_path):
    root = tmp_path / "index"
    return root, make_index(root)


def doc_size(n: int) -> int:
    return LAYERS * HEADS * (la_nbytes(n, TILE) + ca_nbytes(n, TILE))


def check_bits(bits, docs, rows, skip=()):
    """Every (doc, layer, head) vector that `layer_ptrs` points at equals the slice of the blob written
    (documents at positions in `skip` are not in `rows`)."""
    assert bits.la_base.shape == bits.ca_base.shape == (len(docs),)
    assert torch.equal(bits.la_head_nbytes, torch.tensor([la_nbytes(n, TILE) for _, n in docs]))
    assert torch.equal(bits.ca_head_nbytes, torch.tensor([ca_nbytes(n, TILE) for _, n in docs]))
    for layer in range(LAYERS):
        la_ptr, ca_ptr = bits.layer_ptrs(layer)
        assert la_ptr.shape == ca_ptr.shape == (len(docs), HEADS)
        for i, (doc_id, n) in enumerate(docs):
            if i in skip:
                continue
            la_blob = torch.frombuffer(bytearray(rows[doc_id]["la_bits"]), dtype=torch.uint8)
            ca_blob = torch.frombuffer(bytearray(rows[doc_id]["ca_bits"]), dtype=torch.uint8)
            lnb, cnb = la_nbytes(n, TILE), ca_nbytes(n, TILE)
            for h in range(HEADS):
                v = layer * HEADS + h
                lp, cp = int(la_ptr[i, h]), int(ca_ptr[i, h])
                assert torch.equal(bits.la_bytes[lp : lp + lnb], la_blob[v * lnb : (v + 1) * lnb]), (doc_id, layer, h)
                assert torch.equal(bits.ca_bytes[cp : cp + cnb], ca_blob[v * cnb : (v + 1) * cnb]), (doc_id, layer, h)


def test_open_and_round_trip(built):
    root, rows = built
    index = SiftIndex.open(root, device="cpu")
    assert len(index) == len(rows) and all(d in index for d in rows) and "zzz" not in index
    assert (index.generation, index.tile, index.n_layers, index.n_heads) == (1, TILE, LAYERS, HEADS)
    assert (index.n_kv_heads, index.head_dim, index.fingerprint) == (KV_HEADS, HEAD_DIM, FP)
    assert list(index.prefix_token_ids) == [1] and index.rope["rope_type"] == "default"
    for doc_id, row in rows.items():
        e = index.entry(doc_id)
        assert isinstance(e, DocEntry)
        assert (e.doc_id, e.n_tokens, e.content_hash) == (doc_id, row["n_tokens"], row["content_hash"])
        assert e.la.dtype == e.ca.dtype == torch.uint8
        assert torch.equal(e.la, torch.frombuffer(bytearray(row["la_bits"]), dtype=torch.uint8))
        assert torch.equal(e.ca, torch.frombuffer(bytearray(row["ca_bits"]), dtype=torch.uint8))
    with pytest.raises(SiftError, match="'zzz'"):
        index.entry("zzz")
    assert index.stats()["documents"] == len(rows)


def test_fetch_order_duplicates_and_offsets(built):
    root, rows = built
    index = SiftIndex.open(root, device="cpu")
    docs = [("e", 250), ("a", 37), ("e", 250), ("d", 1), ("c", 16), ("a", 37)]
    bits = index.fetch(docs)
    assert (bits.n_layers, bits.n_heads) == (LAYERS, HEADS)
    check_bits(bits, docs, rows)
    # Documents are laid out back to back in the order given.
    la_sizes = [LAYERS * HEADS * la_nbytes(n, TILE) for _, n in docs]
    assert bits.la_base.tolist() == [sum(la_sizes[:i]) for i in range(len(docs))]
    assert bits.la_bytes.numel() == sum(la_sizes)
    s = index.stats()
    assert (s["misses"], s["hits"]) == (4, 0)  # a repeated document is looked up once per batch


def test_fetch_empty_batch(built):
    root, _ = built
    bits = SiftIndex.open(root, device="cpu").fetch([])
    assert bits.la_base.shape == (0,) and bits.la_bytes.numel() >= 1  # a valid pointer for the kernels


def test_counters_hits_misses_bytes(built):
    root, rows = built
    index = SiftIndex.open(root, device="cpu")
    index.fetch([("a", 37), ("b", 100)])
    s = index.stats()
    assert (s["hits"], s["misses"], s["bytes_h2d"]) == (0, 2, doc_size(37) + doc_size(100))
    assert s["resident_bytes"] == doc_size(37) + doc_size(100) and s["budget_bytes"] == 256 << 20
    index.fetch([("b", 100), ("c", 16), ("a", 37)])
    s = index.stats()
    assert (s["hits"], s["misses"]) == (2, 3)
    assert s["bytes_h2d"] == doc_size(37) + doc_size(100) + doc_size(16)
    assert s["evictions"] == 0 and s["resident_documents"] == 3


def test_lru_eviction_order(tmp_path):
    lengths = {k: 40 for k in "ABCD"}  # equal sizes
    rows = make_index(tmp_path / "i", lengths)
    size = doc_size(40)
    index = SiftIndex.open(tmp_path / "i", device="cpu", hbm_budget_bytes=2 * size + size // 2)

    def misses_after(doc):
        before = index.stats()["misses"]
        check_bits(index.fetch([(doc, 40)]), [(doc, 40)], rows)
        return index.stats()["misses"] - before

    assert [misses_after(d) for d in "ABC"] == [1, 1, 1]
    assert index.stats()["evictions"] == 1
    assert misses_after("B") == 0  # B is resident and now most recent; C is the LRU
    assert misses_after("D") == 1  # evicts C
    assert index.stats()["evictions"] == 2
    assert misses_after("B") == 0 and misses_after("D") == 0
    assert misses_after("A") == 1  # evicts B, the least recently used of (B, D)
    assert misses_after("D") == 0 and misses_after("B") == 1


def test_budget_never_exceeded(built):
    root, rows = built
    budget = doc_size(250) + doc_size(100) // 2
    index = SiftIndex.open(root, device="cpu", hbm_budget_bytes=budget)
    rng = random.Random(0)
    ids = list(rows)
    for _ in range(60):
        docs = [(d, rows[d]["n_tokens"]) for d in rng.choices(ids, k=rng.randint(1, 5))]
        check_bits(index.fetch(docs), docs, rows)
        s = index.stats()
        assert 0 <= s["resident_bytes"] <= budget
        assert s["resident_bytes"] == sum(c[2] for c in index._cache.values())
    assert index.stats()["evictions"] > 0 and index.stats()["hits"] > 0


def test_fetch_from_many_threads(built):
    """Serving code fetches from many threads: every batch gets its own documents' bits, the budget holds, and
    the counters add up to the lookups made."""
    root, rows = built
    budget = doc_size(250) + doc_size(100) // 2
    index = SiftIndex.open(root, device="cpu", hbm_budget_bytes=budget)
    ids, lookups = list(rows), []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(25):
            docs = [(d, rows[d]["n_tokens"]) for d in rng.choices(ids, k=rng.randint(1, 4))]
            check_bits(index.fetch(docs), docs, rows)
            lookups.append(len({d for d, _ in docs}))
            assert index.stats()["resident_bytes"] <= budget

    run_in_threads(worker, 6)
    s = index.stats()
    assert s["hits"] + s["misses"] == sum(lookups) and s["evictions"] > 0 and s["resident_bytes"] <= budget


def test_batch_larger_than_budget_serves_overflow_uncached(tmp_path):
    lengths = {k: 40 for k in "ABC"}
    rows = make_index(tmp_path / "i", lengths)
    size = doc_size(40)
    index = SiftIndex.open(tmp_path / "i", device="cpu", hbm_budget_bytes=2 * size)
    docs = [("A", 40), ("B", 40), ("C", 40)]
    check_bits(index.fetch(docs), docs, rows)
    s = index.stats()
    assert (s["misses"], s["evictions"], s["resident_bytes"], s["resident_documents"]) == (3, 0, 2 * size, 2)
    index.fetch([("A", 40), ("B", 40)])  # the two cached ones
    assert index.stats()["hits"] == 2


def test_document_larger_than_budget_is_uncached(built):
    root, rows = built
    index = SiftIndex.open(root, device="cpu", hbm_budget_bytes=doc_size(250) - 1)
    for _ in range(2):
        check_bits(index.fetch([("e", 250)]), [("e", 250)], rows)
    s = index.stats()
    assert (s["misses"], s["hits"], s["resident_bytes"], s["evictions"]) == (2, 0, 0, 0)
    assert s["bytes_h2d"] == 2 * doc_size(250)
    index0 = SiftIndex.open(root, device="cpu", hbm_budget_bytes=0)
    check_bits(index0.fetch([("a", 37), ("a", 37)]), [("a", 37), ("a", 37)], rows)
    assert index0.stats()["resident_bytes"] == 0


def test_unknown_documents(built):
    root, rows = built
    index = SiftIndex.open(root, device="cpu")
    with pytest.raises(SiftError, match=r"3 document\(s\) not in index.*'x1'.*'x2'.*'x3'.*on_unknown='dense'"):
        index.fetch([("a", 37), ("x1", 5), ("x2", 5), ("x1", 5), ("x3", 9)])
    many = [(f"u{i}", 3) for i in range(9)]
    with pytest.raises(SiftError, match=r"9 document\(s\).*'u4' and 4 more"):
        index.fetch(many)
    with pytest.raises(SiftError, match="on_unknown"):
        index.fetch([("a", 37)], on_unknown="skip")


@pytest.mark.parametrize("n", [1, 16, 17, 100, 129])
def test_unknown_dense_is_all_ones(built, n):
    root, rows = built
    index = SiftIndex.open(root, device="cpu")
    docs = [("a", 37), ("new", n), ("b", 100)]
    bits = index.fetch(docs, on_unknown="dense")
    p = n_pages(n, TILE)
    la_vec, ca_vec = pack_msb(torch.ones(p * (p + 1) // 2, dtype=torch.bool)), pack_msb(torch.ones(p, dtype=torch.bool))
    assert la_vec.numel() == la_nbytes(n, TILE) and ca_vec.numel() == ca_nbytes(n, TILE)
    for layer in range(LAYERS):
        la_ptr, ca_ptr = bits.layer_ptrs(layer)
        for h in range(HEADS):
            lp, cp = int(la_ptr[1, h]), int(ca_ptr[1, h])
            assert torch.equal(bits.la_bytes[lp : lp + la_vec.numel()], la_vec)
            assert torch.equal(bits.ca_bytes[cp : cp + ca_vec.numel()], ca_vec)
    if n == 17:  # P = 2: 3 LA bits and 2 CA bits, trailing bits 0
        assert la_vec.tolist() == [0b11100000] and ca_vec.tolist() == [0b11000000]
    check_bits(bits, docs, rows, skip={1})
    assert index.stats()["dense"] == 1 and index.stats()["resident_documents"] == 2  # dense is never cached


def test_n_tokens_mismatch_is_stale(built):
    root, _ = built
    index = SiftIndex.open(root, device="cpu")
    with pytest.raises(SiftError, match=r"'b' has 101 tokens here but 100 in index.*stale"):
        index.fetch([("a", 37), ("b", 101)])
    with pytest.raises(SiftError, match="n_tokens"):
        index.fetch([("a", -1)])


def _stub_model(folder: Path, **overrides):
    config = dict(num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  head_dim=HEAD_DIM, hidden_size=HEADS * HEAD_DIM, _name_or_path=str(folder), model_type="llama")
    config.update(overrides)
    return SimpleNamespace(name_or_path=str(folder), config=SimpleNamespace(**config))


def test_check_model(tmp_path, monkeypatch):
    monkeypatch.setenv("SIFT_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": LAYERS}))
    fp = fingerprint(folder)
    make_index(tmp_path / "i", {"a": 20}, shards=1, fp=fp)
    index = SiftIndex.open(tmp_path / "i", device="cpu")
    index.check_model(_stub_model(folder))  # the same folder: accepted

    with pytest.raises(SiftError, match="num_key_value|kv heads"):
        index.check_model(_stub_model(folder, num_key_value_heads=1))

    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": LAYERS + 1}))
    new_fp = fingerprint(folder)
    assert new_fp != fp
    with pytest.raises(SiftError) as err:
        index.check_model(_stub_model(folder))
    msg = str(err.value)
    assert fp in msg and new_fp in msg and "rebuild the index" in msg and "\n" not in msg

    nameless = SimpleNamespace(name_or_path="", config=SimpleNamespace(_name_or_path=""))
    with pytest.raises(SiftError, match="name_or_path"):
        index.check_model(nameless)


def test_corrupt_shard_names_the_file(built):
    root, _ = built
    shard = root / json.loads((root / "manifest.json").read_text())["shards"][1]["path"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(SiftError, match=f"shard {shard}.*corrupt"):
        SiftIndex.open(root, device="cpu")
    # Without checksums, an unreadable shard still fails naming it.
    shard.write_bytes(bytes(data[: len(data) // 3]))
    with pytest.raises(SiftError, match=f"shard {shard}"):
        SiftIndex.open(root, device="cpu", verify=False)


def test_unknown_format_version(built):
    root, _ = built
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["format_version"] = 99
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SiftError, match="format_version 99"):
        SiftIndex.open(root, device="cpu")


def test_bad_open_arguments(tmp_path, built):
    root, _ = built
    with pytest.raises(SiftError, match="does not exist"):
        SiftIndex.open(tmp_path / "nowhere")
    with pytest.raises(SiftError, match="hbm_budget_bytes"):
        SiftIndex.open(root, hbm_budget_bytes=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU tests cover the cache logic)")
def test_cuda_fetch_matches_written_bits(built):
    root, rows = built
    index = SiftIndex.open(root, device="cuda", hbm_budget_bytes=doc_size(250) + doc_size(100))
    assert index.entry("a").la.is_pinned()
    rng = random.Random(1)
    ids = list(rows)
    busy = torch.randn(2048, 2048, device="cuda")
    for _ in range(30):
        busy = busy @ busy.T / 2048  # keep the current stream busy while the side stream copies
        docs = [(d, rows[d]["n_tokens"]) for d in rng.choices(ids, k=rng.randint(1, 5))]
        bits = index.fetch(docs)
        assert bits.la_bytes.is_cuda and bits.la_base.is_cuda
        check_bits(DocBits(*(getattr(bits, f).cpu() for f in ("la_bytes", "ca_bytes", "la_base", "ca_base",
                                                                 "la_head_nbytes", "ca_head_nbytes")),
                           bits.n_layers, bits.n_heads), docs, rows)
        assert index.stats()["resident_bytes"] <= index.budget_bytes
    assert index.stats()["hits"] > 0 and index.stats()["evictions"] > 0
