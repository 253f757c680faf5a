"""The runtime's decode of real stored SIFT bits (the attention benchmark's mask (b), bench/masks.py) against
SPEC sections 2-4 read directly off the stored file.

A prompt of `context` tokens is a prefix, the stored documents in order (cycling, the last one cut to fit) and a
query. The expected block mask is built here with numpy from the Parquet bytes and the SPEC's definitions (LA bit
n = i(i+1)/2 + j MSB-first, CA bit j, a kernel block kept iff any of its tiles is, the section 4 pattern); the
decoded one comes from the product path (`build_layout`, `pack_doc_bits`, `block_indices_ref` / `block_indices`).
The Triton decode (on tests/helpers.py DEVICE: the GPU, or the interpreter) is compared with its ref twin on the
same bits.
"""
import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from sift.kernels.block_indices import block_indices, block_indices_ref, pack_doc_bits
from sift.kernels.layout import build_layout

from .helpers import DEVICE

DATA = Path(__file__).resolve().parents[1] / "bench" / "data" / "smollm2-wiki2048-bits.parquet"
PREFIX, QUERY, BLOCK = 128, 512, 128


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


def _plan(rows, budget):
    """[(stored row, tokens used)]: the stored documents in order, cycling, the last one cut to fit `budget`."""
    docs, k = [], 0
    while budget > 0:
        d = rows[k % len(rows)]
        n = min(d["n_tokens"], budget)
        docs.append((d, n))
        budget -= n
        k += 1
    return docs


def _vectors(meta, n_heads, layer):
    """Vector (layer * heads + head) each query head reads: spread over all layers, or layer `layer`'s heads."""
    layers, heads = meta["model"]["n_layers"], meta["model"]["n_heads"]
    return [h * layers * heads // n_heads if layer is None else layer * heads + h % heads for h in range(n_heads)]


def _spec_mask(rows, meta, context, n_heads, layer, prefix, query, block):
    """SPEC section 4's block mask [n_heads, NB, NB] for a prompt of `context` tokens (module docstring)."""
    tile, layers, heads = meta["profile"]["tile"], meta["model"]["n_layers"], meta["model"]["n_heads"]
    r = block // tile
    vec = _vectors(meta, n_heads, layer)
    docs = _plan(rows, context - prefix - query)
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


def _cut(blob: bytes, n_vectors: int, n_bits: int, keep: int) -> bytes:
    """The first `keep` of each vector's n_bits, re-packed MSB-first into byte-aligned vectors (SPEC section 3):
    a document cut at a page boundary has the bits of its first pages, since tile row i only sees keys < (i+1)T."""
    bits = _bits(blob, n_vectors, -(-n_bits // 8) * 8)[:, :keep]
    return np.packbits(bits, axis=1).tobytes()


def _decoded(rows, meta, context, n_heads, layer, backend="torch"):
    """The product decode of the stored bits for a prompt of `context` tokens -> (layout, indptr, indices)."""
    tile, layers, heads = meta["profile"]["tile"], meta["model"]["n_layers"], meta["model"]["n_heads"]
    docs = _plan(rows, context - PREFIX - QUERY)
    la_blobs, ca_blobs = [], []
    for d, n in docs:
        la, ca = d["la_bits"], d["ca_bits"]
        if n < d["n_tokens"]:
            p, p2 = -(-d["n_tokens"] // tile), -(-n // tile)
            la = _cut(la, layers * heads, p * (p + 1) // 2, p2 * (p2 + 1) // 2)
            ca = _cut(ca, layers * heads, p, p2)
        la_blobs.append(la)
        ca_blobs.append(ca)
    device = DEVICE if backend == "triton" else "cpu"   # the Triton decode on the GPU, or interpreted
    layout = build_layout([[("prefix", PREFIX)] + [("doc", n) for _, n in docs] + [("query", QUERY)]], BLOCK,
                          device=device)
    packed = pack_doc_bits(la_blobs, ca_blobs, [n for _, n in docs], tile=tile, n_layers=layers, n_heads=heads,
                           device=device)
    vec = torch.tensor(_vectors(meta, n_heads, layer), dtype=torch.int64, device=device)
    la_ptr = packed.la_base[:, None] + vec[None, :] * packed.la_head_nbytes[:, None]  # [n_docs, n_heads]
    ca_ptr = packed.ca_base[:, None] + vec[None, :] * packed.ca_head_nbytes[:, None]
    decode = block_indices if backend == "triton" else block_indices_ref
    indptr, indices = (x.cpu() for x in decode(layout, packed.la_bytes, la_ptr, packed.ca_bytes, ca_ptr, tile))
    return layout, indptr, indices[: int(indptr[-1])]  # the Triton decode allocates the dense upper bound


@pytest.mark.parametrize("layer", [None, 7])
def test_real_mask_matches_spec(stored, layer):
    rows, meta = stored
    assert [n for _, n in _plan(rows, 8192 - PREFIX - QUERY)] == [2048, 2048, 2048, 1408]
    layout, indptr, indices = _decoded(rows, meta, 8192, 32, layer)
    assert layout.n_blocks == 8192 // 128 and layout.n_tokens == 8192
    want = _csr(_spec_mask(rows, meta, 8192, 32, layer, PREFIX, QUERY, BLOCK))
    assert torch.equal(indptr, want[0]) and torch.equal(indices, want[1])


def test_real_mask_cycles_and_cuts(stored):
    rows, meta = stored
    n = len(rows)
    ctx = PREFIX + QUERY + (n + 1) * 2048 + 640  # every stored document, then the first again, then a cut one
    docs = _plan(rows, ctx - PREFIX - QUERY)
    assert [d is rows[i % n] for i, (d, _) in enumerate(docs)] == [True] * (n + 2) and docs[-1][1] == 640
    _, indptr, indices = _decoded(rows, meta, ctx, 4, 3)
    want = _csr(_spec_mask(rows, meta, ctx, 4, 3, PREFIX, QUERY, BLOCK))
    assert torch.equal(indptr, want[0]) and torch.equal(indices, want[1])


def test_triton_decode_matches_twin(stored):
    rows, meta = stored
    _, ptr_a, idx_a = _decoded(rows, meta, 5376, 4, None, backend="triton")  # 2 documents + a cut one;
    _, ptr_b, idx_b = _decoded(rows, meta, 5376, 4, None, backend="torch")
    assert torch.equal(ptr_a, ptr_b) and torch.equal(idx_a, idx_b)
