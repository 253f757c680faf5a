"""Decoded block indices against an independent reference built from SPEC section 4's token-level definition.

The reference here never coarsens tiles: it builds the token-level boolean mask of the SIFT pattern from the
unpacked bits (LA tiles with SPEC's always-kept diagonal, CA pages, dense prefix and query rows, causal), then
maps tokens to their physical blocks and keeps a block pair iff any token pair in it is attended.

The Triton decode runs on tests/helpers.py DEVICE (the GPU, or the interpreter without one); the references and
the comparisons on the CPU.
"""
import random

import pytest
import torch

from sift.format import n_pages
from sift.kernels.bits import pack_msb, tril_to_square
from sift.kernels.block_indices import (
    block_indices,
    block_indices_layers,
    block_indices_ref,
    dense_block_indices,
    dense_indptr,
    pack_doc_bits,
)
from sift.kernels.layout import build_layout

from .helpers import DEVICE

# The interpreter converts loop bounds loaded from memory with a NumPy deprecation warning; nothing of ours.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

N_LAYERS, LAYER = 2, 1  # decode layer 1 of 2, so per-layer offsets inside a document's blob are exercised


def random_requests(rng: random.Random, n_requests: int, n_docs: int, max_doc: int, tile: int):
    requests = []
    for _ in range(n_requests):
        segs = [("prefix", rng.choice([0, 1, 5, tile + 3]))]
        # Document lengths avoid multiples of the tile and of the block on purpose (plus a 1-token document).
        segs += [("doc", rng.choice([1, rng.randint(2, max_doc)])) for _ in range(n_docs)]
        segs.append(("query", rng.choice([0, 7, 2 * tile + 1])))
        requests.append(segs)
    return requests


def make_bits(n_tokens: list[int], tile: int, n_heads: int, fill: str, gen: torch.Generator):
    """Per document: LA [n_layers, Hq, P(P+1)/2] and CA [n_layers, Hq, P] bool, and their packed blobs."""
    la_bits, ca_bits, la_blobs, ca_blobs = [], [], [], []
    for n in n_tokens:
        p = n_pages(n, tile)
        shape_la, shape_ca = (N_LAYERS, n_heads, p * (p + 1) // 2), (N_LAYERS, n_heads, p)
        if fill == "random":
            la = torch.rand(shape_la, generator=gen) < 0.3
            ca = torch.rand(shape_ca, generator=gen) < 0.2
        elif fill == "ones":
            la, ca = torch.ones(shape_la, dtype=torch.bool), torch.ones(shape_ca, dtype=torch.bool)
        else:  # "zeros" / "zeros_sink": only the tiles the profiler always sets
            i, j = torch.tril_indices(p, p)
            forced = (i == j) | ((j == 0) & (fill == "zeros_sink"))
            la = forced.expand(shape_la).clone()
            ca = torch.zeros(shape_ca, dtype=torch.bool)
        la_bits.append(la)
        ca_bits.append(ca)
        la_blobs.append(pack_msb(la).numpy().tobytes())
        ca_blobs.append(pack_msb(ca).numpy().tobytes())
    return la_bits, ca_bits, la_blobs, ca_blobs


def expected_csr(requests, layout, la_bits, ca_bits, tile, n_heads):
    """Token-level SIFT mask per request -> block keep matrix [Hq, NB, NB] -> CSR."""
    nb = layout.n_blocks
    keep = torch.zeros(n_heads, nb, nb, dtype=torch.bool)
    tok_block = (layout.token_phys // layout.block).tolist()
    tok0, doc = 0, 0
    for segs in requests:
        n = sum(c for _, c in segs)
        mask = torch.ones(n, n, dtype=torch.bool).tril().expand(n_heads, n, n).clone()  # prefix / query rows
        starts, docs_here, s = [], [], 0
        for kind, c in segs:
            if kind == "doc":
                starts.append(s)
                docs_here.append((s, c, doc))
                doc += 1
            s += c
        n_prefix = segs[0][1] if segs[0][0] == "prefix" else 0
        for m, (s, c, d) in enumerate(docs_here):
            rows = slice(s, s + c)
            mask[:, rows, n_prefix:] = False
            p = n_pages(c, tile)
            la = tril_to_square(la_bits[d][LAYER], p) | torch.eye(p, dtype=torch.bool)  # SPEC: LA(i, i) = 1
            t = torch.arange(c) // tile
            mask[:, rows, rows] = la[:, t][:, :, t] & torch.ones(c, c, dtype=torch.bool).tril()
            for s_i, c_i, d_i in docs_here[:m]:
                ca = ca_bits[d_i][LAYER][:, torch.arange(c_i) // tile]  # [Hq, c_i]
                mask[:, rows, s_i : s_i + c_i] = ca[:, None, :]
        onehot = torch.zeros(nb, n)
        onehot[torch.tensor(tok_block[tok0 : tok0 + n]), torch.arange(n)] = 1.0
        keep |= (onehot @ mask.float() @ onehot.T) > 0
        tok0 += n
    counts = keep.sum(dim=2).reshape(-1)
    indptr = torch.zeros(n_heads * nb + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(counts, 0)
    return indptr, keep.nonzero()[:, 2].to(torch.int32)


def decode_both(requests, tile, block, n_heads, fill, seed=0):
    layout = build_layout(requests, block)
    n_tokens = layout.doc_n_tokens.tolist()
    gen = torch.Generator().manual_seed(seed)
    la_bits, ca_bits, la_blobs, ca_blobs = make_bits(n_tokens, tile, n_heads, fill, gen)
    bits = pack_doc_bits(la_blobs, ca_blobs, n_tokens, tile=tile, n_layers=N_LAYERS, n_heads=n_heads)
    la_ptr, ca_ptr = bits.layer_ptrs(LAYER)
    all_la, all_ca = bits.all_layer_ptrs()
    assert torch.equal(all_la[LAYER], la_ptr) and torch.equal(all_ca[LAYER], ca_ptr)
    want = expected_csr(requests, layout, la_bits, ca_bits, tile, n_heads)
    # The kernels' inputs on DEVICE: the layout and the bits (and the pointers the device arithmetic derives).
    lay_d = layout.to(DEVICE)
    bits_d = pack_doc_bits(la_blobs, ca_blobs, n_tokens, tile=tile, n_layers=N_LAYERS, n_heads=n_heads,
                           device=DEVICE)
    la_ptr_d, ca_ptr_d = bits_d.layer_ptrs(LAYER)
    all_la_d, all_ca_d = bits_d.all_layer_ptrs()

    def cpu(xs):
        return tuple(x.cpu() for x in xs)

    got_kernel = cpu(block_indices(lay_d, bits_d.la_bytes, la_ptr_d, bits_d.ca_bytes, ca_ptr_d, tile))
    got_ref = block_indices_ref(layout, bits.la_bytes, la_ptr, bits.ca_bytes, ca_ptr, tile)
    # One-pass mode: rows at their dense starts, each ending at row_end; compacted it is the same CSR.
    starts, idx, ends = cpu(block_indices(lay_d, bits_d.la_bytes, la_ptr_d, bits_d.ca_bytes, ca_ptr_d, tile,
                                          padded=True))
    assert torch.equal(starts, dense_indptr(layout, n_heads))
    assert bool((ends >= starts[:-1]).all()) and bool((ends <= starts[1:]).all())
    compact = torch.cat([idx[a:b] for a, b in zip(starts[:-1].tolist(), ends.tolist())])
    ptr = torch.zeros_like(starts)
    ptr[1:] = torch.cumsum(ends - starts[:-1], 0)
    assert_csr_equal((ptr, compact.to(torch.int32)), want, "one-pass (padded) kernel")
    # Every layer in one launch: layer LAYER against the token-level construction, the others against the twin.
    starts_l, idx_l, ends_l = cpu(block_indices_layers(lay_d, bits_d.la_bytes, all_la_d, bits_d.ca_bytes, all_ca_d,
                                                       tile))
    assert torch.equal(starts_l, starts) and idx_l.shape[0] == ends_l.shape[0] == N_LAYERS
    for layer in range(N_LAYERS):
        compact = torch.cat([idx_l[layer, a:b] for a, b in zip(starts[:-1].tolist(), ends_l[layer].tolist())])
        ptr = torch.zeros_like(starts)
        ptr[1:] = torch.cumsum(ends_l[layer] - starts[:-1], 0)
        ref = want if layer == LAYER else block_indices_ref(layout, bits.la_bytes, all_la[layer], bits.ca_bytes,
                                                            all_ca[layer], tile)
        assert_csr_equal((ptr, compact.to(torch.int32)), ref, f"multi-layer kernel, layer {layer}")
    return layout, want, got_kernel, got_ref


def assert_csr_equal(got, want, what):
    indptr, indices = got
    assert indptr.dtype == torch.int32 and indices.dtype == torch.int32
    assert torch.equal(indptr, want[0]), f"{what}: indptr differs"
    nnz = int(indptr[-1])
    assert indices.numel() >= nnz
    assert torch.equal(indices[:nnz], want[1]), f"{what}: indices differ"


TILE_BLOCK = [
    (16, 16), (16, 32), (16, 64), (16, 128), (32, 32), (32, 64), (32, 128), (64, 64), (64, 128), (128, 128),
]


@pytest.mark.parametrize("tile, block", TILE_BLOCK)
def test_random_bits_tile_block(tile, block):
    rng = random.Random(tile * 1000 + block)
    requests = random_requests(rng, n_requests=2, n_docs=3, max_doc=3 * block + 5, tile=tile)
    _, want, got, ref = decode_both(requests, tile, block, n_heads=3, fill="random", seed=block)
    assert_csr_equal(got, want, "kernel")
    assert_csr_equal(ref, want, "reference")


@pytest.mark.parametrize("n_docs, n_heads", [(1, 9), (7, 3), (20, 3)])
def test_random_bits_many_documents(n_docs, n_heads):
    rng = random.Random(n_docs)
    requests = random_requests(rng, n_requests=1, n_docs=n_docs, max_doc=70, tile=16)
    requests.append([("prefix", 3), ("doc", 40), ("query", 5)])  # an unequal second request
    _, want, got, ref = decode_both(requests, 16, 32, n_heads=n_heads, fill="random", seed=n_docs)
    assert_csr_equal(got, want, "kernel")
    assert_csr_equal(ref, want, "reference")


@pytest.mark.parametrize("tile, block", [(16, 16), (32, 128), (64, 64)])
def test_all_ones_is_dense_causal(tile, block):
    rng = random.Random(1)
    requests = random_requests(rng, n_requests=3, n_docs=3, max_doc=2 * block + 9, tile=tile)
    layout, want, got, ref = decode_both(requests, tile, block, n_heads=3, fill="ones")
    dense = dense_block_indices(layout, 3)
    assert_csr_equal(dense, want, "dense_block_indices")
    assert_csr_equal(got, want, "kernel")
    assert_csr_equal(ref, want, "reference")
    assert dense[1].numel() == 3 * layout.causal_block_pairs == int(dense[0][-1])


@pytest.mark.parametrize("fill", ["zeros", "zeros_sink"])
@pytest.mark.parametrize("tile, block", [(16, 16), (16, 64), (32, 32)])
def test_forced_tiles_only(fill, tile, block):
    rng = random.Random(2)
    requests = random_requests(rng, n_requests=2, n_docs=4, max_doc=4 * tile + 3, tile=tile)
    layout, want, got, ref = decode_both(requests, tile, block, n_heads=3, fill=fill)
    assert_csr_equal(got, want, "kernel")
    assert_csr_equal(ref, want, "reference")
    # With a kernel block of one tile and no sink, a document row keeps exactly its prefix and its diagonal.
    if fill == "zeros" and tile == block:
        for qb in range(layout.n_blocks):
            if int(layout.block_kind[qb]) == 1:
                row = got[1][int(got[0][qb]) : int(got[0][qb + 1])].tolist()
                req = int(layout.block_request[qb])
                f = layout.request_blocks[req][0]
                prefix = [b for b in range(f, qb) if int(layout.block_kind[b]) == 0]
                assert row == prefix + [qb]


def test_no_documents():
    """Prefix / query only: every row dense causal, and no bit pointers at all."""
    layout = build_layout([[("prefix", 20), ("query", 9)], [("query", 40)]], 16)
    empty8, empty64 = torch.zeros(0, dtype=torch.uint8), torch.zeros(0, 3, dtype=torch.int64)
    want = dense_block_indices(layout, 3)
    got = block_indices(layout.to(DEVICE), empty8.to(DEVICE), empty64.to(DEVICE), empty8.to(DEVICE),
                        empty64.to(DEVICE), 16)
    assert_csr_equal(tuple(x.cpu() for x in got), want, "kernel")
    assert_csr_equal(block_indices_ref(layout, empty8, empty64, empty8, empty64, 16), want, "reference")


def test_rejects_tile_larger_than_block():
    layout = build_layout([[("doc", 40)]], 16, DEVICE)
    z8, z64 = torch.zeros(8, dtype=torch.uint8, device=DEVICE), torch.zeros(1, 1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="larger than the kernel block"):
        block_indices(layout, z8, z64, z8, z64, 32)


def test_rejects_wrong_blob_size():
    with pytest.raises(ValueError, match="document 0"):
        pack_doc_bits([b"\x00"], [b"\x00"], [40], tile=16, n_layers=2, n_heads=3)
