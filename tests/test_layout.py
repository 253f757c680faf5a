"""BatchLayout: logical positions, padding, segment tables, scatter / gather."""
import pytest
import torch

from sift.kernels.layout import DOC, PREFIX, QUERY, build_layout

BATCHES = [
    [[("prefix", 5), ("doc", 37), ("doc", 1), ("doc", 64), ("query", 9)]],
    [
        [("prefix", 16), ("doc", 100), ("query", 0)],
        [("doc", 3)],
        [("prefix", 0), ("doc", 17), ("doc", 33), ("query", 48)],
        [("query", 7)],
    ],
]


@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize("requests", BATCHES)
def test_positions_and_slots(requests, block):
    lay = build_layout(requests, block)
    n_req = [sum(n for _, n in segs) for segs in requests]
    assert lay.n_tokens == sum(n_req)
    # Logical positions are arange over each request's unsegmented prompt, whatever the padding.
    expected_logical = torch.cat([torch.arange(n) for n in n_req])
    assert torch.equal(lay.token_logical_pos, expected_logical)
    expected_local = torch.cat([torch.arange(n) for segs in requests for _, n in segs])
    assert torch.equal(lay.token_local_pos, expected_local)

    # Physical slots: distinct, in bounds, each segment starts on a block boundary, real tokens first.
    phys = lay.token_phys
    assert phys.dtype == torch.int64 and len(torch.unique(phys)) == len(phys)
    assert int(phys.max()) < lay.n_slots
    blk, slot = phys // block, phys % block
    assert torch.equal(slot, lay.token_local_pos % block)
    assert torch.equal(lay.block_local0[blk] + slot, lay.token_local_pos.int())
    assert torch.equal(lay.block_offset[blk] + lay.block_local0[blk] + slot, lay.token_logical_pos.int())
    assert torch.equal(torch.bincount(blk, minlength=lay.n_blocks).int(), lay.block_valid)
    assert bool((lay.block_valid >= 1).all()) and bool((lay.block_valid <= block).all())

    # Segment tables against a plain Python walk.
    seg, first, tok = 0, 0, 0
    for r, segs in enumerate(requests):
        assert lay.request_blocks[r][0] == first
        pos = 0
        for kind, n in segs:
            nb = -(-n // block)
            assert int(lay.seg_first_block[seg]) == first and int(lay.seg_n_blocks[seg]) == nb
            assert int(lay.seg_offset[seg]) == pos and int(lay.seg_n_tokens[seg]) == n
            assert int(lay.seg_request[seg]) == r
            assert int(lay.seg_kind[seg]) == {"prefix": PREFIX, "doc": DOC, "query": QUERY}[kind]
            if nb:
                assert torch.equal(lay.block_segment[first:first + nb], torch.full((nb,), seg, dtype=torch.int32))
                assert torch.equal(lay.block_request[first:first + nb], torch.full((nb,), r, dtype=torch.int32))
            seg, first, pos = seg + 1, first + nb, pos + n
        assert first - lay.request_blocks[r][0] == lay.request_blocks[r][1] == int(lay.req_n_blocks[r])
        assert int(lay.req_first_token[r]) == tok
        tok += pos
    assert first == lay.n_blocks and seg == lay.n_segments
    nbs = [nb for _, nb in lay.request_blocks]
    assert lay.causal_block_pairs == sum(n * (n + 1) // 2 for n in nbs)


def test_documents_table():
    requests = BATCHES[1]
    lay = build_layout(requests, 32)
    docs = [(r, n) for r, segs in enumerate(requests) for kind, n in segs if kind == "doc"]
    assert lay.n_docs == len(docs)
    assert lay.doc_request.tolist() == [r for r, _ in docs]
    assert lay.doc_n_tokens.tolist() == [n for _, n in docs]
    assert torch.equal(lay.seg_kind[lay.doc_segment.long()], torch.full((len(docs),), DOC, dtype=torch.int32))
    for d in range(lay.n_docs):
        f, nb = int(lay.doc_first_block[d]), int(lay.doc_n_blocks[d])
        assert lay.block_doc[f:f + nb].tolist() == [d] * nb
    assert bool((lay.block_doc[lay.block_kind != DOC] == -1).all())
    assert lay.req_n_docs.tolist() == [1, 1, 2, 0] and lay.req_first_doc.tolist() == [0, 1, 2, 4]


def test_scatter_gather_round_trip():
    lay = build_layout(BATCHES[1], 16)
    x = torch.randn(3, lay.n_tokens, 4)
    phys = lay.scatter(x, dim=1, fill=float("nan"))
    assert phys.shape == (3, lay.n_slots, 4)
    assert torch.equal(lay.gather(phys, dim=1), x)
    # Exactly the padding slots hold the fill value.
    assert int(torch.isnan(phys[0, :, 0]).sum()) == lay.n_slots - lay.n_tokens


@pytest.mark.parametrize(
    "requests, match",
    [
        ([[("doc", 0)]], "at least 1 token"),
        ([[("doc", 4), ("prefix", 2)]], "prefix"),
        ([[("query", 4), ("doc", 2)]], "query"),
        ([[("image", 4)]], "kind"),
        ([[("prefix", 0), ("query", 0)]], "no tokens"),
        ([], "no requests"),
    ],
)
def test_rejects_bad_requests(requests, match):
    with pytest.raises(ValueError, match=match):
        build_layout(requests, 16)


def test_rejects_bad_block():
    with pytest.raises(ValueError, match="power of two"):
        build_layout([[("doc", 4)]], 48)
