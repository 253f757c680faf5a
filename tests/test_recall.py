"""The paper's recall (quality/recall.py) against a brute-force construction: the real SmolLM2's full eager
attention matrices (transformers, attn_implementation="eager", output_attentions) of a tiny multi-document prompt,
every cell compared with the thresholds and looked up in bits expanded to one flag per cell, counted with numpy.
"""
import numpy as np
import pytest
import torch

from sift.format import n_pages
from sift.kernels.bits import pack_msb, tril_to_square
from sift.kernels.block_indices import block_indices_ref, pack_doc_bits
from sift.kernels.layout import build_layout
from sift.quality.recall import DocMasks, coarsen, measure_prompt

from .helpers import model_rounding, smollm2, wiki_texts

TILE = 16
ALPHA, BETA = 0.01, 0.02


def _prompt(tokenizer):
    prefix = tokenizer("Read the passages.\n", add_special_tokens=True).input_ids
    docs = [tokenizer(t[:160], add_special_tokens=False).input_ids for t in wiki_texts(3)]
    query = tokenizer("\nQuestion: which one is oldest?", add_special_tokens=False).input_ids
    return [("prefix", prefix)] + [("doc", d) for d in docs] + [("query", query)]


def _random_masks(segments, n_layers, n_heads):
    g = torch.Generator().manual_seed(7)
    out = []
    for kind, ids in segments:
        if kind == "doc":
            p = -(-len(ids) // TILE)
            la = torch.tril(torch.rand(n_layers, n_heads, p, p, generator=g) < 0.6)
            out.append(DocMasks(la=la, ca=torch.rand(n_layers, n_heads, p, generator=g) < 0.4))
    return out


def _cell_flags(segments, masks, layer):
    """Brute force: per (head, query, key) of the prompt, is the cell own-document / cross-document, and is it
    kept -> (own, cross, kept) bool [H, N, N]."""
    bounds, pos = [], 0
    for kind, ids in segments:
        if kind == "doc":
            bounds.append((pos, pos + len(ids)))
        pos += len(ids)
    n_heads = masks[0].la.shape[1]
    own = np.zeros((n_heads, pos, pos), bool)
    cross = np.zeros((n_heads, pos, pos), bool)
    kept = np.zeros((n_heads, pos, pos), bool)
    for m, (s, e) in enumerate(bounds):
        la = masks[m].la[layer].numpy()
        for q in range(s, e):
            for k in range(s, q + 1):
                own[:, q, k] = True
                kept[:, q, k] = la[:, (q - s) // TILE, (k - s) // TILE]
            for i, (s_i, e_i) in enumerate(bounds[:m]):
                ca = masks[i].ca[layer].numpy()
                for k in range(s_i, e_i):
                    cross[:, q, k] = True
                    kept[:, q, k] = ca[:, (k - s_i) // TILE]
    return own, cross, kept


def test_recall_equals_brute_force_eager_attention():
    model, tokenizer = smollm2("eager")
    segments = _prompt(tokenizer)
    cfg = model.config
    masks = _random_masks(segments, cfg.num_hidden_layers, cfg.num_attention_heads)
    got = measure_prompt(model, segments, masks, tile=TILE, alpha=ALPHA, beta=BETA)

    ids = torch.tensor([[t for _, seg in segments for t in seg]])
    with torch.inference_mode():
        model.set_attn_implementation("eager")  # the shared model may still route to another test's profiler
        attentions = model(input_ids=ids, output_attentions=True).attentions
    for layer in range(0, cfg.num_hidden_layers, 7):
        a = attentions[layer][0].float().numpy()
        own, cross, kept = _cell_flags(segments, masks, layer)
        la_high, ca_high = own & (a >= ALPHA), cross & (a >= BETA)
        # recall.py's exact attention and transformers' eager one round differently from the first layer on:
        # cells within that rounding of a threshold may fall either side, and sums agree to it.
        rel = model_rounding(cfg, depth=layer + 1)
        near = int((own & (np.abs(a - ALPHA) <= rel * ALPHA)).sum()
                   + (cross & (np.abs(a - BETA) <= rel * BETA)).sum())
        expected = dict(la_high=la_high.sum(), la_high_kept=(la_high & kept).sum(), ca_high=ca_high.sum(),
                        ca_high_kept=(ca_high & kept).sum())
        for name, value in expected.items():
            print(f"layer {layer} {name}: {getattr(got, name)[layer]:.0f} measured, {value} brute force")
            assert abs(getattr(got, name)[layer] - value) <= near
        assert expected["la_high"] > 100 and expected["ca_high"] > 100 and 0 < expected["ca_high_kept"]
        rows = own.any(axis=2)  # document rows
        n_prefix = len(segments[0][1])
        prefix = np.zeros_like(kept)
        prefix[:, :, :n_prefix] = True
        mass = (a * ((kept | prefix) & rows[:, :, None])).sum()
        assert got.mass[layer] == rows.sum()
        assert got.mass_kept[layer] == pytest.approx(mass, rel=rel)
        cross_rows = cross & rows[:, :, None]
        assert got.ca_mass[layer] == pytest.approx((a * cross_rows).sum(), rel=rel)
        assert got.ca_mass_kept[layer] == pytest.approx((a * (cross_rows & kept)).sum(), rel=rel)
        lost = (a * (cross_rows & ~kept)).sum() / rows.sum()
        assert got.summary()["layers"][layer]["ca_mass_lost"] == pytest.approx(lost, rel=rel)
        assert lost > 0.01  # random CA bits drop pages that later documents read
        # per head: each head's lost mass over its own document rows
        head_lost = (a * (cross_rows & ~kept)).sum(axis=(1, 2)) / rows[0].sum()
        assert got.summary()["heads_ca_mass_lost"][layer] == pytest.approx(head_lost.tolist(), rel=rel)
        assert np.mean(head_lost) == pytest.approx(lost, rel=rel) and np.ptp(head_lost) > 0
        la = [m.la[layer] for m in masks]
        assert got.la_tiles[layer] == sum(x.shape[0] * x.shape[1] * (x.shape[1] + 1) / 2 for x in la)
        assert got.la_tiles_kept[layer] == sum(int(x.sum()) for x in la)
    pages = [m.ca.shape[-1] for m in masks]
    for layer in (0, cfg.num_hidden_layers - 1):
        pairs = sum(cfg.num_attention_heads * pages[i] * sum(pages[i + 1:]) for i in range(len(pages)))
        pairs_kept = sum(int(masks[i].ca[layer].sum()) * sum(pages[i + 1:]) for i in range(len(pages)))
        assert (got.ca_pairs[layer], got.ca_pairs_kept[layer]) == (pairs, pairs_kept)
    total = got.summary()["total"]
    assert total["la_recall"] == pytest.approx(got.la_high_kept.sum() / got.la_high.sum())
    assert total["ca_sparsity"] == pytest.approx(1 - got.ca_pairs_kept.sum() / got.ca_pairs.sum())


@pytest.mark.parametrize("block", [16, 64, 128])
def test_coarsened_bits_are_the_blocks_the_engine_computes(block):
    """`coarsen` (what `measure(..., block=B)` and the guard count as kept) against the engine's own decoding of
    the same packed bits into kernel blocks (`block_indices_ref`, the ref twin of the Triton decoder): a tile
    or page is counted kept iff the engine computes its block pair."""
    r, n_heads = block // TILE, 3
    requests = [[("prefix", 5), ("doc", 37), ("doc", 150), ("doc", 200), ("query", 7)]]
    layout = build_layout(requests, block)
    g = torch.Generator().manual_seed(3)
    masks, la_blobs, ca_blobs = [], [], []
    for n in layout.doc_n_tokens.tolist():
        p = n_pages(n, TILE)
        i, j = torch.tril_indices(p, p)
        la = (torch.rand(1, n_heads, p * (p + 1) // 2, generator=g) < 0.08) | (i == j)  # the diagonal is always set
        ca = torch.rand(1, n_heads, p, generator=g) < 0.1
        la_blobs.append(pack_msb(la).numpy().tobytes())
        ca_blobs.append(pack_msb(ca).numpy().tobytes())
        masks.append(DocMasks(la=tril_to_square(la, p), ca=ca))
    bits = pack_doc_bits(la_blobs, ca_blobs, layout.doc_n_tokens.tolist(), tile=TILE, n_layers=1, n_heads=n_heads)
    la_ptr, ca_ptr = bits.layer_ptrs(0)
    indptr, indices = block_indices_ref(layout, bits.la_bytes, la_ptr, bits.ca_bytes, ca_ptr, TILE)
    nb = layout.n_blocks
    keep = torch.zeros(n_heads * nb, nb, dtype=torch.bool)
    for row in range(n_heads * nb):
        keep[row, indices[indptr[row]:indptr[row + 1]].long()] = True
    keep = keep.view(n_heads, nb, nb)
    first = layout.doc_first_block.tolist()
    coarse = [coarsen(m, r) for m in masks]
    for m, c in enumerate(coarse):
        p = c.ca.shape[-1]
        i, j = torch.tril_indices(p, p)
        assert torch.equal(c.la[0][:, i, j], keep[:, first[m] + i // r, first[m] + j // r])
        assert not c.la[0].triu(1).any()
        assert (c.la[0] >= masks[m].la[0]).all() and (c.ca[0] >= masks[m].ca[0]).all()  # coarsening only adds
        for later in range(m + 1, len(coarse)):
            assert torch.equal(c.ca[0], keep[:, first[later], first[m] + torch.arange(p) // r])
    if r > 1:
        assert sum(int(c.ca.sum()) for c in coarse) > sum(int(m.ca.sum()) for m in masks)
    else:
        assert all(torch.equal(c.la, m.la) and torch.equal(c.ca, m.ca) for c, m in zip(coarse, masks))
