"""bench/masks.py (the attention benchmark's mask (b)) against SPEC sections 2-4 read directly off the stored file.

The expected block mask is built here with numpy from the Parquet bytes and the SPEC's definitions (LA bit
n = i(i+1)/2 + j MSB-first, CA bit j, a kernel block kept iff any of its tiles is, the section 4 pattern), not
with the runtime's decoders; the Triton decode (interpreter) is compared with its torch twin on the same bits.
"""
import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
DATA = BENCH / "data" / "smollm2-wiki2048-bits.parquet"


@pytest.fixture(scope="module")
def masks():
    spec = importlib.util.spec_from_file_location("bench_masks", BENCH / "masks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def stored():
    table = pq.read_table(DATA)
    return table.to_pylist(), json.loads(table.schema.metadata[b"sift_real_bits"])


def _bits(blob: bytes, n_vectors: int, n_bits: int) -> np.ndarray:
    """[n_vectors, n_bits] bool, MSB-first inside each byte-aligned vector."""
    rows = np.frombuffer(blob, dtype=np.uint8).reshape(n_vectors, -1)
    return np.unpackbits(rows, axis=1)[:, :n_bits].astype(bool)


def test_stored_file_is_consistent(stored):
    rows, meta = stored
    tile, layers, heads = meta["profile"]["tile"], meta["model"]["n_layers"], meta["model"]["n_heads"]
    assert (tile, layers, heads) == (64, 30, 9)
    assert "CC BY-SA 4.0" in meta["licence"] and meta["model"]["fingerprint"]
    assert len(rows) == meta["documents"]["count"] >= 16
    for r in rows:
        n = r["n_tokens"]
        ids = np.frombuffer(r["token_ids"], dtype="<u2")
        assert ids.size == n and r["titles"]
        assert r["content_hash"] == hashlib.sha256(ids.astype("<i4").tobytes()).hexdigest()
        p = -(-n // tile)
        tri = p * (p + 1) // 2
        assert len(r["la_bits"]) == layers * heads * -(-tri // 8)
        assert len(r["ca_bits"]) == layers * heads * -(-p // 8)
        la = _bits(r["la_bits"], layers * heads, -(-tri // 8) * 8)
        ca = _bits(r["ca_bits"], layers * heads, -(-p // 8) * 8)
        assert not la[:, tri:].any() and not ca[:, p:].any(), "unused trailing bits must be 0"
        i = np.arange(p)
        assert la[:, i * (i + 1) // 2 + i].all(), "diagonal tiles are always kept"
        assert la[:, i * (i + 1) // 2].all(), "force_sink_page keeps tile (i, 0)"
    for check in meta["la_truncation_check"].values():
        assert check["la_bits_differing"] == 0


def _spec_mask(rows, meta, context, n_heads, layer, prefix, query, block):
    """SPEC section 4's block mask [n_heads, NB, NB] for the geometry masks.py documents."""
    tile, layers, heads = meta["profile"]["tile"], meta["model"]["n_layers"], meta["model"]["n_heads"]
    r = block // tile
    vec = [h * layers * heads // n_heads if layer is None else layer * heads + h % heads for h in range(n_heads)]
    docs, budget, k = [], context - prefix - query, 0
    while budget > 0:
        d = rows[k % len(rows)]
        n = min(d["n_tokens"], budget)
        docs.append((d, n))
        budget -= n
        k += 1
    segs = [("prefix", prefix, None)] + [("doc", n, d) for d, n in docs] + [("query", query, None)]
    spans, b = [], 0
    for kind, n, d in segs:
        nblk = -(-n // block)
        spans.append((kind, b, b + nblk, n, d))
        b += nblk
    nb = b
    keep = np.zeros((n_heads, nb, nb), dtype=bool)
    tril = np.tril(np.ones((nb, nb), dtype=bool))
    for kind, b0, b1, n, d in spans:
        if kind != "doc":
            keep[:, b0:b1] = tril[b0:b1]
            continue
        keep[:, b0:b1, spans[0][1]:spans[0][2]] = True  # the whole prefix
        p_full, p = -(-d["n_tokens"] // tile), -(-n // tile)
        la = _bits(d["la_bits"], layers * heads, p_full * (p_full + 1) // 2)[vec]  # [H, bits]
        tiles = np.zeros((n_heads, p, p), dtype=bool)
        for i in range(p):
            for j in range(i + 1):
                tiles[:, i, j] = la[:, i * (i + 1) // 2 + j] | (i == j)  # LA(i, i) = 1
        for bi in range(b1 - b0):
            for bj in range(bi + 1):
                keep[:, b0 + bi, b0 + bj] = tiles[:, bi * r:(bi + 1) * r, bj * r:(bj + 1) * r].any(axis=(1, 2))
        # this document's CA pages, seen by every later document's rows
        ca = _bits(d["ca_bits"], layers * heads, p_full)[vec][:, :p]
        ca_blocks = np.stack([ca[:, bj * r:(bj + 1) * r].any(axis=1) for bj in range(b1 - b0)], axis=1)
        for kind2, c0, c1, _, _ in spans:
            if kind2 == "doc" and c0 > b0:
                keep[:, c0:c1, b0:b1] = ca_blocks[:, None, :]
    return keep


def _csr(keep):
    counts = keep.reshape(-1, keep.shape[-1]).sum(1)
    indptr = torch.zeros(counts.size + 1, dtype=torch.int32)
    indptr[1:] = torch.from_numpy(np.cumsum(counts)).to(torch.int32)
    return indptr, torch.from_numpy(np.nonzero(keep)[2]).to(torch.int32)


@pytest.mark.parametrize("layer", [None, 7])
def test_real_mask_matches_spec(masks, stored, layer):
    rows, meta = stored
    m = masks.real_mask(8192, 32, "cpu", layer=layer)
    assert m.layout.n_blocks == 8192 // 128 and m.layout.n_tokens == 8192
    assert m.stats["doc_tokens"] == [2048, 2048, 2048, 1408]
    want = _csr(_spec_mask(rows, meta, 8192, 32, layer, 128, 512, 128))
    assert torch.equal(m.indptr, want[0]) and torch.equal(m.indices, want[1])
    assert m.stats["tiles"] == int(want[0][-1])
    assert m.stats["query_rows"]["fraction"] == 1.0 and m.stats["doc_rows_prefix"] == 1.0


def test_real_mask_cycles_and_cuts(masks, stored):
    rows, _ = stored
    n = len(rows)
    ctx = 128 + 512 + (n + 1) * 2048 + 640  # every stored document, then the first again, then a cut one
    s = masks.real_mask(ctx, 4, "cpu", layer=3).stats
    assert s["stored_docs"] == [i % n for i in range(n + 2)] and s["doc_tokens"][-1] == 640


def test_triton_decode_matches_twin(masks):
    a = masks.real_mask(5376, 4, "cpu", backend="triton")  # 2 documents + a cut one; TRITON_INTERPRET=1 (conftest)
    b = masks.real_mask(5376, 4, "cpu", backend="torch")
    assert torch.equal(a.indptr, b.indptr) and torch.equal(a.indices, b.indices)
